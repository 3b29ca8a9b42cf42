"""The inter-node hops' state as per-parameter DTensors, so that it reshards like optimizer state.

A stateful hop (error feedback) keeps one 1-D tensor per unit, laid out like the unit's reduced slot
(``reduction.slot_offsets``). Saved as is it would only load on the same mesh; split per parameter into
DTensors with a leading replica dim it reshards through ``torch.distributed.checkpoint`` like any other
state. Every replica keeps its own residual (its own rounding error), so the replica dim is sharded over
the replicate mesh dim: each replica's residual is saved, not one copy of one of them.

A heterogeneous mesh (replicas of different shard degrees) keeps its residuals per bucket of pieces
(``piece_hop.py``) and has no grid to lay a replica dim over: saving them is refused with a ``ValueError``
naming the fix, and residuals saved on a grid load there as zeros, with a warning.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Placement, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from hsdp.engine.mesh import HSDPMesh
from hsdp.engine.runtime.reduction import reduced_params, slot_offsets
from hsdp.engine.runtime.sharded_param import ShardedParam
from hsdp.engine.runtime.unit import ShardUnit


def hop_state_dict(units: list[ShardUnit], mesh: HSDPMesh) -> dict[str, DTensor]:
    """``{parameter fqn: DTensor (replicas, *param shape)}`` for every unit whose hop holds state."""
    if mesh.heterogeneous and any(unit.hop.state_dict() is not None for unit in units):
        raise ValueError(f"saving the inter-node hop's error-feedback residuals on replicas of different shard "
                         f"degrees (sharding_degree={list(mesh.replicas.degrees)}) is not supported yet: checkpoint "
                         f"with replica_hop=hsdp.AllReduceHop() or AllReduceHop(torch.bfloat16), or give every "
                         f"replica the same degree")
    out = {}
    for unit in units:
        flat = (unit.hop.state_dict() or {}).get(unit.key)
        if flat is None:
            continue
        params = reduced_params(unit)
        for p, off in zip(params, slot_offsets(params), strict=True):
            local = flat[off: off + p.layout.local_numel].view(p.layout.local_shape)
            out[p.fqn] = _residual_dtensor(local, p, mesh)
    return out


def load_hop_state_dict(units: list[ShardUnit], mesh: HSDPMesh, saved: dict[str, Any]) -> None:
    """Give each stateful hop this rank's slice of ``saved`` (:func:`hop_state_dict`'s form, any mesh with the
    same replica count; DTensors or full tensors). A parameter with nothing usable starts from zero, with a
    warning (every one of them on a heterogeneous mesh, see the module docstring)."""
    if mesh.heterogeneous:
        if saved:
            warnings.warn("inter-node hop residuals do not load on replicas of different shard degrees: starting "
                          "them from zero", stacklevel=3)
        return
    for unit in units:
        params = reduced_params(unit)
        if unit.hop.state_dict() is None or not any(p.fqn in saved for p in params):
            continue
        offsets = slot_offsets(params)
        flat = torch.zeros(offsets[-1] + params[-1].layout.padded_numel, device=unit.sharded_flat.device)
        for p, off in zip(params, offsets, strict=True):
            local = _local_residual(saved.get(p.fqn), p, mesh.replicate_rank, mesh.replicate_degree)
            if local is None:
                warnings.warn(f"no usable inter-node hop residual for {p.fqn} (saved on another replica count?): "
                              f"starting it from zero", stacklevel=3)
                continue
            flat[off: off + p.layout.local_numel] = local.reshape(-1)
        # Read next by the hop stream, which replaces it with the next residual: without this the allocator
        # could hand the block to a later unit's backward before the hop stream has read it.
        unit.streams.release_after(flat, "replica_hop")
        unit.hop.load_state_dict({unit.key: flat})


def _placements(sp: ShardedParam) -> list[Placement]:
    """The parameter's own placements with a leading replica dim: the replicate mesh dim shards dim 0, and the
    other mesh dims shard (or replicate) the parameter's dims one further right."""
    out: list[Placement] = [Shard(0)]
    for p in sp.layout.placements:
        if isinstance(p, _StridedShard):
            out.append(_StridedShard(p.dim + 1, split_factor=p.split_factor))
        elif isinstance(p, Shard):
            out.append(Shard(p.dim + 1))
        else:
            out.append(p)  # a 0-d parameter is whole on every shard rank; a plain one on every tp rank
    return out


def _residual_dtensor(value: torch.Tensor, sp: ShardedParam, mesh: HSDPMesh) -> DTensor:
    device_mesh = mesh.device_mesh
    shape = torch.Size((device_mesh.size(0), *sp.layout.dtensor_shape))
    return DTensor.from_local(value.unsqueeze(0), device_mesh, _placements(sp), run_check=False, shape=shape,
                              stride=torch.empty(shape, device="meta").stride())


def _local_residual(value: Any, sp: ShardedParam, replicate_rank: int, replicas: int) -> torch.Tensor | None:
    if isinstance(value, DTensor):
        if value.shape[0] != replicas:
            return None  # another replica count: the residuals do not map; start from zero
        if list(value.placements) == _placements(sp) and tuple(value.to_local().shape[1:]) == sp.layout.local_shape:
            return value.to_local()[0]
        value = value.full_tensor()
    if isinstance(value, torch.Tensor) and tuple(value.shape) == (replicas, *sp.layout.dtensor_shape):
        return sp.layout.chunk_of_full(value[replicate_rank])
    return None
