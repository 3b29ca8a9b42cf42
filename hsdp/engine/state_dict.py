"""Consolidated (unsharded) state dicts."""

from __future__ import annotations

from collections.abc import Collection

import torch
from torch import nn

from hsdp.engine.model import ShardedModel


def full_state_dict(model: ShardedModel, *, cpu: bool = True,
                    keep: Collection[str] | None = None) -> dict[str, torch.Tensor]:
    """The unwrapped model's state dict, original keys and shapes, on global rank 0; ``{}`` elsewhere.

    A collective: every rank must call it. Only the ranks of replica 0 gather (their shard group, and tp group
    under tensor parallelism, hold rank 0); other replicas return at once, so no inter-node bytes are spent.
    ``keep``: only these keys (the same on every rank), e.g. an adapter's: rank 0 holds no other tensor and the
    units without one of them are not gathered.
    """
    if not isinstance(model, ShardedModel):
        raise ValueError("full_state_dict expects a ShardedModel; a plain module's state_dict() is already full")
    with model.comm.helper("hsdp.full_state_dict"):
        return _gather_on_rank0(model, cpu, None if keep is None else set(keep))


def _gather_on_rank0(model: ShardedModel, cpu: bool, keep: set[str] | None) -> dict[str, torch.Tensor]:
    mesh = model.mesh
    model.reshard()  # module slots must hold the sharded parameters
    if mesh.replicate_rank != 0:
        return {}
    full: dict[int, torch.Tensor] = {}
    for unit in model.units:
        if keep is not None and not any(s.fqn in keep for p in unit.params for s in p.slots):
            continue
        for p, tensor in zip(unit.params, unit.gathered_full(), strict=True):
            full[id(p.sharded)] = p.full_tensor(tensor)  # under tensor parallelism: a tp all-gather too
    if mesh.rank != 0:
        return {}
    local = nn.Module.state_dict(model, keep_vars=True)  # original keys and order; sharded values
    out = {}
    for key, value in local.items():
        if keep is not None and key not in keep:
            continue
        tensor = full.get(id(value), value).detach()
        out[key] = tensor.cpu() if cpu else tensor.clone()
    return out
