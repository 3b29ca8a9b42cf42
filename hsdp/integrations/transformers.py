"""``HSDPTrainer``: ``transformers.Trainer`` training an hsdp model, a drop-in with a few hsdp options.

::

    from hsdp.integrations.transformers import HSDPTrainer

    trainer = HSDPTrainer(model=LlamaForCausalLM(config), args=TrainingArguments(...), train_dataset=...,
                          sharding_degree=8)         # or mesh=hsdp.init_mesh(...), mixed_precision=..., ...
    trainer.train()                                  # torchrun --nnodes N --nproc-per-node 8 train.py
    trainer.save_model("out")                        # a Hugging Face folder: from_pretrained("out")

What changes against ``Trainer`` (everything else is Trainer's own: data loading, logging, evaluation,
callbacks, schedulers, ``max_grad_norm``, ``gradient_accumulation_steps``, ``gradient_checkpointing``):

* the model is wrapped once in ``hsdp.ShardedModel`` (in place: the same object, its class swapped) right after
  Trainer creates its Accelerator, and prepared through ``hsdp.integrations.accelerate.prepare_model``, so
  accelerate never wraps it in DDP; an already wrapped ShardedModel is taken as is;
* Trainer's optimizer (``args.optim``, or ``optimizers=``/``optimizer_cls_and_kwargs=``) is built on the DTensor
  parameters and wrapped in ``hsdp.ShardedOptimizer``; the scheduler is Trainer's, on that optimizer;
* checkpoints (``save_strategy``) hold the model and optimizer as an hsdp sharded checkpoint in
  ``checkpoint-N/hsdp_model`` (each rank writes its part once; no consolidated weights there), beside Trainer's
  ``scheduler.pt``, per-rank ``rng_state_<i>.pth``, ``trainer_state.json`` and ``config.json``;
  ``resume_from_checkpoint`` reads them back with ``hsdp.load_checkpoint`` (onto any mesh shape) and Trainer
  skips the batches already seen, so a resumed run continues exactly; ``load_best_model_at_end`` reads the
  model part;
* the gradient norm (logged, and clipped to ``max_grad_norm``) is ``hsdp.clip_grad_norm_``'s: the whole model's,
  tied weights once, in one all-reduce inside the node;
* ``save_model()`` writes a Hugging Face folder with every rank taking part
  (``hsdp.integrations.hf_folder.save_pretrained``: the original architecture name, tied weights once).

Unchanged and checked in ``tests/test_integration_trainer.py``: accelerate's data loader gives each rank its own
part of the global batch (hsdp's data-parallel rank is the global rank without tensor parallelism; on an elastic
mesh, where each replica is a torchrun job of its own, the training loader is split by the mesh's data-parallel
rank and size instead: ``hsdp.integrations.accelerate.split_by_mesh``, tested in ``tests/test_integration_elastic.py``),
accumulation micro-batches run under accelerate's ``no_sync``, which calls ``model.no_sync()``: reduce-scatter
inside the node on every micro-batch, one inter-node all-reduce per optimizer step.

Big models (a 7B-class config does not fit whole on every rank): build the parameters on the meta device,
wrap, load the weights shard by shard, then hand the wrapped model over::

    mesh = hsdp.init_mesh(sharding_degree=8)            # before the Trainer: the process group from torchrun
    with accelerate.init_empty_weights():               # parameters on meta (no memory), buffers real
        model = LlamaForCausalLM(LlamaConfig.from_pretrained(folder))
    model.tie_weights()                                 # init_empty_weights re-created the tied head apart
    model = hsdp.ShardedModel(model, mesh=mesh, mixed_precision=hsdp.MixedPrecision(torch.bfloat16))
    hsdp.load_pretrained(model, folder)                 # each rank reads only its rows of the safetensors
    trainer = HSDPTrainer(model=model, args=args, train_dataset=...)

``init_empty_weights`` rather than ``torch.device("meta")``: Llama's rotary tables are buffers computed at
construction and never stored, so ``load_pretrained`` cannot fill them on meta. Per-rank memory is then the
shards (1/S of parameters, gradients and AdamW state) plus one unit gathered at a time, never the full model;
``save_model`` consolidates on rank 0's host memory.

Not supported (``ValueError`` naming the fix): ``fp16`` (use ``bf16``, or ``hsdp.MixedPrecision``),
``torch_compile`` (compile the blocks: ``for layer in model.model.layers: layer.compile()``), Trainer's FSDP and
DeepSpeed options and ``parallelism_config`` (hsdp shards the model itself), tensor-parallel meshes.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from accelerate.optimizer import AcceleratedOptimizer
from torch import nn
from transformers import Trainer
from transformers.trainer import SCHEDULER_NAME, TRAINING_ARGS_NAME

from hsdp.checkpoint import load_checkpoint, save_checkpoint
from hsdp.checkpoint.lease import release_lease
from hsdp.checkpoint.resolve import candidates
from hsdp.engine.agreement import on_rank0
from hsdp.engine.clip import clip_grad_norm_
from hsdp.engine.collectives import Comm
from hsdp.engine.hops import ReplicaHop
from hsdp.engine.mesh import HSDPMesh
from hsdp.engine.model import ShardedModel
from hsdp.engine.optim.sharded_optimizer import ShardedOptimizer
from hsdp.engine.policy import MixedPrecision
from hsdp.engine.wrap import WrapPolicy
from hsdp.integrations.accelerate import check_accelerator, checkpoint_dir, prepare_model, split_by_mesh
from hsdp.integrations.hf_folder import architecture_name, save_pretrained

__all__ = ["HSDPTrainer", "resume_dir"]


class HSDPTrainer(Trainer):
    """``transformers.Trainer`` on an hsdp model. Takes Trainer's arguments, plus (keyword-only) those of
    ``hsdp.ShardedModel``: ``sharding_degree`` or ``mesh`` (default: ``hsdp.init_mesh()``, a node's ranks),
    ``mixed_precision``, ``replica_hop``, ``shard_optimizer_across_replicas``, ``wrap``, ``reshard_after_forward``.
    Pass none of them with a model that is already a ShardedModel. See the module docstring for what differs
    from ``Trainer`` and what is refused."""

    def __init__(self, *args: Any, sharding_degree: int | None = None, mesh: HSDPMesh | None = None,
                 mixed_precision: MixedPrecision | None = None, replica_hop: ReplicaHop | None = None,
                 shard_optimizer_across_replicas: bool = False, wrap: WrapPolicy = None,
                 reshard_after_forward: bool = True, **kwargs: Any) -> None:
        # Read by create_accelerator_and_postprocess, which Trainer.__init__ calls before anything else.
        self._hsdp_options = {"sharding_degree": sharding_degree, "mesh": mesh, "mixed_precision": mixed_precision,
                              "replica_hop": replica_hop, "wrap": wrap,
                              "shard_optimizer_across_replicas": shard_optimizer_across_replicas,
                              "reshard_after_forward": reshard_after_forward}
        super().__init__(*args, **kwargs)

    # -- the model: wrapped once, never DDP ----------------------------------------------------------------
    def create_accelerator_and_postprocess(self) -> None:
        _check_args(self.args)
        super().create_accelerator_and_postprocess()
        check_accelerator(self.accelerator)
        if self.model is not None:
            self.model = self._shard(self.model)

    def call_model_init(self, trial: Any = None) -> nn.Module:
        return self._shard(super().call_model_init(trial))

    def _shard(self, model: nn.Module) -> ShardedModel:
        """Wrap ``model`` (in place) unless it is a ShardedModel already, and prepare it without DDP."""
        if not isinstance(model, ShardedModel):
            model = ShardedModel(model, **self._hsdp_options)
        elif _changed(self._hsdp_options):
            raise ValueError("the model is already a ShardedModel: pass the hsdp options to hsdp.ShardedModel, or "
                             "pass the plain model to HSDPTrainer")
        # The returned object is the model itself (torch_compile, the only thing that would wrap it, is refused).
        prepare_model(self.accelerator, model)
        return model

    # -- data: every replica its own part ----------------------------------------------------------------------
    def get_train_dataloader(self) -> torch.utils.data.DataLoader:
        # Split by the mesh's data-parallel rank and size: on an elastic mesh accelerate's processes are one
        # replica's. Evaluation loaders stay accelerate's: each replica evaluates all of it (its metrics are
        # gathered over its own ranks).
        with split_by_mesh(self.accelerator, self.model.mesh):
            return super().get_train_dataloader()

    # -- the optimizer: Trainer's, over the shards -----------------------------------------------------------
    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        optimizer = super().create_optimizer(model)
        if not isinstance(optimizer, ShardedOptimizer):
            self.optimizer = ShardedOptimizer(self.model, optimizer)
        return self.optimizer

    # -- clipping: hsdp's norm ------------------------------------------------------------------------------
    def _clip_grad_norm(self, model: nn.Module) -> torch.Tensor:
        # The number accelerate's DTensor-aware clip_grad_norm_ gives, in one all-reduce over the shard group (the
        # whole mesh with shard_optimizer_across_replicas, where DTensor would issue two and warn), counted in
        # model.comm_stats().
        return clip_grad_norm_(self.model, self.args.max_grad_norm)

    def _get_grad_norm(self, model: nn.Module, grad_norm: torch.Tensor | None = None) -> torch.Tensor:
        return clip_grad_norm_(self.model, float("inf")) if grad_norm is None else grad_norm

    def _sharded_optimizer(self) -> ShardedOptimizer | None:
        optimizer = self.optimizer
        while isinstance(optimizer, AcceleratedOptimizer):
            optimizer = optimizer.optimizer
        return optimizer

    # -- saving: a Hugging Face folder, or an hsdp checkpoint inside Trainer's checkpoint -------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """A Hugging Face folder in ``output_dir`` (default ``args.output_dir``) that ``from_pretrained`` loads;
        every rank must call it (Trainer does). Inside a checkpoint (``_internal_call``, from Trainer's
        ``_save_checkpoint``) the model goes into the sharded hsdp checkpoint instead, with the optimizer unless
        ``save_only_model``."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if _internal_call:
            self._save_sharded(output_dir)
        else:
            save_pretrained(self.model, output_dir)
        if self.args.should_save:
            self._save_extras(output_dir, config=_internal_call)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_sharded(self, output_dir: str) -> None:
        run_dir = checkpoint_dir(output_dir)
        optimizer = None if self.args.save_only_model else self._sharded_optimizer()
        save_checkpoint(run_dir, self.model, optimizer, step=self.state.global_step)
        release_lease(run_dir)  # one checkpoint per folder, which rotation deletes: nothing to hold on to

    def _save_extras(self, output_dir: str, config: bool) -> None:
        """What Trainer's ``_save`` writes beside the weights (rank 0): tokenizer/processor, training args; in a
        checkpoint also ``config.json`` (with the original architecture name), so the folder names its model."""
        os.makedirs(output_dir, exist_ok=True)
        if config:
            self.model.config.architectures = [architecture_name(self.model)]
            self.model.config.save_pretrained(output_dir)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        # The optimizer is in the hsdp checkpoint (save_model above); the scheduler is small and the same on
        # every rank: rank 0 writes it where Trainer does.
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    # -- resuming ------------------------------------------------------------------------------------------
    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        # Called before the optimizer exists; the hsdp checkpoint holds both, so both are read together in
        # _load_optimizer_and_scheduler (Trainer calls it on every resume, after creating the optimizer).
        resume_dir(resume_from_checkpoint)  # only the check: refuse a checkpoint of another trainer early

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        run_dir = resume_dir(checkpoint)
        optimizer = self._sharded_optimizer() if _holds_optimizer(self.model, run_dir) else None
        load_checkpoint(run_dir, self.model, optimizer)
        scheduler = os.path.join(checkpoint, SCHEDULER_NAME)
        if optimizer is not None and os.path.isfile(scheduler):
            self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))

    def _load_best_model(self) -> None:
        best = self.state.best_model_checkpoint
        if best is None or not os.path.isdir(checkpoint_dir(best)):
            return super()._load_best_model()
        load_checkpoint(checkpoint_dir(best), self.model)


def _check_args(args: Any) -> None:
    """``ValueError`` naming the fix for a TrainingArguments setting hsdp cannot train under."""
    if args.fp16:
        raise ValueError("fp16=True: accelerate's GradScaler would see one rank's gradient shards; use bf16=True, or "
                         "mixed_precision=hsdp.MixedPrecision(torch.bfloat16) on HSDPTrainer")
    if args.torch_compile:
        raise ValueError("torch_compile=True compiles the whole wrapped model; compile its blocks instead, before "
                         "training: for layer in model.model.layers: layer.compile()")
    if args.fsdp or args.deepspeed or getattr(args, "parallelism_config", None) is not None:
        raise ValueError("HSDPTrainer shards the model with hsdp: leave fsdp, deepspeed and parallelism_config unset")


def resume_dir(checkpoint: str | os.PathLike) -> str:
    """The hsdp run directory inside the Trainer checkpoint ``checkpoint``; ``ValueError`` naming the fix for a
    checkpoint without one (written by a plain Trainer: its ``optimizer.pt`` is one process's state)."""
    run_dir = checkpoint_dir(checkpoint)
    if not os.path.isdir(run_dir):
        raise ValueError(f"no hsdp checkpoint at {run_dir}: the checkpoint was not written by HSDPTrainer (a plain "
                         f"Trainer's optimizer.pt is one process's state); resume from an HSDPTrainer checkpoint, or "
                         f"start from its weights (hsdp.load_pretrained) with a fresh optimizer")
    return run_dir


def _changed(options: dict[str, Any]) -> bool:
    defaults = {"shard_optimizer_across_replicas": False, "reshard_after_forward": True}
    return any(v != defaults.get(k) for k, v in options.items())


def _holds_optimizer(model: ShardedModel, run_dir: str) -> bool:
    """Whether the newest valid checkpoint in ``run_dir`` has optimizer state (not saved with
    ``save_only_model``); decided by rank 0 for every rank."""
    comm = Comm(model.mesh)
    return on_rank0(comm, f"reading {run_dir}", lambda: candidates(run_dir)[0].manifest.optimizer is not None)
