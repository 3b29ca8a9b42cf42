"""The collectives of the optimizer sharded across replicas of different degrees (layout: ``piece_slice.py``).

Reduction: this replica's reduced slot (the reduce-scatter inside the node, chunk layout) is pre-scaled as
``piece_hop.py`` does, then each bucket of pieces is packed ``(R, width)`` and reduce-scattered over its holders
by the unit's hop (``start_scatter``: fp32, bf16 or int8 with a residual per bucket), so every holder keeps the
average of its part of each piece; the position groups carry the tail (0-d parameters, flags, weight slots) in
every row, so every rank receives it whole. The parts land in the unit's slices laid back to back, then the tail:
the layout ``Reduction.finish`` hands the parameters.

After the step: each bucket's stepped parts are all-gathered over the same holders, in the parameters' dtype,
and written into every holder's chunk (its own part included). Buckets are issued in sorted holder order on every
rank, as the gradient hops are, so groups that share ranks cannot deadlock. Inter-node bytes equal the piece
all-reduce's: each piece crosses as a reduce-scatter plus an all-gather.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from hsdp.engine.collectives import Comm, Handle
from hsdp.engine.replicate.fixed import FixedLayer
from hsdp.engine.runtime.piece_hop import bucket_key
from hsdp.engine.runtime.piece_slice import (
    PieceSliceLayout,
    bucket_width,
    buckets,
    own_part_offsets,
    pack_bucket,
    unpack_bucket,
)
from hsdp.engine.runtime.sharded_param import ShardedParam


def _running(numels: list[int]) -> list[int]:
    offsets, at = [], 0
    for n in numels:
        offsets.append(at)
        at += n
    return offsets


def _slices(params: list[ShardedParam]) -> list[PieceSliceLayout]:
    return [p.slice for p in params]  # type: ignore[misc]


def start_piece_scatters(hop: Any, output: torch.Tensor, params: list[ShardedParam], n_extra: int,
                         layer: FixedLayer, comm: Comm, key: str) -> tuple[Handle, torch.Tensor]:
    """Start the reduce-scatters of one unit's reduced slot ``output`` (slot layout, then ``n_extra`` values);
    returns the handle and the result buffer: each parameter's slice, back to back, then the ``n_extra`` values,
    averaged over every rank of the mesh once the handle is waited."""
    slices = _slices(params)
    output.mul_(layer.scale)  # d_r x R / W: the replicate average then averages over every rank (piece_plan.py)
    offsets = _running([p.layout.padded_numel for p in params])
    chunks = [output[o: o + p.layout.local_numel].view(p.layout.local_shape)
              for p, o in zip(params, offsets, strict=True)]
    slice_offsets = _running([s.local_numel for s in slices])
    result = output.new_zeros(sum(s.local_numel for s in slices) + n_extra)
    zero_d = [i for i, s in enumerate(slices) if s.replicated]
    tail = torch.cat([output[offsets[i]: offsets[i] + 1] for i in zero_d] + [output[output.numel() - n_extra:]])
    by_holders = buckets(slices)
    positions = layer.own_position_groups()
    for group in positions:
        by_holders.setdefault(group, [])
    stateful = hop.state_dict() is not None
    replicas = layer.count
    handles, pending = [], []
    for holders in sorted(by_holders):
        entries = by_holders[holders]
        width, n_tail = bucket_width(entries, slices), tail.numel() if holders in positions else 0
        if width + n_tail == 0:
            continue
        packed = output.new_zeros(replicas, width + n_tail)
        pack_bucket(entries, slices, chunks, packed)
        packed[:, width:] = tail[:n_tail]
        reduced = output.new_empty(width + n_tail)
        hop_key = bucket_key(key, holders) if stateful else key
        handles.append(hop.start_scatter(reduced, packed, n_tail, comm.replica_view(holders), hop_key))
        pending.append((entries, width, n_tail, reduced))

    def land() -> None:
        tail_landed = False
        for entries, width, n_tail, reduced in pending:
            for at, dest, n in own_part_offsets(entries, slices, slice_offsets):
                result[dest: dest + n] = reduced[at: at + n]
            if n_tail and not tail_landed:  # every position group averages the same tail: take the first
                for j, i in enumerate(zero_d):
                    result[slice_offsets[i]] = reduced[width + j]
                result[result.numel() - n_extra:] = reduced[width + len(zero_d):]
                tail_landed = True

    return Handle.all(handles, on_done=land), result


def start_piece_gathers(unit: Any, params: list[ShardedParam]) -> tuple[Handle, Callable[[], None]]:
    """Start the all-gathers of the stepped slices of ``params`` (one unit's, trainable, not 0-d ones only: those
    every rank steps alike); the callable writes every replica's parts into the chunks once the handle is
    waited."""
    if not params:  # only 0-d parameters: nothing to gather
        return Handle(), lambda: None
    slices = _slices(params)
    replicas = slices[0].replicas
    handles, pending = [], []
    for holders, entries in sorted(buckets(slices).items()):
        width = bucket_width(entries, slices)
        if not width:
            continue
        mine = unit.sharded_flat.new_zeros(width)
        for (at, dest, n), (i, _, _) in zip(own_part_offsets(entries, slices, [0] * len(slices)), entries,
                                            strict=True):
            mine[at: at + n] = params[i].opt_local.reshape(-1)[dest: dest + n]
        received = unit.sharded_flat.new_empty(replicas * width)
        handles.append(unit.comm.replica_view(holders).all_gather(received, mine, "replicate", async_op=True,
                                                                  label=f"{unit.name} params"))
        pending.append((entries, received))

    def land() -> None:
        chunks = [p.sharded_local for p in params]
        with torch.no_grad():
            for entries, received in pending:
                unpack_bucket(received.view(replicas, -1), entries, slices, chunks)

    return Handle.all(handles), land
