"""``HSDPFabricStrategy``: hsdp for Lightning Fabric (``Fabric(strategy=HSDPFabricStrategy(...))``)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from contextlib import AbstractContextManager
from datetime import timedelta
from typing import Any

import torch
from lightning.fabric.strategies import ParallelStrategy
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.optim import Optimizer

from hsdp.checkpoint import CheckpointOptions
from hsdp.engine.clip import clip_grad_norm_
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
from hsdp.integrations.lightning.precision import HSDPFabricPrecision, as_hsdp_precision
from hsdp.integrations.lightning.shared import HSDPStrategyBase


class HSDPFabricStrategy(HSDPStrategyBase, ParallelStrategy):
    """Lightning Fabric on hsdp: ``fabric.setup(model, optimizer)`` returns an ``hsdp.ShardedModel`` (inside
    Fabric's wrapper) and an ``hsdp.ShardedOptimizer``.

    ::

        fabric = Fabric(strategy=HSDPFabricStrategy(sharding_degree=2), precision="bf16-mixed")
        fabric.launch()                                   # under torchrun: joins the existing processes
        model, opt = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=3e-4))
        loader = fabric.setup_dataloaders(loader)         # a DistributedSampler by data-parallel rank
        with fabric.no_backward_sync(model, enabled=accumulating):   # in-node reduce-scatter only
            fabric.backward(loss)
        fabric.clip_gradients(model, opt, max_norm=1.0)   # hsdp.clip_grad_norm_: returns the total norm
        fabric.save("ckpt/step-10", {"model": model, "optimizer": opt, "step": 10})   # hsdp checkpoint

    Arguments are those of :class:`hsdp.integrations.lightning.HSDPStrategy`. One ``ShardedOptimizer`` per
    checkpoint; ``filter=`` and ``storage_options=`` of ``fabric.save`` are refused (the checkpoint holds the
    whole model: export what you need with ``hsdp export``).
    """

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
        self._models: list[ShardedModel] = []
        super().__init__(cluster_environment=TorchrunEnvironment())
        self._backward_sync_control = _HSDPBackwardSyncControl()

    def __repr__(self) -> str:
        return f"HSDPFabricStrategy(sharding_degree={self.options.sharding_degree}) (for lightning.fabric.Fabric)"

    # -- precision: Lightning's flag as hsdp's policy (see precision.py) -------------------------------------
    @property
    def precision(self) -> HSDPFabricPrecision:
        return self._precision if self._precision is not None else HSDPFabricPrecision()

    @precision.setter
    def precision(self, precision: Any) -> None:
        self._precision = as_hsdp_precision(precision, HSDPFabricPrecision)

    # -- processes -------------------------------------------------------------------------------------
    def setup_environment(self) -> None:
        self._setup_hsdp_environment()
        super().setup_environment()  # the accelerator's device (the GPU of LOCAL_RANK)

    # -- model and optimizers ----------------------------------------------------------------------------
    def setup_module_and_optimizers(self, module: nn.Module, optimizers: list[Optimizer],
                                    scheduler: Any = None) -> tuple[nn.Module, list[Optimizer], Any]:
        model = self.setup_module(module)
        return model, [self._shard_optimizer(model, opt) for opt in optimizers], scheduler

    def setup_module(self, module: nn.Module) -> ShardedModel:
        model = wrap_module(module, self.mesh, self.options, self._policy(self.precision))
        self.precision.attach(model)
        if model not in self._models:
            self._models.append(model)
        return model

    def setup_optimizer(self, optimizer: Optimizer) -> ShardedOptimizer:
        return self._shard_optimizer(self._owner(optimizer), optimizer)

    def _owner(self, optimizer: Optimizer) -> ShardedModel:
        params = {id(p) for g in optimizer.param_groups for p in g["params"]}
        owners = [m for m in self._models if any(id(p) in params for p in nn.Module.parameters(m))]
        if len(owners) == 1 or (not owners and len(self._models) == 1):
            return (owners or self._models)[0]
        raise ValueError("fabric.setup_optimizers: set up the model first (fabric.setup_module(model)) and build the "
                         "optimizer on that model's parameters, or pass both: fabric.setup(model, optimizer)")

    @staticmethod
    def _shard_optimizer(model: ShardedModel, optimizer: Optimizer) -> ShardedOptimizer:
        return optimizer if isinstance(optimizer, ShardedOptimizer) else ShardedOptimizer(model, optimizer)

    def module_to_device(self, module: nn.Module) -> None:
        pass  # ShardedModel puts each shard on the mesh's device when it wraps

    def module_init_context(self, empty_init: bool | None = None) -> AbstractContextManager:
        """``fabric.init_module(empty_init=True)``: build on the meta device; ``setup`` then materialises only this
        rank's shards (``reset_parameters()``, the same seed on every rank)."""
        if empty_init:
            stack = contextlib.ExitStack()
            stack.enter_context(torch.device("meta"))
            stack.enter_context(self.precision.module_init_context())
            return stack
        return super().module_init_context(empty_init)

    # -- gradients ---------------------------------------------------------------------------------------
    def clip_gradients_norm(self, module: nn.Module, optimizer: Optimizer, max_norm: float, norm_type: float = 2.0,
                            error_if_nonfinite: bool = True) -> torch.Tensor:
        """``hsdp.clip_grad_norm_``: the norm of the whole gradient (communicated in the node only), on every rank."""
        if not isinstance(module, ShardedModel):
            raise ValueError("fabric.clip_gradients: pass the model returned by fabric.setup")
        return clip_grad_norm_(module, max_norm, norm_type, on_nonfinite="error" if error_if_nonfinite else "warn")

    def all_reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        return self._all_reduce(tensor, group, reduce_op)

    # -- checkpoints (see checkpoint.py) -------------------------------------------------------------------
    def save_checkpoint(self, path: str | os.PathLike, state: dict[str, Any], storage_options: Any = None,
                        filter: dict[str, Callable[[str, Any], bool]] | None = None) -> None:
        """``fabric.save(path, state)``: the model and optimizer as an hsdp checkpoint in the directory ``path``,
        the rest of ``state`` (rank 0's) inside it. A collective."""
        if storage_options is not None or filter is not None:
            raise ValueError("HSDPFabricStrategy saves the whole model as an hsdp checkpoint: drop storage_options= "
                             "and filter= (export the weights you need: `hsdp export PATH --to model.safetensors`)")
        model, optimizer, rest = _split(state)
        metadata = {k: v.state_dict() if _is_stateful(v) else v for k, v in rest.items()}
        save_lightning_checkpoint(path, model, optimizer, metadata, step=None, options=self.options.checkpoint_options)

    def load_checkpoint(self, path: str | os.PathLike, state: Any = None, strict: bool = True,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """``fabric.load(path, state)``: restores the model and optimizer of ``state`` (any mesh shape), then its
        other entries in place (``load_state_dict`` for objects that have one); returns what ``state`` did not ask
        for. ``fabric.load_raw(path, model)`` loads the model alone. A collective."""
        if isinstance(state, nn.Module):
            state = {"model": state}
        if not isinstance(state, dict) or not state:
            raise ValueError("fabric.load with HSDPFabricStrategy restores into objects: pass state={'model': model, "
                             "'optimizer': optimizer, ...} (the model from fabric.setup)")
        model, optimizer, rest = _split(state)
        metadata = load_lightning_checkpoint(path, model, optimizer, options=self.options.checkpoint_options,
                                   weights_only=weights_only)
        missing = [k for k in rest if k not in metadata]
        if strict and missing:
            raise KeyError(f"the checkpoint {path} has no entry {missing[0]!r}: save it, or load with strict=False")
        for key in [k for k in rest if k in metadata]:
            if _is_stateful(state[key]):
                state[key].load_state_dict(metadata.pop(key))
            else:
                state[key] = metadata.pop(key)
        return metadata

    def teardown(self) -> None:
        self.cluster_environment.teardown()
        self.precision.teardown()
        self.accelerator.teardown()


class _HSDPBackwardSyncControl(_BackwardSyncControl):
    """``fabric.no_backward_sync(model)``: hsdp's ``no_sync``, gradients reduce-scattered in the node each
    micro-batch into an fp32 sum, sent across nodes once, by the first backward after the block."""

    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        if not isinstance(module, ShardedModel):
            raise ValueError("fabric.no_backward_sync: pass the model returned by fabric.setup")
        return module.no_sync() if enabled else contextlib.nullcontext()


def _is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def _split(state: dict[str, Any]) -> tuple[ShardedModel, ShardedOptimizer | None, dict[str, Any]]:
    """The one model, the (at most one) optimizer, and everything else of a Fabric ``state`` dict."""
    models = [v for v in state.values() if isinstance(v, ShardedModel)]
    optimizers = [v for v in state.values() if isinstance(v, Optimizer)]
    plain = [k for k, v in state.items() if isinstance(v, nn.Module) and not isinstance(v, ShardedModel)]
    if plain or len(models) != 1:
        raise ValueError(f"an hsdp checkpoint holds one model set up by the HSDP strategy, got {len(models)} "
                         f"(and plain modules {plain}): pass the model from fabric.setup, one per checkpoint path")
    if len(optimizers) > 1 or any(not isinstance(o, ShardedOptimizer) for o in optimizers):
        raise ValueError("an hsdp checkpoint holds at most one optimizer, the one from fabric.setup: use one optimizer "
                         "with several param groups, or save each to its own path")
    rest = {k: v for k, v in state.items() if not isinstance(v, (nn.Module, Optimizer))}
    return models[0], (optimizers[0] if optimizers else None), rest
