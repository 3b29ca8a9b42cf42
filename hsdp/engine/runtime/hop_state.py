"""The inter-node hops' state as per-parameter DTensors, so that it reshards like optimizer state.

A stateful hop (error feedback) keeps one 1-D tensor per unit, laid out like the unit's reduced slot
(``reduction.slot_offsets``). Saved as is it would only load on the same mesh; split per parameter into
DTensors with a leading replica dim it reshards through ``torch.distributed.checkpoint`` like any other
state. Every replica keeps its own residual (its own rounding error), so the replica dim is sharded over
the replicate mesh dim: each replica's residual is saved, not one copy of one of them.

A heterogeneous mesh (replicas of different shard degrees) keeps its residuals per bucket of pieces
(``piece_hop.py``), which together hold one value per element of the rank's chunk: they are gathered into the
slot layout (zeros in the padding and for 0-d parameters, which cross exactly). With no grid to lay a replica dim
over, each is saved as a ``ShardedTensor`` of the same global shape ``(replicas, *param shape)``: replica ``q``'s
rank ``s`` holds rows ``[q, q + 1) x`` its own chunk, so the replicas' chunks tile the tensor without overlap
(``ReplicaSavePlanner`` keeps them all). The same file loads on any mesh with the same replica count.

With ``shard_optimizer_across_replicas`` the hop reduce-scatters and keeps a residual per replica row of what it
sends (``hops.Int8ErrorFeedbackHop.start_scatter``): one per unit on a grid, one per bucket of pieces on a
heterogeneous mesh. Together a rank's rows still hold one value per element of its chunk, so they are put back into
the slot layout and saved as above: the same file loads with or without the option.

An elastic replica saves alone (its peers are other jobs): its checkpoint cannot hold the other replicas'
residuals, and one replica's would be another's error. So none are saved there, and a replica resumed from a
checkpoint starts them from zero, as a joiner does (``hop_transaction.py``).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard as TensorShard
from torch.distributed._shard.sharded_tensor import ShardedTensor, ShardedTensorMetadata, TensorProperties
from torch.distributed.tensor import DTensor, Placement, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from hsdp.engine.mesh import HSDPMesh
from hsdp.engine.replicate.degrees import replica_starts
from hsdp.engine.replicate.pieces import chunk_rows
from hsdp.engine.runtime.piece_hop import bucket_key, flat_from_buckets, state_segments
from hsdp.engine.runtime.piece_plan import plan_pieces
from hsdp.engine.runtime.piece_slice import PieceSliceLayout, bucket_width, buckets, pack_bucket, unpack_bucket
from hsdp.engine.runtime.reduction import reduced_params, slot_offsets
from hsdp.engine.runtime.replica_slice import SliceLayout, pack_chunks, packed_numel, replicated_columns, unpack_slices
from hsdp.engine.runtime.sharded_param import ShardedParam
from hsdp.engine.runtime.unit import ShardUnit


def hop_state_dict(units: list[ShardUnit], mesh: HSDPMesh) -> dict[str, DTensor | ShardedTensor]:
    """``{parameter fqn: (replicas, *param shape)}`` for every unit whose hop holds state: a DTensor on a grid, a
    ``ShardedTensor`` on a heterogeneous mesh."""
    out: dict[str, DTensor | ShardedTensor] = {}
    if mesh.elastic is not None:
        return out  # per replica, and this checkpoint is this replica's alone (module docstring)
    for unit in units:
        flat = _slot(unit, mesh, unit.hop.state_dict() or {})
        if flat is None:
            continue
        params = reduced_params(unit)
        for p, off in zip(params, slot_offsets(params), strict=True):
            local = flat[off: off + p.layout.local_numel].view(p.layout.local_shape)
            out[p.fqn] = _residual_sharded(local, p, mesh) if mesh.heterogeneous else _residual_dtensor(local, p, mesh)
    return out


def load_hop_state_dict(units: list[ShardUnit], mesh: HSDPMesh, saved: dict[str, Any]) -> None:
    """Give each stateful hop this rank's slice of ``saved`` (:func:`hop_state_dict`'s form, any mesh with the
    same replica count; DTensors or full tensors). A parameter with nothing usable starts from zero, with a
    warning (every one on an elastic mesh, whose replicas start them from zero: module docstring)."""
    if mesh.elastic is not None:
        if saved:
            warnings.warn("an elastic replica starts its inter-node hop residuals from zero: the saved ones are "
                          "not loaded", stacklevel=3)
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
        if _sliced(params) and mesh.heterogeneous:
            state = _piece_rows_of_slot(unit, params, flat)
        elif _sliced(params):
            state = {unit.key: _rows_of_slot(params, flat)}
        else:
            state = _buckets_of_slot(unit, mesh, flat) if mesh.heterogeneous else {unit.key: flat}
        for residual in state.values():
            unit.streams.release_after(residual, "replica_hop")
        unit.hop.load_state_dict(state)


def _sliced(params: list[ShardedParam]) -> bool:
    """Whether the unit's residuals are per replica row (``shard_optimizer_across_replicas``: the hop's
    ``start_scatter`` keeps one per row of the packed slices, ``replica_slice.py``)."""
    return params[0].slice is not None


def _chunks(params: list[ShardedParam], flat: torch.Tensor) -> list[torch.Tensor]:
    return [flat[off: off + p.layout.local_numel].view(p.layout.local_shape)
            for p, off in zip(params, slot_offsets(params), strict=True)]


def _slot_of_rows(params: list[ShardedParam], rows: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A replica-sharded unit's residual ``(R, packed slices)`` in the slot layout: row ``q`` holds what this
    rank failed to send replica ``q`` of its slice of every chunk, so together the rows hold one value per
    element of the rank's chunks, as an all-gathering hop's slot does (0-d parameters cross exactly: zero)."""
    flat = torch.zeros(slot_offsets(params)[-1] + params[-1].layout.padded_numel, device=device)
    unpack_slices(rows, _slice_layouts(params), _chunks(params, flat))
    return flat


def _rows_of_slot(params: list[ShardedParam], flat: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`_slot_of_rows` (a residual saved with or without the option loads either way)."""
    slices = _slice_layouts(params)
    rows = torch.zeros(slices[0].replicas, packed_numel(slices), device=flat.device)
    pack_chunks(_chunks(params, flat), slices, rows)
    rows[:, list(replicated_columns(slices))] = 0.0  # sent exactly: no residual
    return rows


def _slice_layouts(params: list[ShardedParam]) -> list[SliceLayout]:
    return [p.slice for p in params]  # type: ignore[misc]


def _unit_plan(unit: ShardUnit, mesh: HSDPMesh) -> list[tuple[tuple[int, ...], list[tuple[int, int]]]]:
    """The unit's buckets and their residuals' slot segments (the tail's size does not move them)."""
    params = reduced_params(unit)
    offsets = slot_offsets(params)
    plan = plan_pieces([p.layout for p in params], offsets, 0, offsets[-1] + params[-1].layout.padded_numel,
                       mesh.replicas)
    assert plan is not None  # a heterogeneous mesh always has one
    return state_segments(plan)


def _slot(unit: ShardUnit, mesh: HSDPMesh, state: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """The unit's residuals in the slot layout, whichever way its hop keeps them; ``None`` before any."""
    params = reduced_params(unit)
    if _sliced(params) and mesh.heterogeneous:
        return _slot_of_piece_rows(unit, params, state)
    flat = _slot_of_buckets(unit, mesh, state) if mesh.heterogeneous else state.get(unit.key)
    if flat is not None and _sliced(params):
        flat = _slot_of_rows(params, flat, unit.sharded_flat.device)
    return flat


def _slot_of_piece_rows(unit: ShardUnit, params: list[ShardedParam], state: dict[str, torch.Tensor]) \
        -> torch.Tensor | None:
    """Replicas of different degrees with the optimizer sharded across them: each bucket's residual ``(R, width)``
    (row ``q``: part ``q`` of each of its pieces, ``piece_slice.py``) back into the pieces' rows of the slot."""
    slices = _piece_layouts(params)
    found = [(state.get(bucket_key(unit.key, h)), entries) for h, entries in sorted(buckets(slices).items())]
    if all(residual is None for residual, _ in found):
        return None
    flat = torch.zeros(slot_offsets(params)[-1] + params[-1].layout.padded_numel, device=unit.sharded_flat.device)
    chunks = _chunks(params, flat)
    for residual, entries in found:
        if residual is not None and residual.numel():
            unpack_bucket(residual.view(slices[0].replicas, -1), entries, slices, chunks)
    return flat


def _piece_rows_of_slot(unit: ShardUnit, params: list[ShardedParam], flat: torch.Tensor) -> dict[str, torch.Tensor]:
    """The inverse of :func:`_slot_of_piece_rows`: each bucket's residual cut from a slot-layout one."""
    slices = _piece_layouts(params)
    chunks = _chunks(params, flat)
    out = {}
    for holders, entries in buckets(slices).items():
        rows = torch.zeros(slices[0].replicas, bucket_width(entries, slices), device=flat.device)
        pack_bucket(entries, slices, chunks, rows)
        out[bucket_key(unit.key, holders)] = rows
    return out


def _piece_layouts(params: list[ShardedParam]) -> list[PieceSliceLayout]:
    return [p.slice for p in params]  # type: ignore[misc]


def _slot_of_buckets(unit: ShardUnit, mesh: HSDPMesh, state: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """A heterogeneous mesh's bucket residuals of ``unit`` gathered into the slot layout; ``None`` before any."""
    buckets = [(state.get(bucket_key(unit.key, holders)), segments) for holders, segments in _unit_plan(unit, mesh)]
    params = reduced_params(unit)
    return flat_from_buckets(buckets, slot_offsets(params)[-1] + params[-1].layout.padded_numel,
                             unit.sharded_flat.device)


def _buckets_of_slot(unit: ShardUnit, mesh: HSDPMesh, flat: torch.Tensor) -> dict[str, torch.Tensor]:
    """The inverse of :func:`_slot_of_buckets`: each bucket's residual, cut from a slot-layout one."""
    return {bucket_key(unit.key, holders): torch.cat([flat[o: o + n] for o, n in segments])
            for holders, segments in _unit_plan(unit, mesh) if segments}


def _residual_sharded(value: torch.Tensor, sp: ShardedParam, mesh: HSDPMesh) -> ShardedTensor:
    """``value`` (this rank's chunk of its replica's residual) as its shard of a ``(replicas, *shape)``
    ``ShardedTensor`` whose metadata lists every replica's chunks (arithmetic, no collective)."""
    degrees = mesh.replicas.degrees
    shape = (len(degrees), *sp.layout.dtensor_shape)
    device = value.device
    shards, mine = [], None
    for q, (start, d) in enumerate(zip(replica_starts(degrees), degrees, strict=True)):
        rows = 1 if sp.layout.replicated else sp.layout.rows
        c = 1 if sp.layout.replicated else chunk_rows(rows, d)
        for s in range(d if not sp.layout.replicated else 1):  # a 0-d value is whole on every rank: one copy
            n = max(0, min(c, rows - s * c))
            if n == 0:
                continue
            rank = start + s
            meta = ShardMetadata([q] + ([] if sp.layout.replicated else [s * c] + [0] * (len(shape) - 2)),
                                 [1] + ([] if sp.layout.replicated else [n, *shape[2:]]), f"rank:{rank}/{device}")
            shards.append(meta)
            if rank == mesh.rank:
                mine = TensorShard(value.unsqueeze(0), meta)
    props = TensorProperties(dtype=value.dtype, layout=value.layout, requires_grad=False,
                             memory_format=torch.contiguous_format, pin_memory=False)
    metadata = ShardedTensorMetadata(shards, torch.Size(shape), props)
    return ShardedTensor._init_from_local_shards_and_global_metadata([] if mine is None else [mine], metadata)


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
    if isinstance(value, ShardedTensor):  # saved on a heterogeneous mesh and loaded into the same one directly
        if value.shape[0] != replicas:
            return None
        local = value.local_shards()
        return local[0].tensor[0] if local else torch.zeros(sp.layout.local_shape)
    if isinstance(value, DTensor):
        if value.shape[0] != replicas:
            return None  # another replica count: the residuals do not map; start from zero
        if list(value.placements) == _placements(sp) and tuple(value.to_local().shape[1:]) == sp.layout.local_shape:
            return value.to_local()[0]
        value = value.full_tensor()
    if isinstance(value, torch.Tensor) and tuple(value.shape) == (replicas, *sp.layout.dtensor_shape):
        return sp.layout.chunk_of_full(value[replicate_rank])
    return None
