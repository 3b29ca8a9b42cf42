"""``hsdp launch`` on an emulated 2-node cluster: traffic counters, link speed, failures, cleanup, fallback.

The emulation tests need root and iproute2 (CI has both) and skip with the reason otherwise; the fallback
tests and the unit tests run anywhere.

Expected inter-node volume of ``tests/programs/allreduce.py`` (2 nodes x 2 ranks, world-group all-reduce of
S bytes): gloo all-reduces CPU tensors with a ring (reduce-scatter then all-gather) over the ranks in order,
0 -> 1 -> 2 -> 3 -> 0, each rank sending 2 (P-1)/P * S = 1.5 S to its right neighbour. Ranks 0, 1 are node
0 and ranks 2, 3 node 1, so exactly two ring edges cross nodes (1 -> 2 and 3 -> 0): per all-reduce each node
sends 1.5 S and receives 1.5 S. Measured, not assumed: the counters show 1.5 S, where recursive
halving-doubling (partners at distance 1, then 2) would give 1.0 S. Not in the formula: the rendezvous and
barriers (~10 kB), the 16-byte check all-reduce, and the TCP/IP/Ethernet headers the counters include
(0.3 % at 1 Gbit/s, where segments travel batched; ~6 % at 50 Mbit/s, where each 1448-byte segment is a frame
of its own). The 10 % check uses the 1 Gbit/s run.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from hsdp.tools.launch.netns import RunId, find_tools, list_namespaces, process_start_ticks
from hsdp.tools.quantities import format_rate, parse_duration, parse_tc_rate

ROOT = Path(__file__).resolve().parents[1]
PROGRAM = ROOT / "tests" / "programs" / "allreduce.py"
NUMEL = 1 << 19  # 2 MiB fp32: 50 Mbit/s moves the inter-node share in ~2 s, 1 Gbit/s in ~0.1 s
ITERS = 4
RUN_TIMEOUT_S = 120


def _need_emulation() -> None:
    if os.geteuid() != 0:
        pytest.skip("network emulation needs root (network namespaces and tc)")
    if find_tools() is None:
        pytest.skip("network emulation needs iproute2 (`ip` and `tc`) on PATH")


def _env(path: str | None = None) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    if path is not None:
        env["PATH"] = path
    return env


def _command(launch_args: list[str], program_args: list[str]) -> list[str]:
    return [sys.executable, "-m", "hsdp", "launch", *launch_args, "--", str(PROGRAM), *program_args]


@dataclass(frozen=True)
class Run:
    returncode: int
    output: str
    elapsed_s: float
    finished_at: float
    stats: dict | None
    leftovers: list[str]


def _namespaces_of(pid: int) -> list[str]:
    return [ns for ns in list_namespaces(find_tools()) if (run := RunId.from_namespace(ns)) and run.owner_pid == pid]


def _launch(tmp_path: Path, launch_args: list[str], program_args: list[str], path: str | None = None) -> Run:
    stats = tmp_path / "stats.json"
    started = time.monotonic()
    proc = subprocess.Popen(_command([*launch_args, "--stats-json", str(stats)], program_args), cwd=ROOT,
                            env=_env(path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        output, _ = proc.communicate()
        pytest.fail(f"hsdp launch did not finish in {RUN_TIMEOUT_S}s:\n{output}")
    finished = time.time()
    leftovers = _namespaces_of(proc.pid) if find_tools() else []
    data = json.loads(stats.read_text()) if stats.exists() else None
    return Run(proc.returncode, output, time.monotonic() - started, finished, data, leftovers)


def _allreduce_seconds(run: Run) -> float:
    found = re.findall(r"allreduce_seconds=([0-9.]+)", run.output)
    assert len(found) == 1, run.output
    return float(found[0])


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Run]]:
    """The same all-reduce job at 1 Gbit/s and at 50 Mbit/s (each run once for the tests below)."""
    _need_emulation()
    program = ["--numel", str(NUMEL), "--iters", str(ITERS)]
    yield {bw: _launch(tmp_path_factory.mktemp(bw), ["--nodes", "2", "--nproc-per-node", "2",
                                                     "--inter-node-bandwidth", bw, "--require-emulation"], program)
           for bw in ("1gbit", "50mbit")}


# ---------------------------------------------------------------------------------------------------------
# Acceptance: bytes, speed, failure, no leftovers.
# ---------------------------------------------------------------------------------------------------------
def _relative_errors(run: Run) -> dict[str, float]:
    assert run.returncode == 0, run.output
    assert run.leftovers == [], f"namespaces left behind: {run.leftovers}"
    assert run.stats is not None and run.stats["emulated"], run.output
    expected = 1.5 * NUMEL * 4 * ITERS  # per node and direction, see the module docstring
    return {f"node {n['node']} {key}": n[key] / expected - 1
            for n in run.stats["nodes"] for key in ("sent_bytes", "received_bytes")}


def test_inter_node_bytes_match_the_ring_all_reduce(runs: dict[str, Run]) -> None:
    errors = _relative_errors(runs["1gbit"])
    assert len(errors) == 4 and all(abs(e) <= 0.10 for e in errors.values()), (errors, runs["1gbit"].output)
    assert "Inter-node traffic" in runs["1gbit"].output  # the table is printed too


def test_slow_links_count_the_same_volume_plus_per_frame_headers(runs: dict[str, Run]) -> None:
    # At 50 Mbit/s the token bucket is shallower than a TSO burst, so the kernel segments every burst into
    # MTU-sized frames and the counters see one 66-byte header per 1448 payload bytes (4.6 %) plus the
    # ACKs of the other direction: more above the payload than at 1 Gbit/s, never below it.
    errors = _relative_errors(runs["50mbit"])
    assert len(errors) == 4 and all(0 <= e <= 0.15 for e in errors.values()), (errors, runs["50mbit"].output)


def test_the_transfer_is_at_least_3x_slower_at_50mbit(runs: dict[str, Run]) -> None:
    fast, slow = _allreduce_seconds(runs["1gbit"]), _allreduce_seconds(runs["50mbit"])
    assert slow >= 3 * fast, f"50mbit: {slow:.3f}s, 1gbit: {fast:.3f}s (ratio {slow / fast:.1f})"
    # And the slow link really runs near its setting (the per-node share is sent at <= 50 Mbit/s).
    assert slow >= 0.8 * 1.5 * NUMEL * 4 * ITERS * 8 / 50e6


def test_a_failing_rank_stops_the_job_within_30s(tmp_path: Path) -> None:
    _need_emulation()
    run = _launch(tmp_path, ["--nodes", "2", "--nproc-per-node", "2", "--require-emulation"], ["--fail-rank", "3"])
    assert run.returncode != 0, run.output
    assert "rank 3 fails on purpose" in run.output, run.output  # the failing rank's error is shown
    failed_at = float(re.findall(r"failing_at=([0-9.]+)", run.output)[0])
    assert run.finished_at - failed_at < 30, f"launcher exited {run.finished_at - failed_at:.1f}s after the failure"
    assert run.leftovers == [], f"namespaces left behind: {run.leftovers}"
    assert run.stats is not None and run.stats["exit_code"] == run.returncode


# ---------------------------------------------------------------------------------------------------------
# Signals to the launcher and leftovers of dead runs.
# ---------------------------------------------------------------------------------------------------------
def _start_long_job() -> tuple[subprocess.Popen[str], list[int]]:
    """A launcher running a job that would take minutes; returns it and the PIDs in its namespaces."""
    cmd = _command(["--nodes", "2", "--inter-node-bandwidth", "10mbit", "--require-emulation"],
                   ["--numel", str(1 << 20), "--iters", "1000"])
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            text=True)
    tools = find_tools()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        names = [ns for ns in _namespaces_of(proc.pid) if not ns.endswith("-sw")]
        out = [subprocess.run([tools.ip, "netns", "pids", ns], capture_output=True, text=True).stdout for ns in names]
        pids = [int(p) for o in out for p in o.split()]
        if len(names) == 2 and len(pids) >= 4:  # an agent and a worker in each node
            return proc, pids
        time.sleep(0.2)
    proc.kill()
    pytest.fail("the job did not start within 60 s")


def _wait_gone(pid: int, pids: list[int], timeout_s: float) -> tuple[list[str], list[int]]:
    deadline = time.monotonic() + timeout_s
    while True:
        names = _namespaces_of(pid)
        alive = [p for p in pids if process_start_ticks(p) is not None]
        if (not names and not alive) or time.monotonic() > deadline:
            return names, alive
        time.sleep(0.2)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["sigint", "sigkill"])
def test_stopping_the_launcher_removes_everything(sig: signal.Signals) -> None:
    _need_emulation()
    proc, pids = _start_long_job()
    proc.send_signal(sig)
    code = proc.wait(timeout=30)
    assert code == (130 if sig == signal.SIGINT else -signal.SIGKILL)
    # After SIGKILL the reaper removes the run: give it the agents' grace period.
    names, alive = _wait_gone(proc.pid, pids, timeout_s=20)
    assert names == [] and alive == [], f"left behind: namespaces {names}, processes {alive}"


def test_cleanup_removes_runs_whose_launcher_died() -> None:
    _need_emulation()
    tools = find_tools()
    dead = subprocess.Popen(["true"])
    dead.wait()
    me = os.getpid()
    dead_ns = f"{RunId(255, dead.pid, 1).name}-n0"
    live_ns = f"{RunId(255, me, process_start_ticks(me) or 0).name}-n0"
    try:
        for ns in (dead_ns, live_ns):
            subprocess.run([tools.ip, "netns", "add", ns], check=True)
        out = subprocess.run([sys.executable, "-m", "hsdp", "launch", "--cleanup"], cwd=ROOT, env=_env(),
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        names = list_namespaces(tools)
        assert dead_ns not in names, out.stdout
        assert live_ns in names, "a run whose launcher is alive must be left alone"
    finally:
        for ns in (dead_ns, live_ns):
            subprocess.run([tools.ip, "netns", "del", ns], capture_output=True)


# ---------------------------------------------------------------------------------------------------------
# Fallback to loopback.
# ---------------------------------------------------------------------------------------------------------
def test_without_ip_it_warns_and_runs_on_loopback(tmp_path: Path) -> None:
    empty = tmp_path / "bin"
    empty.mkdir()  # a PATH without `ip` and `tc`
    run = _launch(tmp_path, ["--nodes", "2", "--nproc-per-node", "1"], ["--numel", "1024", "--iters", "2"],
                  path=str(empty))
    assert run.returncode == 0, run.output
    warnings = [line for line in run.output.splitlines() if "warning: no network emulation" in line]
    assert len(warnings) == 1, run.output
    assert "world=2 nodes=2" in run.output  # the job ran on both (loopback) nodes
    assert run.stats is not None and run.stats["emulated"] is False and run.stats["nodes"] == []


def test_require_emulation_turns_the_fallback_into_an_error(tmp_path: Path) -> None:
    empty = tmp_path / "bin"
    empty.mkdir()
    run = _launch(tmp_path, ["--require-emulation"], [], path=str(empty))
    assert run.returncode == 2, run.output
    assert "network emulation required but unavailable" in run.output
    assert "world=" not in run.output  # nothing was started


def test_a_failed_setup_is_removed_and_reported(tmp_path: Path) -> None:
    _need_emulation()
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "ip").symlink_to(find_tools().ip)
    (fake / "tc").write_text("#!/bin/sh\necho 'tc: refused for the test' >&2\nexit 1\n")
    (fake / "tc").chmod(0o755)  # a tc that refuses every qdisc: setup fails after namespaces exist
    run = _launch(tmp_path, ["--require-emulation"], [], path=str(fake))
    assert run.returncode == 2, run.output
    assert "setup failed" in run.output and "refused for the test" in run.output, run.output
    assert run.leftovers == [], f"namespaces left behind: {run.leftovers}"
    assert "world=" not in run.output  # nothing was started


# ---------------------------------------------------------------------------------------------------------
# Units and names (no processes).
# ---------------------------------------------------------------------------------------------------------
def test_rates_and_durations_use_tc_units() -> None:
    assert parse_tc_rate("1gbit") == 10**9 and parse_tc_rate("50Mbit") == 50 * 10**6
    assert parse_tc_rate("1.5kbit") == 1500
    assert format_rate(50 * 10**6, bits=True) == "50mbit"
    assert parse_duration("1ms") == pytest.approx(1e-3) and parse_duration("0") == 0.0
    with pytest.raises(ValueError, match="bytes per second"):
        parse_tc_rate("10mbps")
    with pytest.raises(ValueError, match="unknown unit"):
        parse_duration("3 parsecs")


def test_run_names_round_trip_and_ignore_foreign_namespaces() -> None:
    run = RunId(7, 4711, 123456)
    assert RunId.from_namespace(f"{run.name}-sw") == run
    assert RunId.from_namespace(f"{run.name}-n12") == run
    assert RunId.from_namespace("hsdp-something-else") is None
    assert RunId.from_namespace("docker-netns-1") is None


def test_launch_reads_rates_as_hsdp_plan_does(monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture) -> None:
    from hsdp.apps.cli import main

    started = []
    monkeypatch.setattr("hsdp.tools.launch.emulated.launch", lambda options: started.append(options) or 0)
    job = ["--", "-m", "hsdp.tools.planner.workload"]
    # Bytes per second, as `hsdp plan --inter-node-bandwidth 50GB/s` takes them, become tc's bits.
    assert main(["launch", "--inter-node-bandwidth", "1GB/s", *job]) == 0
    assert main(["launch", "--inter-node-bandwidth", "400Gb/s", *job]) == 0
    assert [parse_tc_rate(o.bandwidth) for o in started] == [8 * 10**9, 400 * 10**9]
    assert parse_tc_rate("25GiB/s") == 8 * 25 * 2**30 and parse_tc_rate("100mbit/s") == 10**8
    for bad, fix in [("10mbps", "'10mbit' for bits or '10MB/s'"), ("1", "'1gbit', '400Gb/s'"),
                     ("1GB", "bytes per second ('1GB/s'")]:
        assert main(["launch", "--inter-node-bandwidth", bad, *job]) == 2
        assert fix in capsys.readouterr().err, bad
    assert len(started) == 2
