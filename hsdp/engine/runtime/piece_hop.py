"""The replica hop of a heterogeneous mesh: one hop per bucket of pieces (``piece_plan.py``).

Each bucket's segments are gathered into one contiguous buffer (a view when the bucket is one stretch of the
slot and carries no tail: the tail may go to several groups at once, which must not share memory), the unit's
hop averages it over the bucket's holder group (``Comm.replica_view``: the hop's own code, any wire dtype), and
the result is copied back into the slot when every bucket's handle is waited. A grid has no plan: its slot is
one hop over the ``"replicate"`` group, unchanged.

A stateful hop (the int8 hop's error feedback) keys its state by the key it is given, so each bucket gets its own
(:func:`bucket_key`): its residual is what this rank failed to send of exactly the elements it sends in that
bucket, added to them next step. Every element of the rank's chunk lies in one piece, so in one bucket: one
residual per element, the invariant of error feedback. The tail (flags, weights, 0-d parameters) crosses exactly
in every hop and keeps no residual.
"""

from __future__ import annotations

import torch

from hsdp.engine.collectives import Comm, Handle
from hsdp.engine.hops import ReplicaHop
from hsdp.engine.runtime.piece_plan import PiecePlan, plan_pieces
from hsdp.engine.runtime.sharded_param import ShardedParam


def plan_of(comm: Comm, params: list[ShardedParam], offsets: list[int], n_extra: int, slot_numel: int,
            cache: dict[tuple[int, ...], PiecePlan | None]) -> PiecePlan | None:
    """The piece plan of a reduction of ``params`` (cached per parameter set, which are trainable may change, and
    per degrees and place: an elastic job's quorums change them)."""
    layer = comm.mesh.replicas
    layer.await_step()  # the step's degrees (an elastic quorum's), waited for once per step
    key = (*layer.degrees, -1, layer.member, -1, *(id(p) for p in params))
    if key not in cache:
        cache[key] = plan_pieces([p.layout for p in params], offsets, n_extra, slot_numel, layer)
    return cache[key]


def bucket_key(key: str, holders: tuple[int, ...]) -> str:
    """The key a stateful hop keeps a bucket's state under: the unit's, then the holder tuple (module names
    hold no ``@``)."""
    return f"{key}@{','.join(map(str, holders))}"


def flat_from_buckets(buckets: list[tuple[torch.Tensor | None, list[tuple[int, int]]]], numel: int,
                      device: torch.device) -> torch.Tensor | None:
    """Per-bucket state laid out flat (``numel`` values): each bucket's values in order over its ``(offset,
    numel)`` segments (:func:`state_segments`), zeros where a bucket has none; ``None`` when no bucket has any."""
    if all(state is None for state, _ in buckets):
        return None
    flat = torch.zeros(numel, device=device)
    for state, segments in buckets:
        at = 0
        for offset, n in segments:
            if state is not None:
                flat[offset: offset + n] = state[at: at + n]
            at += n
    return flat


def state_segments(plan: PiecePlan) -> list[tuple[tuple[int, ...], list[tuple[int, int]]]]:
    """Per bucket, its holders and the slot segments of the elements a stateful hop keeps state for (all but the
    tail, which ends every bucket), in bucket order: how a bucket's residual maps onto the reduced slot."""
    out = []
    for bucket in plan.buckets:
        left, segments = bucket.numel - bucket.tail, []
        for offset, numel in bucket.segments:
            if left <= 0:
                break
            segments.append((offset, min(numel, left)))
            left -= numel
        out.append((bucket.holders, segments))
    return out


def follow_plan(hop: ReplicaHop, key: str, old: PiecePlan | None, new: PiecePlan, numel: int,
                device: torch.device) -> None:
    """Lay a stateful hop's per-bucket state of unit ``key`` (the int8 hop's residuals) out by ``new``'s buckets
    before its hops: where a layer's replicas change (elastic), a quorum of other shard degrees regroups this rank's
    ``numel`` slot elements (the tail excluded) into other buckets (``old``: the plan the state follows; ``None``:
    one state under ``key`` laid out like the slot, as a checkpoint's load leaves it), and each element keeps what
    rounding lost of it (error feedback's invariant), re-cut on the way. A bucket state of the wrong size for its
    plan (a discarded step put back one laid out by an earlier plan) counts as none: zeros, never a crash. (Where a
    plan change and a discard coincide, a state of the right size put back under a name the new plan reuses is taken
    as it is: one quantisation step's error on other elements, once.)"""
    state = hop.state_dict()
    if state is None:
        return

    def sized(name: str, segments: list[tuple[int, int]]) -> torch.Tensor | None:
        value = state.get(name)
        return value if value is not None and value.numel() == sum(n for _, n in segments) else None

    flat = None
    if old is None:
        flat = sized(key, [(0, numel)])
    elif old != new:
        flat = flat_from_buckets([(sized(bucket_key(key, h), s), s) for h, s in state_segments(old)], numel, device)
    fresh = {}
    for holders, segments in state_segments(new):
        name = bucket_key(key, holders)
        if flat is not None:
            fresh[name] = torch.cat([flat[o: o + n] for o, n in segments])
        elif name in state and sized(name, segments) is None:
            fresh[name] = torch.zeros(sum(n for _, n in segments), device=device)
    if fresh:
        hop.load_state_dict(fresh)


def start_piece_hops(hop: ReplicaHop, output: torch.Tensor, plan: PiecePlan, comm: Comm, key: str) -> Handle:
    """Scale ``output`` (this replica's reduced slot and tail) and start one hop per bucket, in plan order;
    once the handle is waited ``output`` holds the average over every rank of the mesh."""
    output.mul_(plan.scale)
    stateful = hop.state_dict() is not None
    handles, staged = [], []
    for bucket in plan.buckets:
        (offset, numel), *more = bucket.segments
        if not more and not bucket.tail:
            buffer = output[offset: offset + numel]  # averaged in place
        else:
            buffer = torch.cat([output[o: o + n] for o, n in bucket.segments])
            staged.append((bucket.segments, buffer))
        hop_key = bucket_key(key, bucket.holders) if stateful else key
        handles.append(hop.start(buffer, bucket.tail, comm.replica_view(bucket.holders), hop_key))

    def copy_back() -> None:
        for segments, buffer in staged:
            at = 0
            for o, n in segments:
                output[o: o + n].copy_(buffer[at: at + n])
                at += n

    return Handle.all(handles, on_done=copy_back)
