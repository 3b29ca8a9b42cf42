"""Replica consistency: every replica of a shard must hold the same bits."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.distributed.tensor import Shard

from hsdp.engine.collectives import Comm
from hsdp.engine.replicate.pieces import pieces_of_rank
from hsdp.engine.runtime.sharded_param import ShardedParam

_INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class Problem(NamedTuple):
    """What one comparison found: the differing ``names``, what they are (``kind``), across which ranks
    (``where``) and the group compared over."""

    names: list[str]
    kind: str
    where: str
    group: str


class ReplicaDivergence(RuntimeError):
    """Replicas of some shards differ (a missed sync, a non-deterministic op, a bit flip)."""


def _checksums(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Per tensor, two int64 sums over its raw bits (plain and position-weighted): a cheap checksum that any
    changed bit changes; ``(n, 2)``."""
    rows = []
    for local in tensors:
        bits = local.reshape(-1).view(_INT_VIEW[local.element_size()]).to(torch.int64)
        weights = torch.arange(bits.numel(), device=bits.device, dtype=torch.int64) % 65521 + 1
        rows.append(torch.stack([bits.sum(), (bits * weights).sum()]))
    return torch.stack(rows) if rows else torch.zeros(0, 2, dtype=torch.int64)


def check_replica_shards(params: list[ShardedParam], comm: Comm, *, shards: list[torch.Tensor] | None = None,
                         buffers: dict[str, torch.Tensor] | None = None, what: str = "parameter shard(s)") -> None:
    """Compare every shard's checksum across the replicate group; raise naming the parameters that differ.

    A collective in the replicate group moving 16 bytes per parameter; every rank must call it. Raises on
    every rank of the affected replicate groups (the comparison is done everywhere on the same data), after
    every comparison's collective, so no rank is left waiting in a later one.
    Under tensor parallelism the parameters that are whole on every tp rank (embeddings, head, norms) are
    compared across the tp group too. On replicas of different shard degrees each piece of a parameter is
    compared over the ranks holding it (``replica_pieces.py``). (``ShardedModel.check_replicas`` and
    ``hsdp.check_replicas(model)`` call this.)

    ``shards`` replaces each parameter's local shard by another tensor laid out like it (DiLoCo's global copy,
    the one thing its replicas hold equal mid-phase), named ``what``. ``buffers`` (name -> tensor, whole on
    every rank) are compared across the ranks of the replica and across replicas, one all-gather each.
    """
    locals_ = [p.sharded_local.detach() for p in params] if shards is None else shards
    if comm.mesh.heterogeneous:
        comm.mesh.replicas.await_step()  # the pieces are the step's degrees' (an elastic quorum's)
        problems = _check_pieces(params, locals_, comm, what)
    else:
        mine = _checksums(locals_).to(comm.mesh.device)
        problems = [_differing([p.fqn for p in params], mine, comm, "replicate", what, "replicas")]
    if comm.size("tp") > 1:
        whole = [i for i, p in enumerate(params)
                 if p.layout.tp is not None and not isinstance(p.layout.tp.placement, Shard)]
        if whole:  # the same on every tp rank: all call the collective or none
            tp_mine = _checksums([locals_[i] for i in whole]).to(comm.mesh.device)
            problems.append(_differing([params[i].fqn for i in whole], tp_mine, comm, "tp", what,
                                       "the tensor-parallel ranks"))
    if buffers:
        problems += _check_buffers(buffers, comm)
    _raise(comm, [p for p in problems if p.names])


def _check_buffers(buffers: dict[str, torch.Tensor], comm: Comm) -> list[Problem]:
    """Buffers are whole on every rank: compared across replicas first (each position's replicate group; the
    position groups on replicas of different degrees, where no replicate group spans all), then inside the
    replica together with each rank's verdict across replicas, so that every rank raises, whichever pair of
    ranks differs (a one-rank change is seen by that rank's replicate group only)."""
    names = list(buffers)
    mine = _checksums([b.detach() for b in buffers.values()]).to(comm.mesh.device)
    views = ([comm.replica_view(g) for g in comm.mesh.replicas.own_position_groups()]
             if comm.mesh.heterogeneous else [comm])
    across = torch.zeros(len(names), dtype=torch.int64, device=mine.device)
    for view in views:
        across |= _gathered(mine, view, "replicate").ne(mine).any(dim=0).any(dim=-1).long()
    row = torch.cat([mine, across[:, None]], dim=1)
    inside, across_any = torch.zeros(len(names), dtype=torch.bool), across.bool().cpu()
    for group in ("shard", "tp"):
        if comm.size(group) > 1:
            table = _gathered(row, comm, group).cpu()
            inside |= (table[..., :2] != table[0, :, :2]).any(dim=0).any(dim=-1)
            across_any |= table[..., 2].bool().any(dim=0)
    return [Problem([n for n, bad in zip(names, found.tolist(), strict=True) if bad], "buffer(s)", where, "")
            for found, where in ((inside, "the ranks of a replica"), (across_any, "replicas"))]


def _gathered(mine: torch.Tensor, comm: Comm, group: str) -> torch.Tensor:
    """Every rank's ``mine`` across ``group``, stacked: ``(group size, *mine.shape)`` (one all-gather)."""
    r = comm.size(group)
    everyone = torch.empty(r * mine.numel(), dtype=mine.dtype, device=mine.device)
    comm.all_gather(everyone, mine.reshape(-1), group, label="check_replicas")
    return everyone.view(r, *mine.shape)


def _differing(names: list[str], mine: torch.Tensor, comm: Comm, group: str, kind: str, where: str) -> Problem:
    """The names whose checksums differ across ``group`` (one all-gather), with what they are and where."""
    table = _gathered(mine, comm, group).cpu()
    differ = (table != table[0]).any(dim=0).any(dim=-1)
    return Problem([n for n, bad in zip(names, differ.tolist(), strict=True) if bad], kind, where, group)


def _raise(comm: Comm, problems: list[Problem]) -> None:
    if not problems:
        return
    names = list(dict.fromkeys(n for p in problems for n in p.names))
    kind = " and ".join(dict.fromkeys(p.kind for p in problems))
    where = " and ".join(dict.fromkeys(p.where for p in problems))
    fix = (" (with tensor parallelism: draw random numbers outside the TP layers, e.g. dropout, from a seed "
           "set by hsdp.data_parallel_rank, the same on the T ranks)") if any(p.group == "tp" for p in problems) else ""
    raise ReplicaDivergence(
        f"{len(names)} {kind} differ across {where} (shard rank {comm.mesh.shard_rank}): "
        f"{names[:10]}{' ...' if len(names) > 10 else ''}. Replicas apply the same averaged gradient, so "
        f"this means a missed or non-deterministic sync, or state changed on one replica only{fix}"
    )


def _check_pieces(params: list[ShardedParam], locals_: list[torch.Tensor], comm: Comm,
                  what: str) -> list[Problem]:
    """Replicas of different shard degrees: each piece of each parameter (``replica_pieces.py``) compared over
    the ranks holding it, one all-gather per holder tuple in sorted order (the reduction's groups); a 0-d
    parameter over every position group this rank is in."""
    layer = comm.mesh.replicas
    by_holders: dict[tuple[int, ...], list[tuple[ShardedParam, torch.Tensor]]] = {}
    for p, local in zip(params, locals_, strict=True):
        if p.layout.replicated:
            for group in layer.own_position_groups():
                by_holders.setdefault(group, []).append((p, local))
            continue
        first = p.layout.row_offset()
        for piece in pieces_of_rank(p.layout.rows, layer.degrees, layer.member, layer.shard_rank):
            by_holders.setdefault(piece.holders, []).append((p, local[piece.start - first: piece.stop - first]))
    problems = []
    for holders in sorted(by_holders):
        entries = by_holders[holders]
        mine = _checksums([t for _, t in entries]).to(comm.mesh.device)
        problems.append(_differing([p.fqn for p, _ in entries], mine, comm.replica_view(holders), "replicate",
                                   what, "replicas"))
    return problems
