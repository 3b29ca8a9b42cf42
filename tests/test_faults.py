"""Gradient clipping, replica checks, and dead ranks that never leave the others hanging."""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from harness import RankProcess, run_distributed, start_program
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


def _run_victim(point: str, victim: int, timeout: float = 3.0, wait_for_victim: bool = False,
                degrees: str = "2") -> tuple[list[RankProcess], list[str], float]:
    """Four ranks of fault_worker.py (from the fork server: see harness.start_program); the store lives in this
    process (as torchrun's agent hosts it), so it outlives any rank, rank 0 included. Returns the processes,
    their outputs and the seconds until every rank (the victim too with ``wait_for_victim``; a stopped or killed
    one never exits by itself) had exited."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    with tempfile.TemporaryDirectory() as logs:
        procs = []
        for rank in range(4):
            env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": str(store.port), "TORCHELASTIC_USE_AGENT_STORE": "True", "OMP_NUM_THREADS": "1",
                   "FAULT_WORKER_DEGREES": degrees}
            procs.append(start_program(PROGRAM, [point, str(victim), str(timeout)], env, f"{logs}/{rank}.log"))
        try:
            start = time.monotonic()
            for rank, p in enumerate(procs):
                if rank != victim or wait_for_victim:
                    p.wait(timeout=90)
            elapsed = time.monotonic() - start
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait()
        return procs, [p.output() for p in procs], elapsed


@pytest.mark.parametrize(("point", "degrees"), [("forward", "2"), ("backward", "2"), ("step", "2"), ("gather", "2"),
                                               ("hang", "2"), ("backward", "2,1,1"), ("hang", "2,1,1")])
def test_a_dead_rank_ends_every_other_rank_within_the_bound(point: str, degrees: str) -> None:
    """A 2 x 2 mesh, and replicas of degrees [2, 1, 1] (the victim a replica of its own; the others wait in
    the piece reductions' groups)."""
    victim = 3
    procs, outputs, elapsed = _run_victim(point, victim, degrees=degrees)
    assert "dying in" in outputs[victim], outputs[victim][-2000:]
    for rank, p in enumerate(procs[:victim]):
        assert p.returncode != 0, (rank, outputs[rank][-2000:])
        assert "rank 3" in outputs[rank] or "[3]" in outputs[rank], (rank, outputs[rank][-2000:])
    # Start-up takes ~10 s on 2 cores; the failure itself must be noticed within timeout + a few beats.
    assert elapsed < 60, elapsed


# (point, victim, what the report must say): the hangs where no rank dies.
HANGS = [
    ("sleep", 3, ["late: rank(s) 3", "never entered it", "time.sleep(3600)", "likely cause"]),
    ("exit", 3, ["rank(s) [3] exited normally", "every rank must run the same steps"]),
    ("mismatch", 3, ["in a different collective: rank(s) 3", "all_gather[replicate]",
                     "ShardedModel.check_replicas", "hsdp.clip_grad_norm_"]),
    ("full_state_dict", 0, ["hsdp.full_state_dict is a collective and must be called on every rank",
                            "rank(s) 0 called it, rank(s) 1, 2, 3 did not"]),
    ("save_checkpoint", 0, ["hsdp.save_checkpoint is a collective and must be called on every rank",
                            "rank(s) 0 called it, rank(s) 1, 2, 3 did not"]),
]


@pytest.mark.parametrize(("point", "victim", "expected"), HANGS, ids=[h[0] for h in HANGS])
def test_a_hang_ends_every_rank_within_the_bound_naming_rank_and_collective(point: str, victim: int,
                                                                            expected: list[str]) -> None:
    procs, outputs, elapsed = _run_victim(point, victim, wait_for_victim=True)
    assert "misbehaving" in outputs[victim], outputs[victim][-2000:]
    everything = "\n".join(outputs)
    for text in expected:
        assert text in everything, (text, everything[-4000:])
    for rank, p in enumerate(procs):
        if point == "exit" and rank == victim:
            assert p.returncode == 0  # it left normally: the others must not wait for it forever
            continue
        assert p.returncode != 0, (rank, outputs[rank][-2000:])
        assert "finished without noticing" not in outputs[rank]
        # Every rank's own output names the culprit (the first line of the report, or the raised error).
        assert f"rank(s) {victim}" in outputs[rank] or f"[{victim}]" in outputs[rank], (rank, outputs[rank][-2000:])
    assert elapsed < 60, elapsed
