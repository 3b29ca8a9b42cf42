"""How one tensor is split into dim-0 chunks across the shard group (the layout FSDP2 and DTensor use).

Rank ``i`` of ``S`` holds rows ``[i*c, min((i+1)*c, rows))`` with ``c = ceil(rows / S)``: the chunks of
``torch.chunk`` and of ``DTensor`` ``Shard(0)``. Trailing ranks may hold fewer rows, or none. Each rank
reserves ``c`` rows in the unit's flat buffers (zero padding), so every rank contributes the same number
of elements to a collective.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.distributed.tensor import Placement, Replicate, Shard


@dataclass(frozen=True)
class ShardLayout:
    """Pure arithmetic of the dim-0 chunking of one tensor shape over ``sharding_degree`` ranks.

    A 0-d tensor (CLIP's ``logit_scale``) has no dim 0 to split: it is *replicated* in the shard group,
    every rank holding the whole value in a one-element slot (its DTensor placements are
    ``(Replicate(), Replicate())``); the all-gather then returns S equal copies and the reduce-scatter
    gives every rank the averaged gradient. It costs one element per rank.
    """

    global_shape: tuple[int, ...]
    sharding_degree: int
    shard_rank: int

    @property
    def replicated(self) -> bool:
        return not self.global_shape

    @property
    def placements(self) -> tuple[Placement, Placement]:
        """The DTensor placements on the ``("replicate", "shard")`` mesh."""
        return (Replicate(), Replicate()) if self.replicated else (Replicate(), Shard(0))

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
