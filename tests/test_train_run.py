"""``hsdp train`` end to end: the command on 2 emulated nodes x 2 ranks, and exact resume.

Spawns are the cost here, so each test combines its checks: one ``hsdp train`` launch (launcher,
progress, checkpoints, metrics, summary, profiler trace, report, the run-directory guard), one launch
stopped by SIGTERM, and one 4-rank spawn that runs five jobs in the same processes (straight; stopped
after a checkpoint, resumed; preempted by a SIGTERM to one rank, resumed) plus the once-per-job warning
check.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from harness import run_distributed

from hsdp.apps.train.metrics import read_metrics
from hsdp.apps.train.report import write_report

if TYPE_CHECKING:
    from hsdp.apps.train.job import JobOutcome

REPO = Path(__file__).resolve().parents[1]
# Small and quick: 8 steps of the tiny GPT on 0.3 MB of the stdlib.
QUICK = ["train.eval_every=4", "train.checkpoint_every=4", "train.log_every=2", "train.sample_tokens=16",
         "data.max_bytes=300000", "optim.warmup_steps=2", "optim.lr=3e-3"]


def _hsdp(cwd: Path, *args: str, timeout: float = 200) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hsdp", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)


def _trace_names(path: Path) -> set[str]:
    events = json.loads(path.read_text())["traceEvents"]
    return {e["name"] for e in events if e.get("name", "").startswith("hsdp::")}


def test_hsdp_train_end_to_end(tmp_path: Path) -> None:
    # With the optimizer sharded across the 2 replicas (the default path runs in the resume jobs below).
    proc = _hsdp(tmp_path, "train", "--steps", "8", "--profile", "train.profile_steps=2", *QUICK,
                 "parallel.shard_optimizer_across_replicas=true")
    out = proc.stdout
    assert proc.returncode == 0, out[-4000:] + proc.stderr[-4000:]
    assert "[node 0] step     8/8" in out and "eta" in out and "Per node and step" in out
    run = tmp_path / "runs" / "train"
    records = read_metrics(str(run))
    assert [r["step"] for r in records] == list(range(1, 9))
    assert records[-1]["loss"] < records[0]["loss"] - 0.5  # the loss falls
    assert records[3]["eval_loss"] is not None and records[7]["eval_loss"] is not None
    # Exposed communication (waits that blocked the host: measured on CPUs): some, never more than the step.
    assert all(0 <= r["exposed_comm_s"] <= r["step_s"] for r in records)
    assert sum(r["exposed_comm_s"] for r in records) > 0
    assert (run / "metrics.csv").read_text().count("\n") == 9
    ckpts = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert ckpts == ["latest", "step_000004", "step_000008"]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["mesh"] == {"replicas": 2, "shards": 2, "world": 4} and len(summary["ranks"]) == 4
    floor = summary["inter_node_floor_bytes_per_step"]
    # Per node: a reduce-scatter and an all-gather across replicas, (R-1)/R x P x (4 + 4) = the all-reduce's
    # 2(R-1)/R x P x 4, plus padding and flags.
    assert floor == pytest.approx(2 * 1 / 2 * summary["model"]["params"] * 4)
    for node in summary["nodes"]:
        assert floor <= node["replicate_bytes_per_step"] < 1.01 * floor
    # AdamW's 8 B per element over R x S = 4 ranks: as many bytes as the 4 B parameters over S = 2 (twice
    # that without the option).
    ranks = summary["ranks"]
    assert max(r["optimizer"] for r in ranks) < 1.01 * max(r["params"] for r in ranks)
    names = _trace_names(run / "profile" / "rank0.json")
    for region in ("hsdp::all_gather[shard] Block(blocks.0)", "hsdp::all_gather[shard] GPT(root)",
                   "hsdp::reduce_scatter[shard] Block(blocks.3)", "hsdp::reduce_scatter[replicate] blocks.1",
                   "hsdp::all_gather[replicate] Block(blocks.2) params"):
        assert region in names, sorted(names)
    assert all(Path(p).stat().st_size > 10_000 for p in write_report(str(run)))
    again = _hsdp(tmp_path, "train", "--steps", "8")  # refused before any rank starts
    assert again.returncode == 2 and "already holds a run" in again.stderr and "--resume" in again.stderr


def test_sigterm_to_the_launcher_checkpoints_and_exits_143(tmp_path: Path) -> None:
    # The launcher passes SIGTERM to every node's agent and worker, as a scheduler's preemption would.
    cmd = [sys.executable, "-m", "hsdp", "train", "--steps", "300", "train.checkpoint_every=0",
           "train.log_every=1", "data.max_bytes=300000"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "runs" / "train" / "metrics.jsonl"
    try:
        deadline = time.monotonic() + 150
        while not (metrics.exists() and metrics.read_text().count("\n") >= 3) and time.monotonic() < deadline:
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 143, out[-3000:] + err[-3000:]
    last = read_metrics(str(tmp_path / "runs" / "train"))[-1]["step"]
    assert 3 <= last < 300 and f"stopped by SIGTERM after step {last}" in out
    ckpts = sorted(p.name for p in (tmp_path / "runs" / "train" / "checkpoints").iterdir())
    assert ckpts == ["latest", f"step_{last:06d}"]  # checkpoints were off: this one is the signal's


# ---------------------------------------------------------------------------------------------------------
# Exact resume (in-process jobs on 4 spawned ranks)
# ---------------------------------------------------------------------------------------------------------
def _run(out: Path, *extra: str) -> JobOutcome:
    from rich.console import Console

    from hsdp.apps.train import resolve_config, run_job

    cfg = resolve_config(None, ["train.steps=6", "train.eval_every=3", "train.checkpoint_every=3",
                                "train.log_every=1", "train.sample_tokens=0", "data.max_bytes=200000",
                                "optim.warmup_steps=2", f"train.out_dir={out}", *extra])
    return run_job(cfg, Console(quiet=True))


def _job(out: Path, *extra: str) -> dict:
    return _run(out, *extra).summary


def _preempted(out: Path, rank: int) -> JobOutcome:
    """A job in which rank 3 alone gets SIGTERM after step 3, as from a scheduler that signals one node."""
    from hsdp.apps.train.trainer import Trainer

    original = Trainer.after_step

    def after_step(self: Trainer, record: dict) -> None:
        original(self, record)
        if rank == 3 and record["step"] == 3:
            os.kill(os.getpid(), signal.SIGTERM)

    Trainer.after_step = after_step  # type: ignore[method-assign]
    try:
        return _run(out)
    finally:
        Trainer.after_step = original  # type: ignore[method-assign]


def _resume_worker(rank: int, world: int, tmp: str) -> dict:
    import hsdp
    from hsdp.apps.train.rank_warnings import RankWarnings
    from hsdp.apps.train.ranks import RankChannel

    base = Path(tmp)
    _job(base / "straight")
    _job(base / "resumed", "train.stop_after=4")  # stops after step 4; the newest checkpoint is step 3
    stopped = read_metrics(str(base / "resumed")) if rank == 0 else []
    session = _job(base / "resumed", "train.resume=true")["steps"]
    preempted = _preempted(base / "preempted", rank)
    preempted_steps = sorted(p.name for p in (base / "preempted" / "checkpoints").iterdir())
    after_preemption = _job(base / "preempted", "train.resume=true")["steps"]
    shown: list[str] = []
    with RankWarnings(shown.append) as w:
        for _ in range(3):  # repeated: still shown once
            warnings.warn("every rank says this", UserWarning, stacklevel=1)
        warnings.warn(f"only rank {rank} says this", UserWarning, stacklevel=1)
        w.flush(RankChannel(hsdp.init_mesh()))
    return {"stopped": stopped, "shown": shown, "session": session, "preempted": preempted.stopped,
            "preempted_steps": preempted.summary["steps"], "preempted_checkpoints": preempted_steps,
            "after_preemption": after_preemption}


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], Path]:
    """One 4-rank spawn for the in-process jobs of the tests below: ``(per-rank results, base directory)``."""
    base = tmp_path_factory.mktemp("jobs")
    return run_distributed(_resume_worker, 4, str(base), timeout=280), base


def test_resume_continues_the_straight_run_bitwise(jobs: tuple[list[dict], Path]) -> None:
    results, tmp_path = jobs
    straight, resumed = read_metrics(str(tmp_path / "straight")), read_metrics(str(tmp_path / "resumed"))
    assert [r["step"] for r in results[0]["stopped"]] == [1, 2, 3, 4]
    assert results[0]["session"] == {"first": 4, "last": 6, "planned": 6}  # loaded step 3, not a fresh start
    assert [r["step"] for r in resumed] == list(range(1, 7))  # step 4 was redone, not duplicated
    for a, b in zip(straight, resumed, strict=True):
        for key in ("loss", "eval_loss", "grad_norm", "lr", "tokens"):
            assert a[key] == b[key], (a["step"], key, a[key], b[key])  # bitwise: CPU fp32 and exact resume
    assert straight[-1]["loss"] < straight[0]["loss"]
    shown = results[0]["shown"]
    assert sum("every rank says this" in s for s in shown) == 1
    assert any(s.startswith("warning [ranks 0-3]") and "every rank says this" in s for s in shown)
    assert sum("only rank" in s for s in shown) == 4 and all(not r["shown"] for r in results[1:])


def test_sigterm_on_one_rank_stops_every_rank_after_a_checkpoint(jobs: tuple[list[dict], Path]) -> None:
    # The SIGTERM reaches rank 3 only, after step 3: every rank stops after step 4, the next all-reduce.
    results, tmp_path = jobs
    for r in results:
        assert r["preempted"] is True and r["preempted_steps"] == {"first": 1, "last": 4, "planned": 6}
        assert r["preempted_checkpoints"] == ["latest", "step_000003", "step_000004"]  # 4: saved on the signal
        assert r["after_preemption"] == {"first": 5, "last": 6, "planned": 6}
    straight, preempted = read_metrics(str(tmp_path / "straight")), read_metrics(str(tmp_path / "preempted"))
    assert [r["step"] for r in preempted] == list(range(1, 7))
    for a, b in zip(straight, preempted, strict=True):
        for key in ("loss", "eval_loss", "grad_norm", "lr", "tokens"):
            assert a[key] == b[key], (a["step"], key, a[key], b[key])
