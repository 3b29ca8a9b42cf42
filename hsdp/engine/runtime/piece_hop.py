"""The replica hop of a heterogeneous mesh: one hop per bucket of pieces (``piece_plan.py``).

Each bucket's segments are gathered into one contiguous buffer (a view when the bucket is one stretch of the
slot and carries no tail: the tail may go to several groups at once, which must not share memory), the unit's
hop averages it over the bucket's holder group (``Comm.replica_view``: the hop's own code, any wire dtype), and
the result is copied back into the slot when every bucket's handle is waited. A grid has no plan: its slot is
one hop over the ``"replicate"`` group, unchanged.
"""

from __future__ import annotations

import torch

from hsdp.engine.collectives import Comm, Handle
from hsdp.engine.hops import ReplicaHop
from hsdp.engine.runtime.piece_plan import PiecePlan, plan_pieces
from hsdp.engine.runtime.sharded_param import ShardedParam


def plan_of(comm: Comm, params: list[ShardedParam], offsets: list[int], n_extra: int, slot_numel: int,
            cache: dict[tuple[int, ...], PiecePlan | None]) -> PiecePlan | None:
    """The piece plan of a reduction of ``params`` (cached per parameter set: which are trainable may change)."""
    key = tuple(id(p) for p in params)
    if key not in cache:
        cache[key] = plan_pieces([p.layout for p in params], offsets, n_extra, slot_numel, comm.mesh.replicas)
    return cache[key]


def start_piece_hops(hop: ReplicaHop, output: torch.Tensor, plan: PiecePlan, comm: Comm, key: str) -> Handle:
    """Scale ``output`` (this replica's reduced slot and tail) and start one hop per bucket, in plan order;
    once the handle is waited ``output`` holds the average over every rank of the mesh."""
    output.mul_(plan.scale)
    handles, staged = [], []
    for bucket in plan.buckets:
        (offset, numel), *more = bucket.segments
        if not more and not bucket.tail:
            buffer = output[offset: offset + numel]  # averaged in place
        else:
            buffer = torch.cat([output[o: o + n] for o, n in bucket.segments])
            staged.append((bucket.segments, buffer))
        handles.append(hop.start(buffer, bucket.tail, comm.replica_view(bucket.holders), key))

    def copy_back() -> None:
        for segments, buffer in staged:
            at = 0
            for o, n in segments:
                output[o: o + n].copy_(buffer[at: at + n])
                at += n

    return Handle.all(handles, on_done=copy_back)
