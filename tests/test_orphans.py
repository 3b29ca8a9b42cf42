"""Orphaned ranks and two jobs on one run directory: ranks end with their launcher, one job per directory.

Spawns are the cost, so: the lease's rules run in this process; the parent-death signal runs in one small
child; one 2-rank spawn checks ``save_checkpoint`` and ``hsdp train``'s run directory against leases held
elsewhere; one torchrun job of ``hsdp train`` (2 ranks) meets a second job while alive, loses its agent to
SIGKILL mid-training, and is taken over and resumed bitwise by a third.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
from harness import run_distributed

from hsdp.apps.train.metrics import read_metrics
from hsdp.checkpoint.lease import hold_lease, lease_path, lease_problem, pid_space, process_alive, release_lease

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="pids, /proc and prctl: Linux")
PROGRAMS = Path(__file__).parent / "programs"


def _write_lease(run_dir: str, pid: int, space: str, age: float = 0.0, token: str = "other") -> None:
    """A lease on ``run_dir`` as another job would hold it: ``pid`` in ``space``, last beat ``age`` s ago."""
    path = lease_path(run_dir)
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"job": "slurm job 7", "host": "node9", "pid": pid, "pid_space": space, "token": token,
                   "since": time.time() - age}, f)
    os.utime(path, (time.time() - age, time.time() - age))


def _dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


# ---------------------------------------------------------------------------------------------------------
# The lease's rules (this process, no ranks)
# ---------------------------------------------------------------------------------------------------------
def test_a_live_lease_refuses_and_a_stale_one_is_taken_over_with_a_warning(tmp_path: Path) -> None:
    run = str(tmp_path / "run")
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _write_lease(run, sleeper.pid, pid_space())  # alive, on this host
        before = sorted(os.listdir(tmp_path))
        with pytest.raises(ValueError, match=rf"in use by job 'slurm job 7' \(pid {sleeper.pid} on host node9"):
            hold_lease(run)
        assert lease_problem(run) is not None and sorted(os.listdir(tmp_path)) == before  # nothing written
    finally:
        sleeper.kill()
        sleeper.wait()
    with pytest.warns(RuntimeWarning, match=rf"taking over the lease on .*run from .*: its process \(pid "
                                            rf"{sleeper.pid}\) is gone"):
        lease = hold_lease(run)
    held = json.loads(Path(lease_path(run)).read_text())
    assert held["pid"] == os.getpid() and held["token"] == lease.holder.token and lease_problem(run) is None
    assert hold_lease(run) is lease  # this process keeps it
    release_lease(run)
    assert not os.path.exists(lease_path(run)) and sorted(os.listdir(tmp_path)) == []
    # Another host: only the heartbeat tells; a fresh one refuses, an old one is taken over.
    _write_lease(run, 1, "elsewhere", age=5)
    with pytest.raises(ValueError, match="last heartbeat 5 s ago"):
        hold_lease(run, stale_after=30)
    _write_lease(run, 1, "elsewhere", age=45)
    with pytest.warns(RuntimeWarning, match="its heartbeat is 45 s old"):
        hold_lease(run, stale_after=30)
    release_lease(run)
    Path(lease_path(run)).write_text("not a lease")  # unreadable: an unknown holder, live while recent
    with pytest.raises(ValueError, match="in use by an unreadable lease file"):
        hold_lease(run)
    os.utime(lease_path(run), (time.time() - 90, time.time() - 90))
    with pytest.warns(RuntimeWarning, match=r"from an unreadable lease file \(last written 90 s ago\): its heartbeat"):
        hold_lease(run)
    release_lease(run)


def test_file_systems_without_hard_links_or_a_writable_parent(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    import hsdp.checkpoint.lease as lease_module

    run = str(tmp_path / "run")
    monkeypatch.setattr(os, "link", lambda *a: (_ for _ in ()).throw(OSError(errno.EPERM, "no hard links")))
    lease = hold_lease(run)  # created exclusively instead
    assert json.loads(Path(lease_path(run)).read_text())["token"] == lease.holder.token
    assert sorted(os.listdir(tmp_path)) == ["run.lease"]
    release_lease(run)
    monkeypatch.setattr(lease_module, "_create", lambda *a: (_ for _ in ()).throw(OSError(errno.EROFS, "read-only")))
    with pytest.warns(RuntimeWarning, match="cannot create the lease file .*nothing stops a second job"):
        lease = hold_lease(run)
    assert not lease.protected and lease.renew() is None and lease.check() is None
    release_lease(run)


def test_a_holder_whose_lease_was_taken_over_learns_it_at_the_next_renewal(tmp_path: Path) -> None:
    run = str(tmp_path / "run")
    lease = hold_lease(run, stale_after=0.6)  # the watchdog check renews every 0.1 s
    time.sleep(0.15)
    beat = os.stat(lease_path(run)).st_mtime
    assert lease.check() is None and os.stat(lease_path(run)).st_mtime > beat  # renewed
    _write_lease(run, os.getpid() + 1, "elsewhere", token="taker")  # another job judged it stale
    time.sleep(0.15)
    message = lease.check()
    assert message is not None and "was taken over by job 'slurm job 7'" in message, message
    with pytest.raises(ValueError, match="taken over"):
        hold_lease(run)
    assert json.loads(Path(lease_path(run)).read_text())["token"] == "taker"  # the taker's file is untouched
    release_lease(run)  # holds nothing any more: leaves the taker's lease alone
    assert os.path.exists(lease_path(run))


# ---------------------------------------------------------------------------------------------------------
# The parent-death signal (one child process, no ranks)
# ---------------------------------------------------------------------------------------------------------
PARENT = """
import subprocess, sys, threading, time
def start():  # from a thread that then ends: Linux signals the child then too, and it must live on
    child = subprocess.Popen([sys.executable, sys.argv[1]], stdout=subprocess.PIPE, text=True)
    print(child.stdout.readline().strip(), flush=True)
thread = threading.Thread(target=start)
thread.start()
thread.join()
print("thread gone", flush=True)
time.sleep(60)
"""


def test_a_process_ends_with_its_parent_not_with_the_thread_that_started_it(tmp_path: Path) -> None:
    log = tmp_path / "stderr.txt"
    with open(log, "w") as err:
        parent = subprocess.Popen([sys.executable, "-c", PARENT, str(PROGRAMS / "launcher_child.py")],
                                  stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        armed = parent.stdout.readline()
        assert armed.startswith("armed "), armed + log.read_text()
        child = int(armed.split()[1])
        assert parent.stdout.readline().strip() == "thread gone"
        time.sleep(0.5)
        assert process_alive(child), log.read_text()
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 10
    while process_alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not process_alive(child)
    assert f"[hsdp rank 0] aborting: its launcher (pid {parent.pid}) is gone" in log.read_text()


# ---------------------------------------------------------------------------------------------------------
# save_checkpoint and hsdp train's run directory against leases held elsewhere (one 2-rank spawn)
# ---------------------------------------------------------------------------------------------------------
def _outcome(fn: object) -> str:
    try:
        fn()  # type: ignore[operator]
        return "ok"
    except ValueError as e:
        return f"{type(e).__name__}: {e}"


def _leased_saves(rank: int, world: int, work: str, holder: int) -> dict:
    import torch.distributed as dist
    from checkpoint_helpers import build, train_step

    import hsdp
    from hsdp.apps.train import resolve_config
    from hsdp.apps.train.ranks import RankChannel
    from hsdp.apps.train.rundir import prepare_run_dir

    mesh = hsdp.init_mesh(2, fault_policy=None)  # leases renewed at each save; no watchdog to end the ranks
    model, opt = build(mesh)
    train_step(model, opt)
    out: dict = {}
    busy, trainbusy, run = (os.path.join(work, n) for n in ("busy", "trainbusy", "run"))
    out["save, held elsewhere"] = _outcome(lambda: hsdp.save_checkpoint(busy, model, opt))
    out["busy dir written"] = os.path.exists(busy)
    cfg = resolve_config(None, [f"train.out_dir={trainbusy}", "train.resume=true"])
    out["train, held elsewhere"] = _outcome(lambda: prepare_run_dir(cfg, RankChannel(mesh)))
    out["train dir"] = sorted(os.listdir(trainbusy))
    hsdp.save_checkpoint(run, model, opt, step=1)
    if rank == 0:  # another job (this test's process) judged the lease stale and took it
        _write_lease(run, holder, pid_space())
    dist.barrier()
    listing = sorted(os.listdir(run))
    model2, opt2 = build(mesh, seed=5)
    out["load while held elsewhere"] = _outcome(lambda: hsdp.load_checkpoint(run, model2, opt2))
    out["save after the takeover"] = _outcome(lambda: hsdp.save_checkpoint(run, model, opt, step=2))
    out["nothing more written"] = sorted(os.listdir(run)) == listing
    if rank == 0:  # that job died: its lease is stale now
        _write_lease(run, _dead_pid(), pid_space())
    dist.barrier()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out["save after its holder died"] = _outcome(lambda: hsdp.save_checkpoint(run, model, opt, step=3))
    out["warnings"] = [str(w.message) for w in caught]
    out["steps"] = sorted(n for n in os.listdir(run) if n.startswith("step_"))
    return out


def test_saves_and_hsdp_train_respect_a_lease_held_by_another_job(tmp_path: Path) -> None:
    busy, trainbusy = str(tmp_path / "busy"), str(tmp_path / "trainbusy" / "checkpoints")
    hold_lease(busy)  # this process plays the other, live job
    hold_lease(trainbusy)
    try:
        results = run_distributed(_leased_saves, 2, str(tmp_path), os.getpid(), timeout=200)
    finally:
        release_lease(busy)
        release_lease(trainbusy)
    refusal = f"in use by a job (pid {os.getpid()} on host"
    for rank, r in enumerate(results):
        assert r["save, held elsewhere"].startswith("CheckpointError: save_checkpoint: preparing the run "
                                                    "directory: ") and refusal in r["save, held elsewhere"], r
        assert not r["busy dir written"]
        assert r["train, held elsewhere"].startswith("ValueError: ") and refusal in r["train, held elsewhere"], r
        assert r["train dir"] == ["checkpoints.lease"], r  # no config.toml: nothing written
        assert r["load while held elsewhere"] == "ok", r
        assert "was taken over by job 'slurm job 7'" in r["save after the takeover"], r
        assert r["nothing more written"], r
        assert r["save after its holder died"] == "ok", r
        assert r["steps"] == ["step_000001", "step_000003"], r
        taken = [w for w in r["warnings"] if "taking over the lease" in w and "is gone" in w]
        assert len(taken) == (1 if rank == 0 else 0), r["warnings"]  # rank 0 holds the job's lease


# ---------------------------------------------------------------------------------------------------------
# A torchrun job of hsdp train: a second job, its agent SIGKILLed, a third job that takes over
# ---------------------------------------------------------------------------------------------------------
RANKS = 2  # what the lease and the orphans need; fewer processes on 2 cores
TRAIN = ["--steps", "1000", "train.checkpoint_every=4", "train.log_every=1", "train.eval_every=0",
         "train.sample_tokens=0", "data.max_bytes=100000", "train.batch_size=2"]


def _torchrun(out: Path, log: Path, *args: str) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(RANKS),
           "-m", "hsdp.apps.train", "--out", str(out), *args]
    with open(log, "w") as f:  # a file, not a pipe: nobody reads while the job runs
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "400"})  # no wrapping


def _children(pid: int) -> list[int]:
    kids = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                if entry.isdigit() and int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    kids.append(int(entry))
        except (OSError, ValueError):
            continue
    return kids


def _wait_for_steps(out: Path, done: Callable[[int], bool], job: subprocess.Popen[str], log: Path) -> int:
    """Wait until the number of finished steps satisfies ``done``; that number."""
    metrics, deadline = out / "metrics.jsonl", time.monotonic() + 150
    while True:
        steps = metrics.read_text().count("\n") if metrics.exists() else 0
        if done(steps):
            return steps
        assert job.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.02)


def _own_files(out: Path) -> dict[str, object]:
    """What a job writes once, at its start or end (not every step): size and modification time, if any,
    and the lease's holder (its modification time is the holder's heartbeat)."""
    paths = [out / "config.toml", out / "summary.json", out / "sample.txt"]
    return {"lease": Path(lease_path(out / "checkpoints")).read_text(),
            **{p.name: (p.stat().st_size, p.stat().st_mtime_ns) if p.exists() else None for p in paths}}


def _committed(ckpts: Path) -> tuple[list[str], str]:
    """The committed checkpoint directories and what ``latest`` names."""
    steps = sorted(p.name for p in ckpts.iterdir() if p.name.startswith("step_") and "." not in p.name)
    return steps, (ckpts / "latest").read_text().strip()


def _second_job(out: Path, export_to: Path) -> tuple[int, str, float, int]:
    """``hsdp train --resume`` on ``out`` next to ``hsdp export`` of its checkpoints (a reader), both at once:
    the train job's status, stderr and seconds, the export's status."""
    start = time.monotonic()
    second = subprocess.Popen([sys.executable, "-m", "hsdp", "train", "--resume", "--out", str(out), *TRAIN],
                              cwd=out.parent, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    export = subprocess.Popen([sys.executable, "-m", "hsdp", "export", str(out / "checkpoints"), "--to",
                               str(export_to)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, err = second.communicate(timeout=120)
    seconds = time.monotonic() - start
    return second.returncode, err, seconds, export.wait(timeout=120)


def test_orphaned_ranks_end_and_a_second_job_is_refused_then_takes_over(tmp_path: Path) -> None:
    out, ckpts, log = tmp_path / "run", tmp_path / "run" / "checkpoints", tmp_path / "first.txt"
    first = _torchrun(out, log, *TRAIN)
    workers: list[int] = []
    try:
        _wait_for_steps(out, lambda n: n >= 5, first, log)  # step 4 is committed
        workers = _children(first.pid)
        holder = json.loads(Path(lease_path(ckpts)).read_text())
        assert len(workers) == RANKS and holder["pid"] in workers, (workers, holder)
        # A second job while the first lives: refused before any rank starts. (That a refused rank writes
        # nothing is checked exactly by the 2-rank test; here the first job keeps writing, so check what the
        # second's start would write: the configuration, the lease.)
        before = _own_files(out)
        status, err, refused_s, exported = _second_job(out, tmp_path / "w.safetensors")
        held_by = f"job '{holder['job']}' (pid {holder['pid']} on host "
        assert status == 2 and f"{os.path.realpath(ckpts)} is in use by {held_by}" in err, err[-3000:]
        assert _own_files(out) == before
        assert exported == 0 and (tmp_path / "w.safetensors").stat().st_size > 100_000  # loading still works
        # SIGKILL the agent mid-training, two steps after a checkpoint (every 4 steps) and two before the
        # next. Those two steps are redone after the resume: their losses check the weights and the
        # optimizer state.
        _wait_for_steps(out, lambda n: n >= 6 and n % 4 == 2, first, log)
        first.kill()
        first.wait()
        killed_at = time.monotonic()
        committed = _committed(ckpts)
        while any(process_alive(p) for p in workers) and time.monotonic() < killed_at + 30:
            time.sleep(0.05)
        ended_s = time.monotonic() - killed_at
    finally:
        first.kill()
        for pid in workers:
            if process_alive(pid):
                os.kill(pid, signal.SIGKILL)
    text = log.read_text()
    assert not any(process_alive(p) for p in workers) and ended_s < 30, (ended_s, text[-3000:])
    assert text.count(f"aborting: its launcher (pid {first.pid}) is gone") == RANKS, text[-3000:]
    time.sleep(1.0)
    assert _committed(ckpts) == committed  # nothing committed after the kill
    newest = int(committed[1][len("step_"):])
    killed = read_metrics(str(out))
    assert killed[-1]["step"] > newest, (killed[-1]["step"], newest)  # steps to redo and compare
    # A third job after the first died: takes the lease over with a warning, resumes bitwise.
    third = _torchrun(out, tmp_path / "third.txt", "--resume", f"train.stop_after={killed[-1]['step']}")
    assert third.wait(timeout=200) == 0, (tmp_path / "third.txt").read_text()[-3000:]
    text = (tmp_path / "third.txt").read_text()
    assert f"taking over the lease on {os.path.realpath(ckpts)} from {held_by}" in text, text[-3000:]
    assert f"its process (pid {holder['pid']}) is gone" in text, text[-3000:]
    assert f"resumed from {ckpts / committed[1]} (step {newest})" in text, text[-3000:]
    resumed = read_metrics(str(out))
    assert [r["step"] for r in resumed] == list(range(1, killed[-1]["step"] + 1))
    for a, b in zip(killed, resumed, strict=True):
        for key in ("loss", "grad_norm", "lr", "tokens"):
            assert a[key] == b[key], (a["step"], key, a[key], b[key])
    assert not os.path.exists(lease_path(ckpts))  # given back at the end
    print(f"second job refused in {refused_s:.1f} s; workers ended {ended_s:.1f} s after the agent's SIGKILL")
