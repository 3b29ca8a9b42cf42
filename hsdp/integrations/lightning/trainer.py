"""``HSDPStrategy``: hsdp for Lightning's ``Trainer`` (``L.Trainer(strategy=HSDPStrategy(...))``)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Generator, Mapping
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from hsdp.checkpoint import CheckpointOptions
from hsdp.engine.faults.policy import FaultPolicy
from hsdp.engine.hops import ReplicaHop
from hsdp.engine.mesh_init import DEFAULT_FAULT_POLICY, DEFAULT_TIMEOUT
from hsdp.engine.model import ShardedModel
from hsdp.engine.optim.sharded_optimizer import ShardedOptimizer
from hsdp.engine.policy import MixedPrecision
from hsdp.engine.wrap import WrapPolicy
from hsdp.integrations.lightning.checkpoint import load_lightning_checkpoint, save_lightning_checkpoint
from hsdp.integrations.lightning.environment import TorchrunEnvironment
from hsdp.integrations.lightning.options import DEFAULT_CHECKPOINT_OPTIONS, HSDPOptions, wrap_module
from hsdp.integrations.lightning.precision import HSDPPrecision, as_hsdp_precision
from hsdp.integrations.lightning.shared import HSDPStrategyBase


class HSDPStrategy(HSDPStrategyBase, ParallelStrategy):
    """Lightning's ``Trainer`` on hsdp: parameters, gradients and optimizer state sharded over the ``S`` ranks
    of a node and replicated across nodes.

    ::

        trainer = L.Trainer(strategy=HSDPStrategy(sharding_degree=2), precision="bf16-mixed",
                            accumulate_grad_batches=2, gradient_clip_val=1.0)
        trainer.fit(lit_module, ckpt_path=None)   # under torchrun; Lightning launches no process

    * Processes: those torchrun (or the caller) started; ranks and world size come from the process group, not
      from ``devices``/``num_nodes``. The process group is joined when the Trainer sets up (NCCL for a CUDA
      accelerator, gloo for the CPU) unless it exists; then ``hsdp.init_mesh`` builds the mesh
      (``strategy.mesh``; ``self.device_mesh`` in ``configure_model`` is its ``DeviceMesh``, ``["tp"]`` the
      tensor-parallel sub-mesh for ``hsdp.tp_plans``). Nodes of different sizes (torchrun's ``--nproc-per-node``
      differing per node) make a heterogeneous mesh, one replica per node: no ``DeviceMesh`` grid describes it,
      so ``self.device_mesh`` is ``None`` there, as under Lightning's DDP (tensor parallelism is refused on such a
      mesh); ``strategy.mesh`` describes it.
    * Model: after ``configure_model``, the LightningModule itself becomes an ``hsdp.ShardedModel`` (same
      object, same ``state_dict`` keys; every repeated block a unit unless ``wrap=``). Each
      ``training_step``/``validation_step``/... runs as a forward of the module (Lightning's forward redirection),
      so the step may call ``self(x)`` or any submodule. Built with ``trainer.init_module(empty_init=True)``, it
      is materialised shard by shard (``reset_parameters()``).
    * Optimizer: the one ``configure_optimizers`` returns becomes an ``hsdp.ShardedOptimizer`` (LR schedulers
      unchanged); ``gradient_clip_val`` (by norm) clips with ``hsdp.clip_grad_norm_``.
    * Data: a ``DistributedSampler`` by data-parallel rank (every rank distinct data; the ranks of one
      tensor-parallel group share a batch).
    * Accumulation (``accumulate_grad_batches``): hsdp's ``no_sync``, reduce-scatter in the node each
      micro-batch, across nodes once per optimizer step.
    * Precision: ``"32-true"`` or ``"bf16-mixed"`` (hsdp's mixed precision, no autocast, see
      ``hsdp.integrations.lightning.precision``); others raise ``ValueError`` when the Trainer is built.
    * Checkpoints: every checkpoint path is an hsdp run directory (``hsdp.save_checkpoint``: shards written
      once, crash-safe, loadable on any mesh) carrying Lightning's loop, callback and scheduler state, so
      ``trainer.fit(ckpt_path=...)`` resumes exactly (see ``hsdp.integrations.lightning.checkpoint``);
      ``hsdp export PATH --to model.safetensors`` gives weights for a plain ``load_state_dict``.

    Arguments: ``sharding_degree`` (default: ranks per node), ``tensor_parallel_degree`` (a 3-D mesh, apply
    the TP plan in ``configure_model``), ``mixed_precision`` (an explicit ``hsdp.MixedPrecision``; wins over
    ``precision=``), ``replica_hop`` (e.g. ``hsdp.AllReduceHop(torch.bfloat16)``),
    ``shard_optimizer_across_replicas``, ``wrap``, ``reshard_after_forward`` (as ``hsdp.ShardedModel``),
    ``device_mesh`` (an hsdp-named ``DeviceMesh`` instead of the degrees; Lightning's ``data_parallel`` x
    ``tensor_parallel`` mesh is refused), ``fault_policy``, ``timeout`` (as ``hsdp.init_mesh``) and
    ``checkpoint_options`` (default ``CheckpointOptions(keep_last=1)``: one checkpoint per path). Every value
    is checked here, before any process group exists. Not supported: several optimizers, ``storage_options``.
    """

    strategy_name = "hsdp"

    def __init__(self, sharding_degree: int | None = None, *, tensor_parallel_degree: int | None = None,
                 mixed_precision: MixedPrecision | None = None, replica_hop: ReplicaHop | None = None,
                 shard_optimizer_across_replicas: bool = False, wrap: WrapPolicy = None,
                 reshard_after_forward: bool = True, device_mesh: DeviceMesh | None = None,
                 fault_policy: FaultPolicy | None = DEFAULT_FAULT_POLICY, timeout: timedelta = DEFAULT_TIMEOUT,
                 checkpoint_options: CheckpointOptions = DEFAULT_CHECKPOINT_OPTIONS) -> None:
        self.options = HSDPOptions(sharding_degree, tensor_parallel_degree, mixed_precision, replica_hop,
                                   shard_optimizer_across_replicas, wrap, reshard_after_forward, device_mesh,
                                   fault_policy, timeout, checkpoint_options)
        self._mesh = None
        super().__init__(cluster_environment=TorchrunEnvironment())
        self.num_nodes = 1  # set by the Trainer's connector; not consulted (the process group decides)

    def __repr__(self) -> str:
        # Shown in Fabric's error when this Trainer strategy is passed to Fabric.
        return (f"HSDPStrategy(sharding_degree={self.options.sharding_degree}) (for lightning.pytorch.Trainer; "
                f"Fabric takes hsdp.integrations.lightning.HSDPFabricStrategy)")

    @property
    def is_distributed(self) -> bool:
        return True  # the Trainer then adds the distributed sampler and syncs logged metrics

    # -- precision: Lightning's flag as hsdp's policy (see precision.py) -------------------------------------
    @property
    def precision_plugin(self) -> HSDPPrecision:
        return self._precision_plugin if self._precision_plugin is not None else HSDPPrecision()

    @precision_plugin.setter
    def precision_plugin(self, precision_plugin: Any) -> None:
        self._precision_plugin = as_hsdp_precision(precision_plugin, HSDPPrecision)

    # -- processes -------------------------------------------------------------------------------------
    def setup_environment(self) -> None:
        self._setup_hsdp_environment()
        super().setup_environment()  # the accelerator's device (the GPU of LOCAL_RANK)
        assert self.lightning_module is not None
        # LightningModule.device_mesh: None on a heterogeneous mesh (no grid; see the class doc).
        self.lightning_module._device_mesh = self.mesh.device_mesh

    # -- model and optimizer ----------------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.lightning_module is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        sharded = wrap_module(module, self.mesh, self.options, self._policy(self.precision_plugin))
        self.precision_plugin.attach(sharded)
        module.to(self.root_device)  # the shards are there already; this updates LightningModule.device
        self.model = _StepThroughForward(module)
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()

    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        self._reset_optimizers_and_schedulers()  # a second fit wraps the optimizers configure_optimizers builds anew
        super().setup_optimizers(trainer)
        if len(self.optimizers) > 1:
            raise ValueError(f"HSDPStrategy takes one optimizer, configure_optimizers returned {len(self.optimizers)}: "
                             f"use one optimizer with several param groups")
        self.optimizers = [opt if isinstance(opt, ShardedOptimizer) else ShardedOptimizer(self._sharded(), opt)
                           for opt in self.optimizers]

    def _sharded(self) -> ShardedModel:
        module = self.lightning_module
        if not isinstance(module, ShardedModel):
            raise RuntimeError("HSDPStrategy: the LightningModule is wrapped in strategy.setup (trainer.fit/validate)")
        return module

    def model_to_device(self) -> None:
        pass  # ShardedModel puts each shard on the mesh's device when it wraps

    @contextlib.contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """``trainer.init_module(empty_init=True)``: build on the meta device; ``setup`` materialises the shards."""
        if not empty_init:
            with super().tensor_init_context(empty_init):
                yield
            return
        with torch.device("meta"), self.precision_plugin.tensor_init_context():
            yield

    @contextlib.contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Micro-batches of ``accumulate_grad_batches``: reduce-scatter in the node only (``no_sync``)."""
        with self._sharded().no_sync():
            yield

    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        return self._all_reduce(tensor, group, reduce_op)

    # -- checkpoints (see checkpoint.py) -------------------------------------------------------------------
    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # load into the wrapped model and the ShardedOptimizer

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # load_checkpoint restores the optimizer itself

    def lightning_module_state_dict(self) -> dict[str, Any]:
        return self.lightning_module.state_dict()  # DTensor shards, local: the real save is save_checkpoint's

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        pass  # load_checkpoint loaded it

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass  # load_checkpoint loaded it

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: str | os.PathLike,
                        storage_options: Any = None) -> None:
        """The model and optimizer through ``hsdp.save_checkpoint`` into the directory ``filepath``; the rest of
        ``checkpoint`` (rank 0's) inside it. A collective (the Trainer calls it on every rank)."""
        if storage_options is not None:
            raise ValueError("HSDPStrategy writes hsdp checkpoints and takes no storage_options: drop the argument")
        metadata = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        # save_weights_only checkpoints carry no optimizer states: then none is saved.
        optimizer = self.optimizers[0] if "optimizer_states" in checkpoint and self.optimizers else None
        save_lightning_checkpoint(filepath, self._sharded(), optimizer, metadata, step=checkpoint_step(checkpoint),
                        options=self.options.checkpoint_options)

    def load_checkpoint(self, checkpoint_path: str | os.PathLike, weights_only: bool | None = None) -> dict[str, Any]:
        module = self._sharded()
        fitting = module.trainer.state.fn == TrainerFn.FITTING
        optimizer = self.optimizers[0] if fitting and self.optimizers else None
        return load_lightning_checkpoint(checkpoint_path, module, optimizer, options=self.options.checkpoint_options,
                               weights_only=weights_only)

    def teardown(self) -> None:
        # Not the base class's: it moves the model to the CPU, which a GPU mesh's shards cannot leave.
        assert self.cluster_environment is not None and self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()


class _StepThroughForward(nn.Module):
    """``strategy.model``: the LightningModule's steps reach it as a call of the module (Lightning's forward
    redirection patches its ``forward`` to the step), so hsdp's root hooks gather the root unit around the whole
    step, whatever the step calls (``self(x)``, ``self.model(x)``, a layer)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)


def checkpoint_step(checkpoint: Mapping[str, Any]) -> int | None:
    step = checkpoint.get("global_step")
    return step if isinstance(step, int) else None
