"""Gradient clipping, replica checks, and dead ranks that never leave the others hanging."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from harness import run_distributed
from models import ParityNet, batch, global_batch, loss_fn

import hsdp

PROGRAM = Path(__file__).parent / "programs" / "fault_worker.py"


def _clip_and_replicas(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    ref = ParityNet()
    x, y = global_batch(0, world)
    loss_fn(ref(x), y).backward()
    out = {}
    for norm_type in (2.0, float("inf")):
        ref_norm = torch.nn.utils.clip_grad_norm_(
            [p for p in ref.parameters() if p.grad is not None], 0.05, norm_type=norm_type)
        torch.manual_seed(0)
        model = hsdp.ShardedModel(ParityNet(), mesh=hsdp.init_mesh(2))
        xb, yb = batch(0, rank)
        loss_fn(model(xb), yb).backward()
        norm = hsdp.clip_grad_norm_(model, 0.05, norm_type=norm_type)
        clipped = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
        grad_err = max((g - dict(ref.named_parameters())[n].grad).abs().max().item()
                       for n, g in clipped.items())
        out[f"norm_rel_err_{norm_type}"] = abs(norm.item() - ref_norm.item()) / ref_norm.item()
        out[f"grad_err_{norm_type}"] = grad_err
        torch.manual_seed(0)
        ref.zero_grad()
        loss_fn(ref(x), y).backward()
    # Non-finite: a NaN in one shard (on both its replicas, as after a sync) is seen by every rank.
    next(iter(model.parameters())).grad = None
    if rank % 2 == 1:
        model.blocks[0].up.weight.grad.fill_(float("nan"))
    with pytest.warns(RuntimeWarning, match="skipped"):
        bad = hsdp.clip_grad_norm_(model, 1.0, on_nonfinite="skip")
    out["nonfinite_reported"] = not torch.isfinite(bad).item()
    out["grads_dropped"] = all(p.grad is None for p in model.parameters())
    # Replica check: clean after wrapping; a perturbed shard on replica 1 is named on both replicas.
    model.check_replicas()
    if rank == 2:
        with torch.no_grad():
            model.blocks[1].down.bias.add_(1e-7)
    try:
        model.check_replicas()
        out["divergence"] = None
    except hsdp.ReplicaDivergence as e:
        out["divergence"] = str(e)
    return out


def test_clip_grad_norm_matches_unsharded_and_replica_check_names_the_parameter() -> None:
    results = run_distributed(_clip_and_replicas, 4)
    for rank, r in enumerate(results):
        assert r["norm_rel_err_2.0"] < 1e-6 and r["norm_rel_err_inf"] < 1e-6, r
        assert r["grad_err_2.0"] < 1e-7 and r["grad_err_inf"] < 1e-7, r
        assert r["nonfinite_reported"] and r["grads_dropped"], r
        if rank in (0, 2):  # shard rank 0 of both replicas holds the perturbed shard
            assert r["divergence"] is not None and "blocks.1.down.bias" in r["divergence"], r
        else:
            assert r["divergence"] is None, r


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("point", ["forward", "backward", "step", "gather", "hang"])
def test_a_dead_rank_ends_every_other_rank_within_the_bound(point: str) -> None:
    port, victim, timeout = _free_port(), 3, 5.0
    procs = []
    for rank in range(4):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, str(PROGRAM), point, str(victim), str(timeout)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    try:
        start = time.monotonic()
        for p in procs[:victim]:
            p.wait(timeout=90)
        elapsed = time.monotonic() - start
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    outputs = [p.stdout.read() for p in procs]
    assert "dying in" in outputs[victim], outputs[victim][-2000:]
    for rank, p in enumerate(procs[:victim]):
        assert p.returncode != 0, (rank, outputs[rank][-2000:])
        assert "rank 3" in outputs[rank] or "[3]" in outputs[rank], (rank, outputs[rank][-2000:])
    # Start-up takes ~10 s on 2 cores; the failure itself must be noticed within timeout + a few beats.
    assert elapsed < 60, elapsed
