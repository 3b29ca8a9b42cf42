"""Buffers stay identical across ranks as under DDP's ``broadcast_buffers`` (BatchNorm running statistics).

A tiny model with ``BatchNorm1d`` trains 3 steps on 2 ranks (each its own batch, so each rank's running
statistics differ), then evaluates once, under hsdp with ``broadcast_buffers=True``, with the default
(automatic: on, since the model tracks running statistics), with ``False``, and under
``DistributedDataParallel`` (gloo, its default ``broadcast_buffers=True``). Synced runs must hold the same
running statistics on every rank and equal to DDP's, and the same parameters; ``False`` must drift (that
is what the option prevents). ``check_replicas`` passes on the synced buffers and names one changed on a
single rank. A model without running statistics broadcasts nothing by default, and a bad value raises before
any collective.
"""

from __future__ import annotations

import pytest
import torch
from harness import run_distributed
from models import BNNet
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import hsdp

STEPS = 3


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    # Rank-dependent scale and shift: the ranks' batch statistics differ a lot.
    return torch.randn(5, 6, generator=g) * (1 + rank) + rank, torch.randint(0, 3, (5,), generator=g)


def _train(model: nn.Module, bn: nn.Module, rank: int) -> dict[str, torch.Tensor]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        x, y = _batch(step, rank)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    # Evaluation after training: the forward syncs first (the previous one trained), then leaves the
    # statistics alone (eval mode); this is where drifted statistics would give each rank other results.
    model.eval()
    with torch.no_grad():
        model(_batch(STEPS, rank)[0])
    return {k: v.clone() for k, v in bn.named_buffers()}


def _all_ranks(tensors: dict[str, torch.Tensor]) -> dict[str, list[torch.Tensor]]:
    out = {}
    for k, v in tensors.items():
        gathered = [torch.empty_like(v) for _ in range(torch.distributed.get_world_size())]
        torch.distributed.all_gather(gathered, v)
        out[k] = gathered
    return out


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def _check(model: hsdp.ShardedModel, rank: int) -> str:
    """``check_replicas`` passes on synced buffers and names one changed on a single rank."""
    model.check_replicas()
    if rank == 1:
        model.bn.running_mean.add_(1.0)
    try:
        model.check_replicas()
        return "passed"
    except hsdp.ReplicaDivergence as e:
        return str(e)


def _worker(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    ddp = DistributedDataParallel(BNNet())
    ddp_buffers = _train(ddp, ddp.module.bn, rank)
    ddp_params = {k.removeprefix("module."): v.detach() for k, v in ddp.state_dict().items() if "bn.running" not in k}
    out: dict = {}
    for option in (True, None, False):
        torch.manual_seed(0)
        model = hsdp.ShardedModel(BNNet(), mesh=hsdp.init_mesh(2), broadcast_buffers=option)
        buffers = _train(model, model.bn, rank)
        gathered = _all_ranks(buffers)
        on_rank0 = {k: v[0] for k, v in gathered.items()}
        full = hsdp.full_state_dict(model)
        out[str(option)] = {"check": _check(model, rank)} if option is not False else {}
        out[str(option)] |= {
            "across_ranks": max(_max_diff(on_rank0, {k: v[i] for k, v in gathered.items()}) for i in range(world)),
            "vs_ddp": _max_diff(buffers, ddp_buffers),
            "params_vs_ddp": _max_diff({k: full[k] for k in ddp_params}, ddp_params) if rank == 0 else 0.0,
        }
    # No running statistics: nothing is broadcast by default (a constant buffer costs no traffic).
    seq = nn.Sequential(nn.Linear(4, 4))
    seq.register_buffer("mask", torch.ones(4))
    plain = hsdp.ShardedModel(seq, mesh=hsdp.init_mesh(2))
    plain.reset_comm_stats()
    plain(torch.ones(2, 4)).sum().backward()
    out["auto_off_world_ops"] = plain.comm_stats().get("world", {})
    with pytest.raises(ValueError, match="broadcast_buffers must be True, False or None"):
        hsdp.ShardedModel(BNNet(), mesh=hsdp.init_mesh(2), broadcast_buffers="yes")  # type: ignore[arg-type]
    return out


def test_buffers_stay_identical_across_ranks_as_under_ddp() -> None:
    results = run_distributed(_worker, 2)
    for rank, r in enumerate(results):
        for option in ("True", "None"):
            assert "1 buffer(s) differ across the ranks of a replica" in r[option]["check"], (rank, option, r)
            assert "bn.running_mean" in r[option]["check"], (rank, option, r)
            assert r[option]["across_ranks"] == 0.0, (rank, option, r)
            assert r[option]["vs_ddp"] < 1e-6, (rank, option, r)
            assert r[option]["params_vs_ddp"] < 1e-5, (rank, option, r)
        assert r["auto_off_world_ops"] == {}, r
    assert results[0]["False"]["across_ranks"] > 1e-3, results[0]  # without syncing the ranks drift apart
