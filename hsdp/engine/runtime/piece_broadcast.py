"""Sending one replica's state to the others, whatever their shard degrees: rows piece by piece, the rest whole.

A heal (``optim/elastic_heal.py``) overwrites the other members' state with a source member's. On a grid the same
shard rank of every replica holds the same rows, so one broadcast over the ``"replicate"`` group sends them.
Across replicas of different degrees a rank's chunk is cut into pieces (``replicate/pieces.py``) held by other
tuples of ranks: the rows go as the reduction's buckets do (``piece_plan.py``), one broadcast per holder tuple
over its group, each from the source's holder of those rows (the group rank of the source member), so a rank
of a 2-rank replica receives its chunk from the one rank of a 1-rank source, and the other way round. What every
rank holds whole (buffers, 0-d parameters, bytes) goes over each position group this rank is in: every rank is
in one, with one rank of the source.

``root``: the source member's place in the quorum (its group rank in every replicate group). ``to``: the places
of the members that receive, point to point from the root (``Comm.broadcast``'s ``to``: a heal sends only to
its joiners, the other members hold the state already); call on the root and the receivers only. ``None``: a
broadcast to every member.
"""

from __future__ import annotations

import torch

from hsdp.engine.collectives import Comm
from hsdp.engine.runtime.layout import ShardLayout
from hsdp.engine.runtime.piece_plan import plan_pieces


def broadcast_rows(comm: Comm, flat: torch.Tensor, layouts: list[ShardLayout], offsets: list[int], root: int,
                   to: tuple[int, ...] | None = None) -> None:
    """Overwrite ``flat`` (this rank's rows of parameters of ``layouts``, each starting at its offset, laid out as
    its chunk: rows from the chunk's first) with member ``root``'s values of the same rows."""
    layer = comm.mesh.replicas
    plan = plan_pieces(layouts, offsets, 0, flat.numel(), layer)
    if plan is None:  # a grid: the same rows on the same shard rank of every replica
        comm.broadcast(flat, root, "replicate", to)
        return
    for bucket in plan.buckets:  # sorted holder order on every rank
        buffer = torch.cat([flat[o: o + n] for o, n in bucket.segments])
        comm.replica_view(bucket.holders).broadcast(buffer, root, "replicate", to)
        at = 0
        for o, n in bucket.segments:
            flat[o: o + n].copy_(buffer[at: at + n])
            at += n


def broadcast_whole(comm: Comm, tensor: torch.Tensor, root: int) -> None:
    """Overwrite ``tensor`` (whole on every rank) with member ``root``'s."""
    layer = comm.mesh.replicas
    if layer.regular:
        comm.broadcast(tensor, root, "replicate")
        return
    for group in layer.own_position_groups():
        comm.replica_view(group).broadcast(tensor, root, "replicate")


def broadcast_bytes_whole(comm: Comm, data: bytes | None, root: int, to: tuple[int, ...] | None = None) -> bytes:
    """Member ``root``'s ``data`` (the same on each of its ranks; ``None`` elsewhere) on every rank."""
    layer = comm.mesh.replicas
    if layer.regular:
        return comm.broadcast_bytes(data, root, "replicate", to)
    received = b""
    for group in layer.own_position_groups():
        received = comm.replica_view(group).broadcast_bytes(data, root, "replicate", to)
    return received
