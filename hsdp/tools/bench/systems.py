"""How each system under comparison wraps the same model: hsdp and its peers, one function each."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

import hsdp
from hsdp.engine.hops import named_hop


@dataclass(frozen=True)
class Wrapped:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    # Called before each micro-batch's backward with "is this the last micro-batch of the step".
    set_sync: Callable[[bool], None]


def _adamw(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, foreach=True)


def _hsdp(model: nn.Module, dm: DeviceMesh, lr: float, hop: str = "fp32", shard_optimizer: bool = False) -> Wrapped:
    m = hsdp.ShardedModel(model, mesh=hsdp.init_mesh(device_mesh=dm), replica_hop=named_hop(hop),
                          shard_optimizer_across_replicas=shard_optimizer)
    return Wrapped(m, hsdp.ShardedOptimizer(m, _adamw(m, lr)), m.set_requires_all_reduce)


def _fsdp2(model: nn.Module, dm: DeviceMesh, lr: float) -> Wrapped:
    mp = MixedPrecisionPolicy()
    for block in model.blocks:
        fully_shard(block, mesh=dm, mp_policy=mp)
    fully_shard(model, mesh=dm, mp_policy=mp)
    return Wrapped(model, _adamw(model, lr), model.set_requires_all_reduce)


def _fsdp2_full(model: nn.Module, dm: DeviceMesh, lr: float) -> Wrapped:
    flat = DeviceMesh(dm.device_type, dm.mesh.flatten(), mesh_dim_names=("shard",))
    for block in model.blocks:
        fully_shard(block, mesh=flat)
    fully_shard(model, mesh=flat)
    return Wrapped(model, _adamw(model, lr), model.set_requires_gradient_sync)


def _ddp(model: nn.Module, dm: DeviceMesh, lr: float) -> Wrapped:
    ddp = DistributedDataParallel(model)

    def set_sync(last: bool) -> None:
        ddp.require_backward_grad_sync = last

    return Wrapped(ddp, _adamw(ddp, lr), set_sync)


SYSTEMS: dict[str, Callable[..., Wrapped]] = {
    "hsdp": _hsdp,
    "hsdp-bf16-hop": lambda m, dm, lr: _hsdp(m, dm, lr, "bf16"),
    "hsdp-int8-hop": lambda m, dm, lr: _hsdp(m, dm, lr, "int8"),
    # Optimizer state and reduced gradients over all R x S ranks (ZeRO over the mesh); parameters by node.
    "hsdp-opt-across-replicas": lambda m, dm, lr: _hsdp(m, dm, lr, shard_optimizer=True),
    "fsdp2-hsdp": _fsdp2,
    "fsdp2-full": _fsdp2_full,
    "ddp": _ddp,
}
