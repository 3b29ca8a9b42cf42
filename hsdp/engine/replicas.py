"""Replica consistency: every replica of a shard must hold the same bits."""

from __future__ import annotations

import torch
from torch.distributed.tensor import Shard

from hsdp.engine.collectives import Comm
from hsdp.engine.replica_pieces import pieces_of_rank
from hsdp.engine.runtime.sharded_param import ShardedParam

_INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class ReplicaDivergence(RuntimeError):
    """Replicas of some shards differ (a missed sync, a non-deterministic op, a bit flip)."""


def shard_checksums(params: list[ShardedParam]) -> torch.Tensor:
    """Per sharded parameter, two int64 sums over its raw bits (plain and position-weighted): a cheap
    checksum that any changed bit changes; ``(n_params, 2)``."""
    return _checksums([p.sharded_local.detach() for p in params])


def _checksums(tensors: list[torch.Tensor]) -> torch.Tensor:
    rows = []
    for local in tensors:
        bits = local.reshape(-1).view(_INT_VIEW[local.element_size()]).to(torch.int64)
        weights = torch.arange(bits.numel(), device=bits.device, dtype=torch.int64) % 65521 + 1
        rows.append(torch.stack([bits.sum(), (bits * weights).sum()]))
    return torch.stack(rows) if rows else torch.zeros(0, 2, dtype=torch.int64)


def check_replica_shards(params: list[ShardedParam], comm: Comm) -> None:
    """Compare every shard's checksum across the replicate group; raise naming the parameters that differ.

    A collective in the replicate group moving 16 bytes per parameter; every rank must call it. Raises on
    every rank of the affected replicate groups (the comparison is done everywhere on the same data), after
    every comparison's collective, so no rank is left waiting in a later one.
    Under tensor parallelism the parameters that are whole on every tp rank (embeddings, head, norms) are
    compared across the tp group too. On replicas of different shard degrees each piece of a parameter is
    compared over the ranks holding it (``replica_pieces.py``). (``ShardedModel.check_replicas`` and
    ``hsdp.check_replicas(model)`` call this.)
    """
    if comm.mesh.heterogeneous:
        problems = _check_pieces(params, comm)
    else:
        mine = shard_checksums(params).to(comm.mesh.device)
        problems = [_differing(params, mine, comm, "replicate", "replicas")]
    if comm.size("tp") > 1:
        whole = [i for i, p in enumerate(params)
                 if p.layout.tp is not None and not isinstance(p.layout.tp.placement, Shard)]
        if whole:  # the same on every tp rank: all call the collective or none
            problems.append(_differing([params[i] for i in whole], mine[whole], comm, "tp",
                                       "the tensor-parallel ranks"))
    _raise(comm, [p for p in problems if p[0]])


def _differing(params: list[ShardedParam], mine: torch.Tensor, comm: Comm, group: str,
               what: str) -> tuple[list[str], str, str]:
    """The parameters whose checksums differ across ``group`` (one all-gather), and how to name the group."""
    r = comm.size(group)
    everyone = torch.empty(r * mine.numel(), dtype=mine.dtype, device=mine.device)
    comm.all_gather(everyone, mine.reshape(-1), group, label="check_replicas")
    table = everyone.view(r, *mine.shape).cpu()
    differ = (table != table[0]).any(dim=0).any(dim=-1)
    return [p.fqn for p, bad in zip(params, differ.tolist(), strict=True) if bad], what, group


def _raise(comm: Comm, problems: list[tuple[list[str], str, str]]) -> None:
    if not problems:
        return
    names = list(dict.fromkeys(n for found, _, _ in problems for n in found))
    what = " and ".join(dict.fromkeys(w for _, w, _ in problems))
    fix = (" (with tensor parallelism: draw random numbers outside the TP layers, e.g. dropout, from a seed "
           "set by hsdp.data_parallel_rank, the same on the T ranks)") if any(g == "tp" for *_, g in problems) else ""
    raise ReplicaDivergence(
        f"{len(names)} parameter shard(s) differ across {what} (shard rank {comm.mesh.shard_rank}): "
        f"{names[:10]}{' ...' if len(names) > 10 else ''}. Replicas apply the same averaged gradient, so "
        f"this means a missed or non-deterministic sync, or state changed on one replica only{fix}"
    )


def _check_pieces(params: list[ShardedParam], comm: Comm) -> list[tuple[list[str], str, str]]:
    """Replicas of different shard degrees: each piece of each parameter (``replica_pieces.py``) compared over
    the ranks holding it, one all-gather per holder tuple in sorted order (the reduction's groups); a 0-d
    parameter over every position group this rank is in."""
    layer = comm.mesh.replicas
    by_holders: dict[tuple[int, ...], list[tuple[ShardedParam, torch.Tensor]]] = {}
    for p in params:
        local = p.sharded_local.detach()
        if p.layout.replicated:
            for group in layer.own_position_groups():
                by_holders.setdefault(group, []).append((p, local))
            continue
        first = p.layout.row_offset()
        for piece in pieces_of_rank(p.layout.rows, layer.degrees, layer.index, layer.shard_rank):
            by_holders.setdefault(piece.holders, []).append((p, local[piece.start - first: piece.stop - first]))
    problems = []
    for holders in sorted(by_holders):
        entries = by_holders[holders]
        mine = _checksums([t for _, t in entries]).to(comm.mesh.device)
        problems.append(_differing([p for p, _ in entries], mine, comm.replica_view(holders), "replicate",
                                   "replicas"))
    return problems
