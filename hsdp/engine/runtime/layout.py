"""How one tensor is split into dim-0 chunks across the shard group (the layout FSDP2 and DTensor use).

Rank ``i`` of ``S`` holds rows ``[i*c, min((i+1)*c, rows))`` with ``c = ceil(rows / S)``: the chunks of
``torch.chunk`` and of ``DTensor`` ``Shard(0)``. Trailing ranks may hold fewer rows, or none. Each rank
reserves ``c`` rows in the unit's flat buffers (zero padding), so every rank contributes the same number
of elements to a collective.

With tensor parallelism (a 3-D mesh) a parameter is first split by torch's tensor parallelism (``TPSplit``:
``Shard(d)`` or ``Replicate()`` on the tp dim) and hsdp shards this rank's TP-local tensor the same way, as
FSDP2 does on a 2-D mesh: ``global_shape`` is then the TP-local shape (what the shard group all-gathers) and
``dtensor_shape`` the full one. A TP ``Shard(0)`` followed by hsdp's dim-0 chunks is DTensor's
``_StridedShard(0, split_factor=T)`` on the shard dim (checked against DTensor's own arithmetic, uneven
sizes included, in the tests).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.distributed.tensor import Placement, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard


@dataclass(frozen=True)
class TPSplit:
    """How tensor parallelism split one parameter before hsdp shards it: its placement on the 1-D tp mesh
    (``Shard(d)`` or ``Replicate()``; a plain parameter of a model on a 3-D mesh is ``Replicate()``), its full
    shape, and this rank's tp coordinate."""

    placement: Placement
    full_shape: tuple[int, ...]
    degree: int
    rank: int

    def piece(self, full: torch.Tensor) -> torch.Tensor:
        """This tp rank's piece of a full tensor (a view; ``torch.chunk`` pieces, as DTensor's ``Shard``)."""
        if not isinstance(self.placement, Shard):
            return full
        dim = self.placement.dim
        pieces = torch.chunk(full, self.degree, dim=dim)
        return pieces[self.rank] if self.rank < len(pieces) else full.narrow(dim, 0, 0)


@dataclass(frozen=True)
class ShardLayout:
    """Pure arithmetic of the dim-0 chunking of one tensor shape over ``sharding_degree`` ranks.

    A 0-d tensor (CLIP's ``logit_scale``) has no dim 0 to split: it is *replicated* in the shard group,
    every rank holding the whole value in a one-element slot (its DTensor placement is
    ``Replicate()``); the all-gather then returns S equal copies and the reduce-scatter
    gives every rank the averaged gradient. It costs one element per rank.
    """

    global_shape: tuple[int, ...]  # what the shard group gathers: the parameter's shape (TP-local under TP)
    sharding_degree: int
    shard_rank: int
    tp: TPSplit | None = None  # set on a 3-D mesh (every parameter, TP-split or not)

    @property
    def replicated(self) -> bool:
        return not self.global_shape

    @property
    def dtensor_shape(self) -> tuple[int, ...]:
        """The shape of the parameter as a DTensor: the full shape, before tensor and data parallelism."""
        return self.tp.full_shape if self.tp is not None else self.global_shape

    @property
    def placements(self) -> tuple[Placement, ...]:
        """The DTensor placements on the replica's ``("shard",)`` or ``("shard", "tp")`` mesh
        (``HSDPMesh.param_mesh``)."""
        if self.tp is None:
            return (Replicate(),) if self.replicated else (Shard(0),)
        if self.replicated:
            dp: Placement = Replicate()
        elif self.tp.placement == Shard(0):
            dp = _StridedShard(0, split_factor=self.tp.degree)  # hsdp's rows are taken from the TP piece
        else:
            dp = Shard(0)
        return (dp, self.tp.placement)

    def chunk_of_full(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's chunk of a tensor of ``dtensor_shape``: its TP piece, then its rows of that (a view)."""
        return self.chunk(full if self.tp is None else self.tp.piece(full))

    @property
    def rows(self) -> int:
        return 1 if self.replicated else self.global_shape[0]

    @property
    def row_numel(self) -> int:
        return math.prod(self.global_shape[1:])

    @property
    def chunk_rows(self) -> int:
        return 1 if self.replicated else -(-self.rows // self.sharding_degree)

    @property
    def padded_numel(self) -> int:
        """Elements each rank reserves in a flat buffer (its slot, padding included)."""
        return self.chunk_rows * self.row_numel

    def row_offset(self, shard_rank: int | None = None) -> int:
        r = self.shard_rank if shard_rank is None else shard_rank
        return 0 if self.replicated else min(r * self.chunk_rows, self.rows)

    def local_rows(self, shard_rank: int | None = None) -> int:
        r = self.shard_rank if shard_rank is None else shard_rank
        return 1 if self.replicated else max(0, min(self.chunk_rows, self.rows - r * self.chunk_rows))

    @property
    def local_shape(self) -> tuple[int, ...]:
        return self.global_shape if self.replicated else (self.local_rows(), *self.global_shape[1:])

    @property
    def local_numel(self) -> int:
        return self.local_rows() * self.row_numel

    def chunk(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's piece of a full tensor of ``global_shape`` (a view)."""
        return full if self.replicated else full.narrow(0, self.row_offset(), self.local_rows())
