"""Where a unit's reduced slot goes across replicas of different shard degrees: buckets of pieces per holder group.

After the reduce-scatter inside its replica, a rank holds its padded dim-0 chunk of every parameter, then the
"has gradient" flags and the batch-weight slots (``reduction.py``). On a grid, the same shard rank of every
replica holds the same rows, so the whole slot is averaged over the ``"replicate"`` group in one hop. Across
replicas of different degrees (``replica_pieces.py``), a chunk is cut into pieces held by different tuples of
ranks: the plan lists, per holder tuple, the segments of the slot this rank sends (its *bucket*), so that every
row is averaged exactly once over one rank per replica and inter-node bytes stay at the all-reduce floor.

What every rank needs whole (0-d parameters, the flags, the weight slots: the *tail*) goes to every *position
group* this rank is in (one rank per replica, each rank in at least one): a rank of a small replica then sends
it more than once, a few bytes per unit. Every member of a group builds the same bucket (pieces in parameter
and row order, then the tail), so one collective per bucket reduces it; buckets are issued in sorted holder
order on every rank, one global order, so groups that share ranks cannot deadlock (a NCCL stream runs its
collectives in issue order).

Tensor parallelism (every replica of the same tp degree): tp rank ``t`` of every replica holds the same
tensor-parallel piece of each parameter, so the plan is this TP-local piece's, its buckets reduced over the
holders of coordinate ``t`` only (``FixedLayer.group``); a piece TP split unevenly along dim 0 has its own rows
per coordinate, and so its own plan.

Math: the reduce-scatter averaged over the ``d_r`` ranks of this replica only, so the slot is first multiplied
by ``d_r x R / W`` (``FixedLayer.scale``); the replicate average then yields the average over all ``W`` ranks,
the same weighted mean a grid computes. Pure: built once per unit and set of degrees (an elastic job of
replicas of different degrees has the degrees of each quorum: ``piece_hop.plan_of`` keys its cache by them).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.tensor import Shard

from hsdp.engine.replicate.layer import Holders, ReplicateLayer
from hsdp.engine.replicate.pieces import chunk_rows, pieces_of_rank
from hsdp.engine.runtime.layout import ShardLayout

Segment = tuple[int, int]  # (offset in the reduced slot, numel)


@dataclass(frozen=True)
class Bucket:
    """The segments of this rank's reduced slot averaged over the ranks ``holders``, in bucket order."""

    holders: Holders
    segments: tuple[Segment, ...]
    tail: int  # how many trailing elements are the tail (flags, weights, 0-d parameters)

    @property
    def numel(self) -> int:
        return sum(n for _, n in self.segments)


@dataclass(frozen=True)
class PiecePlan:
    """Every bucket of one unit's reduction on this rank, in the global issue order, and the pre-scale."""

    buckets: tuple[Bucket, ...]
    scale: float


def piece_rows(layouts: list[ShardLayout]) -> set[int]:
    """The dim-0 sizes whose pieces units of ``layouts`` reduce, on any rank (every tp coordinate's too: the
    groups are created on every rank alike): what the replicate layer makes groups for at wrap."""
    return {rows for layout in layouts if not layout.replicated for rows in tp_local_rows(layout)}


def tp_local_rows(layout: ShardLayout) -> set[int]:
    """The dim-0 sizes of the parameter's tensor-parallel pieces on every tp rank: its rows, unless tensor
    parallelism split dim 0 unevenly (``torch.chunk`` pieces: the last tp ranks may hold fewer rows)."""
    tp = layout.tp
    if tp is None or tp.placement != Shard(0):
        return {layout.rows}
    rows, chunk = tp.full_shape[0], -(-tp.full_shape[0] // tp.degree)
    return {max(0, min(chunk, rows - t * chunk)) for t in range(tp.degree)}


def plan_pieces(layouts: list[ShardLayout], offsets: list[int], n_extra: int, slot_numel: int,
                layer: ReplicateLayer) -> PiecePlan | None:
    """This rank's buckets for a reduced slot of ``layouts`` at ``offsets`` (``slot_numel`` elements, then
    ``n_extra`` values); ``None`` on a grid, whose whole slot is one hop over the ``"replicate"`` group."""
    if layer.regular:
        return None
    degrees, r, s = layer.degrees, layer.member, layer.shard_rank
    by_holders: dict[Holders, list[Segment]] = {}
    tail: list[Segment] = []
    for layout, offset in zip(layouts, offsets, strict=True):
        if layout.replicated:
            tail.append((offset, 1))
            continue
        first = s * chunk_rows(layout.rows, layer.degree)
        for piece in pieces_of_rank(layout.rows, degrees, r, s):
            start = offset + (piece.start - first) * layout.row_numel
            _append(by_holders.setdefault(piece.holders, []), (start, piece.rows * layout.row_numel))
    _append(tail, (slot_numel, n_extra))
    for group in layer.own_position_groups():
        by_holders.setdefault(group, [])
    tail_numel = sum(n for _, n in tail)
    buckets = []
    for holders in sorted(by_holders):
        is_position = holders in layer.own_position_groups()
        segments = by_holders[holders] + (tail if is_position else [])
        if not segments:  # e.g. rows of no elements: every holder skips it alike
            continue
        buckets.append(Bucket(holders, tuple(segments), tail_numel if is_position else 0))
    return PiecePlan(tuple(buckets), layer.scale)


def _append(segments: list[Segment], segment: Segment) -> None:
    """Add a segment, merged with the previous one when they touch (fewer copies)."""
    if segments and segments[-1][0] + segments[-1][1] == segment[0]:
        segments[-1] = (segments[-1][0], segments[-1][1] + segment[1])
    elif segment[1]:
        segments.append(segment)
