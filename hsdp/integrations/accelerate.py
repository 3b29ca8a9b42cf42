"""An hsdp model in ``accelerate.Accelerator``: prepared without a DDP wrap, checkpointed with hsdp's sharded
checkpoints. One call sets it up, :func:`prepare`, in place of ``accelerator.prepare``::

    from hsdp.integrations import accelerate as hsdp_accelerate

    accelerator = Accelerator(gradient_accumulation_steps=2)
    model = hsdp.ShardedModel(model, mesh=hsdp.init_mesh(sharding_degree=8))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    model, optimizer, loader, scheduler = hsdp_accelerate.prepare(accelerator, model, optimizer, loader, scheduler)
    for batch in loader:                                # each rank its own part of the global batch
        with accelerator.accumulate(model):             # micro-batches: model.no_sync(), nodes crossed once
            accelerator.backward(model(**batch).loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)   # the whole model's norm
            optimizer.step(); scheduler.step(); optimizer.zero_grad()
    accelerator.save_state("ckpt")                      # model + optimizer: an hsdp checkpoint in ckpt/hsdp_model
    accelerator.load_state("ckpt")
    hsdp_accelerate.save_pretrained(model, "out")       # a Hugging Face folder; every rank calls it

What :func:`prepare` does with each object (the rest goes to ``accelerator.prepare`` unchanged):

* a ``ShardedModel``: ``accelerator.prepare_model(model, device_placement=False, evaluation_mode=True)``, the
  public path accelerate itself takes for models that own their placement and gradient reduction (Trainer's
  ``from_pretrained(distributed_config=...)`` models): autocast and ``torch.compile`` as configured, no DDP
  (which refuses DTensor parameters), no device move (hsdp put the shards on ``mesh.device``). The model is
  then marked prepared, so a later ``accelerator.prepare(model)`` returns it unchanged.
* an optimizer over a ShardedModel's parameters: wrapped in ``hsdp.ShardedOptimizer`` (unless it is one), then
  in accelerate's ``AcceleratedOptimizer`` (steps and ``zero_grad`` skipped on accumulation micro-batches, as
  always) *without* registering it with the accelerator: accelerate's own optimizer save writes rank 0's
  shards only, and its load would give every rank rank 0's shards. The hooks below save and load it.
* on the first call, a save and a load pre-hook (``register_save_state_pre_hook`` /
  ``register_load_state_pre_hook``): ``save_state(dir)`` writes each prepared ShardedModel and its optimizer
  with ``hsdp.save_checkpoint`` into ``dir/hsdp_model`` (``hsdp_model_1``, ... for more models) and takes
  their weights out of the list accelerate would write itself; ``load_state(dir)`` reads them back with
  ``hsdp.load_checkpoint`` (any mesh shape) and takes the models out of the list accelerate would load.
  Schedulers, RNG states (per process), the accumulation step, dataloader samplers and registered objects
  are saved and loaded by accelerate, as for any model.

Accumulation: ``accelerator.accumulate(model)`` / ``accelerator.no_sync(model)`` call ``model.no_sync()`` on
multi-process runs (accelerate looks the method up on the model), hsdp's: each micro-batch is reduce-scattered
inside the node and the inter-node all-reduce runs once per optimizer step. Clipping:
``accelerator.clip_grad_norm_`` computes the norm over DTensor gradients (the whole model's, tied weights once);
``hsdp.clip_grad_norm_(model, max_norm)`` is the same number in one all-reduce inside the node, counted in
``model.comm_stats()`` (with ``shard_optimizer_across_replicas`` DTensor issues two all-reduces and warns; hsdp's
issues one). Mixed precision: ``Accelerator(mixed_precision="bf16")`` autocasts the forward as for any model;
``hsdp.MixedPrecision`` also gathers and reduces in bf16.

Data: accelerate splits a data loader by its process index and count, those of the torchrun job it runs in.
On a grid or a heterogeneous mesh they are hsdp's data-parallel rank and size; on an elastic mesh
(``init_mesh(elastic=True)``) each replica is a torchrun job of its own, and every replica would read the same
batches. The loaders :func:`prepare` is given are then split by ``mesh.data_parallel_rank`` and
``mesh.data_parallel_size`` (:func:`split_by_mesh`), every replica its own part, as ``hsdp.distributed_sampler``
does; a shuffling loader needs accelerate's seedable sampler
(``DataLoaderConfiguration(use_seedable_sampler=True)``) and the same seed on every replica (``set_seed``), and
accelerate's dispatching loaders are refused (rank 0 of one replica cannot feed the others). accelerate's own
collectives (``gather``, ``reduce``, ``gather_for_metrics``) still span one replica: prepare an evaluation
loader with ``accelerator.prepare`` (each replica then evaluates all of it).

Not supported (``ValueError`` naming the fix): accelerate's DeepSpeed, FSDP, Megatron-LM and XLA modes (hsdp
shards the model itself), ``mixed_precision="fp16"`` (accelerate's GradScaler sees one rank's shards: use bf16,
or ``hsdp.MixedPrecision`` and ``hsdp.ShardedGradScaler`` in a loop of your own), tensor-parallel meshes
(accelerate splits data over all processes; the ranks of a TP group need the same batch).
``accelerator.save_model`` and ``accelerator.get_state_dict`` see one rank's shards: use :func:`save_pretrained`
or ``hsdp.full_state_dict``. Pass hsdp models and optimizers through :func:`prepare`, not
``accelerator.prepare`` (which wraps the model in DDP and fails).
"""

from __future__ import annotations

import contextlib
import functools
import os
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.data_loader import prepare_data_loader
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.utils import DistributedType
from torch import nn
from torch.utils.data import DataLoader, RandomSampler

from hsdp.checkpoint import load_checkpoint, save_checkpoint
from hsdp.checkpoint.lease import release_lease
from hsdp.engine.mesh import HSDPMesh
from hsdp.engine.model import ShardedModel
from hsdp.engine.optim.sharded_optimizer import ShardedOptimizer
from hsdp.integrations.hf_folder import save_pretrained, tie_aliases

__all__ = ["check_accelerator", "checkpoint_dir", "prepare", "prepare_model", "register_hooks", "save_pretrained",
           "split_by_mesh", "tie_aliases"]

_UNSUPPORTED = (DistributedType.DEEPSPEED, DistributedType.FSDP, DistributedType.MEGATRON_LM, DistributedType.XLA)


def prepare(accelerator: Accelerator, *objects: Any) -> Any:
    """``accelerator.prepare(*objects)`` for a run with hsdp models: each ``ShardedModel`` through
    :func:`prepare_model`, each optimizer of one through ``hsdp.ShardedOptimizer`` and an unregistered
    ``AcceleratedOptimizer``, everything else (data loaders, schedulers, plain models) through
    ``accelerator.prepare``; the save/load hooks registered once. Returns the objects in the order given (one
    object alone, not a tuple, as accelerate does). A model's optimizer is prepared with the model or after it.
    """
    check_accelerator(accelerator)
    hooks = register_hooks(accelerator)
    models = [o for o in objects if isinstance(_base(o), ShardedModel)]
    for model in models:
        _check_mesh(accelerator, _base(model))
    known = models + [pair.model for pair in hooks.pairs]
    out: list[Any] = list(objects)
    rest: list[int] = []
    for i, obj in enumerate(objects):
        if isinstance(_base(obj), ShardedModel):
            out[i] = prepare_model(accelerator, obj)
        elif isinstance(obj, torch.optim.Optimizer) and not isinstance(obj, AcceleratedOptimizer) \
                and (model := _model_of(obj, known)) is not None:
            out[i] = hooks.add(model, obj)
        else:
            rest.append(i)
    if rest:
        with split_by_mesh(accelerator, _data_mesh([_base(m) for m in models] + [p.model for p in hooks.pairs])):
            prepared = accelerator.prepare(*[objects[i] for i in rest])
        for i, obj in zip(rest, prepared if len(rest) > 1 else (prepared,), strict=True):
            out[i] = obj
    for model in models:
        hooks.add_model(_base(model))
    return tuple(out) if len(out) != 1 else out[0]


def prepare_model(accelerator: Accelerator, model: nn.Module) -> nn.Module:
    """Prepare a ShardedModel for ``accelerator`` without a DDP wrap; returns what accelerate returns (the same
    model, or its ``torch.compile`` wrapper when the accelerator compiles).

    ``evaluation_mode=True`` is accelerate's public switch for "mixed precision and torch.compile only": the
    DDP wrap is the part it skips, and hsdp replaces exactly that part (the gradient reduction). It is also the
    path accelerate and Trainer take for models sharded at load time. It marks the model prepared, so a later
    ``accelerator.prepare(model)`` (Trainer's) returns it as is; ``tests/test_integration_accelerate.py``
    checks both, so a change in accelerate shows there first.
    """
    check_accelerator(accelerator)
    _check_mesh(accelerator, _base(model))
    return accelerator.prepare_model(model, device_placement=False, evaluation_mode=True)


def check_accelerator(accelerator: Accelerator) -> None:
    """``ValueError`` naming the fix for an accelerator setting that hsdp cannot run under."""
    if not isinstance(accelerator, Accelerator):
        raise ValueError(f"expected an accelerate.Accelerator, got {type(accelerator).__name__}")
    if accelerator.distributed_type in _UNSUPPORTED:
        raise ValueError(f"accelerate runs in {accelerator.distributed_type.value} mode, which shards or wraps the "
                         f"model itself; hsdp does that: launch without accelerate's DeepSpeed/FSDP/Megatron/XLA "
                         f"configuration (plain multi-process, e.g. torchrun)")
    if accelerator.mixed_precision == "fp16":
        raise ValueError("mixed_precision='fp16': accelerate's GradScaler would see one rank's gradient shards and the "
                         "replicas could skip different steps; use mixed_precision='bf16', or hsdp.MixedPrecision with "
                         "hsdp.ShardedGradScaler in a loop of your own")
    config = getattr(accelerator, "parallelism_config", None)
    if config is not None and (config.tp_enabled or config.cp_enabled):
        raise ValueError("accelerate's tensor/context parallelism is not supported with hsdp models: leave "
                         "parallelism_config out (hsdp's own tensor parallelism is a mesh dim, see hsdp.tp_plans)")


def _check_mesh(accelerator: Accelerator, model: ShardedModel) -> None:
    mesh = model.mesh
    if mesh.tp_degree > 1:
        raise ValueError(f"the model's mesh has tensor parallelism (T={mesh.tp_degree}): accelerate's data loaders "
                         f"give every process its own batch, but the ranks of a TP group need the same one; build "
                         f"the mesh without tensor_parallel_degree, or write the loop with hsdp.distributed_sampler")
    if mesh.world_size != accelerator.num_processes:
        raise ValueError(f"the model's mesh spans {mesh.world_size} ranks but accelerate runs "
                         f"{accelerator.num_processes} process(es): on a machine without GPUs accelerate needs "
                         f"Accelerator(cpu=True) (or ACCELERATE_USE_CPU=1) to see the torchrun world; the mesh and "
                         f"the accelerator must span the same ranks")


@contextlib.contextmanager
def split_by_mesh(accelerator: Accelerator, mesh: HSDPMesh | None) -> Iterator[None]:
    """While open, ``accelerator.prepare`` and ``accelerator.prepare_data_loader`` split data loaders by ``mesh``'s
    data-parallel rank and size, not by accelerate's process index and count (those of this replica's torchrun job
    on an elastic mesh). Nothing changes where the two agree (a grid, a heterogeneous mesh) or without a mesh.
    ``ValueError`` naming the fix for a loader that cannot be split so (see the module doc)."""
    if mesh is None or (mesh.data_parallel_size, mesh.data_parallel_rank) == (accelerator.num_processes,
                                                                              accelerator.process_index):
        yield
        return
    # An attribute of this accelerator object: accelerate's prepare (and Trainer's, through it) looks the method
    # up on the instance, so every loader prepared inside the block comes here.
    accelerator.prepare_data_loader = functools.partial(_prepare_split_loader, accelerator, mesh)
    try:
        yield
    finally:
        del accelerator.prepare_data_loader


def _prepare_split_loader(accelerator: Accelerator, mesh: HSDPMesh, data_loader: DataLoader,
                          device_placement: bool | None = None, slice_fn_for_dispatch: Any = None) -> DataLoader:
    """``Accelerator.prepare_data_loader`` with the mesh's data-parallel rank and size."""
    if getattr(data_loader, "_is_accelerate_prepared", False):
        raise ValueError("this data loader was prepared before (split by accelerate's processes, one replica's on an "
                         "elastic mesh): pass the plain DataLoader to hsdp.integrations.accelerate.prepare")
    if accelerator.dispatch_batches:
        raise ValueError("dispatch_batches=True: on an elastic mesh rank 0 of one replica cannot feed the others; use "
                         "DataLoaderConfiguration(dispatch_batches=False) (each rank reads its own part)")
    if isinstance(data_loader.sampler, RandomSampler) and not accelerator.use_seedable_sampler:
        raise ValueError("a shuffling data loader on an elastic mesh: every replica must shuffle alike, which "
                         "accelerate syncs inside one replica only; use Accelerator(dataloader_config="
                         "DataLoaderConfiguration(use_seedable_sampler=True)) and set_seed(seed) on every replica")
    if device_placement is None:
        device_placement = accelerator.device_placement
    prepared = prepare_data_loader(
        data_loader, accelerator.device, num_processes=mesh.data_parallel_size, process_index=mesh.data_parallel_rank,
        split_batches=accelerator.split_batches, put_on_device=device_placement, rng_types=accelerator.rng_types.copy(),
        dispatch_batches=False, even_batches=accelerator.even_batches, slice_fn_for_dispatch=slice_fn_for_dispatch,
        use_seedable_sampler=accelerator.use_seedable_sampler, data_seed=accelerator.dataloader_config.data_seed,
        non_blocking=accelerator.non_blocking, use_stateful_dataloader=accelerator.use_stateful_dataloader)
    accelerator._dataloaders.append(prepared)  # as accelerate's own does: save_state/load_state see its sampler
    return prepared


def _data_mesh(models: list[ShardedModel]) -> HSDPMesh | None:
    """The mesh that splits the data: the models' (``ValueError`` for models whose meshes split it differently)."""
    splits = {(m.mesh.data_parallel_size, m.mesh.data_parallel_rank) for m in models}
    if len(splits) > 1:
        raise ValueError("the prepared hsdp models are on meshes that split data differently: train the models of "
                         "one accelerator on one mesh")
    return models[0].mesh if models else None


def checkpoint_dir(output_dir: str | os.PathLike, index: int = 0) -> str:
    """Where ``save_state(output_dir)`` puts the hsdp checkpoint of the ``index``-th prepared ShardedModel (an
    hsdp run directory: ``hsdp.load_checkpoint``, ``hsdp export`` read it)."""
    return os.path.join(os.fspath(output_dir), "hsdp_model" if index == 0 else f"hsdp_model_{index}")


class _Pair:
    """A prepared ShardedModel and its ShardedOptimizer (``None`` until one is prepared)."""

    def __init__(self, model: ShardedModel) -> None:
        self.model = model
        self.optimizer: ShardedOptimizer | None = None


class _Hooks:
    """The accelerator's hsdp models and optimizers, and the save/load pre-hooks that checkpoint them."""

    def __init__(self, accelerator: Accelerator) -> None:
        self.accelerator = weakref.ref(accelerator)  # the accelerator holds the hooks: no cycle
        self.pairs: list[_Pair] = []
        accelerator.register_save_state_pre_hook(self.save_hook)
        accelerator.register_load_state_pre_hook(self.load_hook)

    def pair(self, model: ShardedModel) -> _Pair:
        found = next((p for p in self.pairs if p.model is model), None)
        if found is None:
            found = _Pair(model)
            self.pairs.append(found)
        return found

    def add_model(self, model: ShardedModel) -> None:
        self.pair(model)

    def add(self, model: ShardedModel, optimizer: torch.optim.Optimizer) -> AcceleratedOptimizer:
        pair = self.pair(model)
        sharded = optimizer if isinstance(optimizer, ShardedOptimizer) else ShardedOptimizer(model, optimizer)
        if pair.optimizer is not None and pair.optimizer is not sharded:
            raise ValueError("this ShardedModel already has a prepared optimizer: hsdp checkpoints hold one optimizer "
                             "per model; put the parameter groups into one optimizer")
        pair.optimizer = sharded
        # device_placement=False: the state is on the mesh's device already (and a round trip through
        # state_dict would cost a copy); no scaler: fp16 is refused (check_accelerator).
        return AcceleratedOptimizer(sharded, device_placement=False, scaler=None)

    def _indexed(self, models: list[nn.Module]) -> list[tuple[int, _Pair, int]]:
        """(position in ``models``, pair, checkpoint index) of every hsdp model in accelerate's list."""
        found, k = [], 0
        for i, m in enumerate(models):
            pair = next((p for p in self.pairs if p.model is _base(m)), None)
            if pair is not None:
                found.append((i, pair, k))
                k += 1
        return found

    def save_hook(self, models: list[nn.Module], weights: list[dict[str, Any]], output_dir: str) -> None:
        # `models` is the accelerator's own list: read it, never edit it. `weights` is what accelerate is about
        # to write (rank 0's shards only): the hsdp models' entries go.
        indexed = self._indexed(models)
        for _, pair, k in indexed:
            run_dir = checkpoint_dir(output_dir, k)
            save_checkpoint(run_dir, pair.model, pair.optimizer, step=0)
            # Each save_state writes a fresh folder, which accelerate's total_limit may delete later: no lease
            # to keep renewing there once the save is committed.
            release_lease(run_dir)
        for i, _, _ in reversed(indexed):
            del weights[i]

    def load_hook(self, models: list[nn.Module], input_dir: str) -> None:
        indexed = self._indexed(models)
        for _, pair, k in indexed:
            load_checkpoint(checkpoint_dir(input_dir, k), pair.model, pair.optimizer)
        for i, _, _ in reversed(indexed):
            del models[i]  # a list of load_state's own: accelerate then loads only the other models


_HOOKS: weakref.WeakKeyDictionary[Accelerator, _Hooks] = weakref.WeakKeyDictionary()


def register_hooks(accelerator: Accelerator) -> _Hooks:
    """Register the save/load pre-hooks on ``accelerator`` once; returns its registry (what :func:`prepare`
    adds the models and optimizers to)."""
    hooks = _HOOKS.get(accelerator)
    if hooks is None:
        hooks = _HOOKS[accelerator] = _Hooks(accelerator)
    return hooks


def _base(obj: Any) -> Any:
    """The module under a ``torch.compile`` wrapper."""
    return getattr(obj, "_orig_mod", obj) if isinstance(obj, nn.Module) else obj


def _model_of(optimizer: torch.optim.Optimizer, models: list[Any]) -> ShardedModel | None:
    """The ShardedModel whose parameters ``optimizer`` steps; ``None`` for an optimizer of plain parameters."""
    if isinstance(optimizer, ShardedOptimizer):
        model = optimizer._hsdp_model
        if not any(_base(m) is model for m in models):
            raise ValueError("prepare the ShardedOptimizer's model with it (or before it)")
        return model
    params = {id(p) for g in optimizer.param_groups for p in g["params"]}
    for m in models:
        base = _base(m)
        ids = {id(sp.sharded) for sp in base.sharded_params()}
        ids |= {id(sp.original_ref()) for sp in base.sharded_params() if sp.original_ref() is not None}
        if params & ids:
            return base
    if any(getattr(p, "_hsdp_sharded", False) for g in optimizer.param_groups for p in g["params"]):
        raise ValueError("this optimizer steps an hsdp model's parameters: prepare the model with it (or before it)")
    return None
