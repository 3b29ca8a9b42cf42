"""Optimizer state sharded across replicas too: which rows of a shard chunk each replica reduces and steps.

With ``ShardedModel(..., shard_optimizer_across_replicas=True)`` the inter-node all-reduce of a unit's
reduced shard becomes a reduce-scatter across replicas, so replica ``r`` of ``R`` holds the fully reduced
gradient of only its *slice* of the chunk; the optimizer steps that slice (its state exists only for it),
and an all-gather across replicas refreshes the rest of the chunk before the unit is next gathered in its
node. Inter-node bytes are those of the all-reduce it replaces (a ring all-reduce *is* a reduce-scatter
plus an all-gather); optimizer state per rank falls from 1/S to 1/(R x S).

Slice layout: the rows ``[i*c, i*c + k)`` that a shard rank holds (``layout.py``) are split again with
``torch.chunk`` semantics over the R replicas: ``c' = ceil(k / R)`` rows each, trailing replicas fewer or
none. That is exactly DTensor's right-to-left sharding, placements ``(_StridedShard(0, split_factor=S),
Shard(0))`` on the ``("replicate", "shard")`` mesh (the layout FSDP2 + TP uses for parameters), so a slice
is a DTensor of the parameter's global shape and DCP saves and reshards it like any other: a checkpoint
written with the option loads without it, on other meshes, into FSDP2, and back.

A 0-d parameter (replicated in the shard group, see ``layout.py``) stays replicated across replicas too:
its averaged gradient reaches every replica, which all step it identically.

Wire layout: a unit's slices are packed replica-major, ``(R, slice_numel + flags)``, each parameter padded
to ``ceil(padded_rows / R)`` rows so every replica sends and receives the same count (padding zero). The
reduce-scatter inside the node already delivers that layout (:func:`pack_gradient` builds its input, one copy
of each gradient, as the plain path's copy-in is), so the shard crosses nodes without being repacked.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch.distributed.tensor import Placement, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from hsdp.engine.runtime.layout import ShardLayout


@dataclass(frozen=True)
class SliceLayout:
    """Pure arithmetic of replica ``replica_rank``'s slice of one shard chunk (``shard``)."""

    shard: ShardLayout
    replicas: int
    replica_rank: int

    @property
    def replicated(self) -> bool:
        return self.shard.replicated

    @property
    def step_rows(self) -> int:
        """Rows per replica of this rank's actual chunk (``torch.chunk``: the last replicas may get fewer)."""
        return -(-self.shard.local_rows() // self.replicas)

    @property
    def padded_rows(self) -> int:
        """Rows every replica reserves on the wire: the same on every shard rank of the replicate group."""
        return 1 if self.replicated else -(-self.shard.chunk_rows // self.replicas)

    @property
    def padded_numel(self) -> int:
        return self.padded_rows * self.shard.row_numel

    @property
    def even(self) -> bool:
        """Every shard rank's chunk full and split evenly over the replicas: packed without padding."""
        shard = self.shard
        return self.replicated or (shard.rows == shard.sharding_degree * shard.chunk_rows
                                   and shard.chunk_rows % self.replicas == 0)

    def row_offset(self, replica_rank: int | None = None) -> int:
        """First row of the slice inside this rank's chunk."""
        r = self.replica_rank if replica_rank is None else replica_rank
        return 0 if self.replicated else min(r * self.step_rows, self.shard.local_rows())

    def local_rows(self, replica_rank: int | None = None) -> int:
        r = self.replica_rank if replica_rank is None else replica_rank
        if self.replicated:
            return 1
        return max(0, min(self.step_rows, self.shard.local_rows() - r * self.step_rows))

    @property
    def local_shape(self) -> tuple[int, ...]:
        shape = self.shard.global_shape
        return shape if self.replicated else (self.local_rows(), *shape[1:])

    @property
    def local_numel(self) -> int:
        return 1 if self.replicated else self.local_rows() * self.shard.row_numel

    @property
    def placements(self) -> tuple[Placement, ...]:
        """DTensor placements of a slice on the ``("replicate", "shard")`` mesh, or ``("replicate", "shard", "tp")``
        with tensor parallelism: the replicas split this rank's chunk of its TP piece last, so their dim-0
        split is strided by every split of dim 0 made before it (the shard ranks', and the tp ranks' for a TP
        ``Shard(0)``)."""
        tp = self.shard.tp
        if tp is None:
            if self.replicated:
                return (Replicate(), Replicate())
            if self.shard.sharding_degree == 1:
                return (Shard(0), Replicate())
            return (_StridedShard(0, split_factor=self.shard.sharding_degree), Shard(0))
        if self.replicated:
            return (Replicate(), *self.shard.placements)
        factor = self.shard.sharding_degree * (tp.degree if tp.placement == Shard(0) else 1)
        return (Shard(0) if factor == 1 else _StridedShard(0, split_factor=factor), *self.shard.placements)

    def of_chunk(self, chunk: torch.Tensor) -> torch.Tensor:
        """This replica's slice of a tensor shaped like the shard chunk (a view)."""
        return chunk if self.replicated else chunk.narrow(0, self.row_offset(), self.local_rows())


def packed_numel(slices: list[SliceLayout]) -> int:
    """Elements per replica of a unit's packed slices (flags excluded)."""
    return sum(s.padded_numel for s in slices)


def slice_offsets(slices: list[SliceLayout]) -> list[int]:
    """Where each parameter's padded slice starts in a packed row."""
    offsets, at = [], 0
    for s in slices:
        offsets.append(at)
        at += s.padded_numel
    return offsets


def replicated_columns(slices: list[SliceLayout]) -> tuple[int, ...]:
    """The columns of a packed row that hold a 0-d parameter: whole in every replica's row."""
    return tuple(o for o, s in zip(slice_offsets(slices), slices, strict=True) if s.replicated)


def pack_chunks(chunks: list[torch.Tensor], slices: list[SliceLayout], out: torch.Tensor) -> None:
    """Copy every chunk (shaped like its shard chunk) into ``out`` ``(R, >= packed_numel)``, replica ``q``'s
    slice of each into row ``q``; a replicated (0-d) value goes to every row. ``out``'s padding must be zero."""
    offset = 0
    for chunk, s in zip(chunks, slices, strict=True):
        dest = out[:, offset: offset + s.padded_numel]
        if s.replicated:
            dest.copy_(chunk.reshape(1, 1).expand_as(dest))
        else:
            _by_replica(dest, s).copy_(_rows(chunk, s))
            rem = _remainder(s)
            if rem:
                dest.view(s.replicas, s.padded_rows, -1)[_full(s), :rem].copy_(_rows(chunk, s, tail=True))
        offset += s.padded_numel


def pack_gradient(grad: torch.Tensor, s: SliceLayout, out: torch.Tensor) -> None:
    """Copy a full gradient (``s.shard.global_shape``) into ``out`` ``(S, R, s.padded_numel)``: shard rank
    ``i``'s chunk split by replica, as :func:`pack_chunks` lays out one chunk, for every ``i`` at once. This is
    the reduce-scatter input of the replica-sharded path: rank ``i`` receives its chunk already packed.
    ``out``'s padding must be zero; a replicated (0-d) value goes to every row."""
    if s.replicated:
        out.copy_(grad.reshape(1, 1, 1).expand_as(out))
        return
    shard, replicas = s.shard, s.replicas
    if s.even:  # one strided copy of the whole gradient
        out.view(shard.sharding_degree, replicas, s.padded_rows, -1).copy_(
            grad.reshape(shard.sharding_degree, replicas, s.padded_rows, -1))
        return
    for i in range(shard.sharding_degree):
        layout = replace(s, shard=replace(shard, shard_rank=i))
        pack_chunks([layout.shard.chunk(grad)], [layout], out[i])


def unpack_slices(packed: torch.Tensor, slices: list[SliceLayout], chunks: list[torch.Tensor]) -> None:
    """The inverse of :func:`pack_chunks` for an all-gathered ``packed`` ``(R, >= packed_numel)``: every
    replica's slice back into its rows of each chunk (replicated values are left alone: every replica
    stepped them identically)."""
    offset = 0
    for chunk, s in zip(chunks, slices, strict=True):
        if not s.replicated and chunk.numel():
            src = packed[:, offset: offset + s.padded_numel]
            _rows(chunk, s).copy_(_by_replica(src, s))
            rem = _remainder(s)
            if rem:
                _rows(chunk, s, tail=True).copy_(src.view(s.replicas, s.padded_rows, -1)[_full(s), :rem])
        offset += s.padded_numel


def pack_own(chunks: list[torch.Tensor], slices: list[SliceLayout], out: torch.Tensor) -> None:
    """This replica's slice of every chunk into ``out`` ``(packed_numel,)``: its part of the all-gather that
    :func:`unpack_slices` undoes."""
    offset = 0
    for chunk, s in zip(chunks, slices, strict=True):
        out[offset: offset + s.local_numel].copy_(s.of_chunk(chunk).reshape(-1))
        offset += s.padded_numel


# A chunk of k rows splits into _full(s) replicas of step_rows rows and, maybe, one replica of the remainder.
def _full(s: SliceLayout) -> int:
    return s.shard.local_rows() // s.step_rows if s.step_rows else 0


def _remainder(s: SliceLayout) -> int:
    return s.shard.local_rows() - _full(s) * s.step_rows


def _rows(chunk: torch.Tensor, s: SliceLayout, tail: bool = False) -> torch.Tensor:
    """The full replicas' rows of ``chunk`` as ``(full, step_rows, row)``, or the remainder's rows."""
    flat = chunk.reshape(s.shard.local_rows(), s.shard.row_numel)
    n = _full(s) * s.step_rows
    return flat[n:] if tail else flat[:n].view(_full(s), s.step_rows, s.shard.row_numel)


def _by_replica(packed: torch.Tensor, s: SliceLayout) -> torch.Tensor:
    """The full replicas' rows of ``packed`` (one parameter's columns) as ``(full, step_rows, row)``."""
    return packed.view(s.replicas, s.padded_rows, s.shard.row_numel)[: _full(s), : s.step_rows]
