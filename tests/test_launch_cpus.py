"""``hsdp launch --node-cpus``: a CPU budget per emulated node (a cgroup v1 cpu group), and nothing left behind.

One emulated run (2 nodes x 1 rank, node 0 at 1 CPU, node 1 at 0.25) burns the same 1.5 s of CPU time on
both nodes: node 1 must take clearly longer (at 0.25 CPU at least 4x; the assertion asks for 2x, which holds
while node 0 gets half a core) and never run faster than its budget. The other checks start no torch: the
loopback mode with stand-in agents (``sh``), the reaper and ``--cleanup`` on real groups, and the validation.
The cgroup tests need root and the cgroup v1 cpu controller (CI has both) and skip with the reason otherwise.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hsdp.tools.launch import cpu_groups, emulated
from hsdp.tools.launch.cpu_groups import CpuGroups, node_budgets, parse_node_cpus
from hsdp.tools.launch.local import AgentSpec
from hsdp.tools.launch.netns import RunId, find_tools, process_start_ticks
from hsdp.tools.launch.reaper import Reaper, list_cpu_groups

ROOT = Path(__file__).resolve().parents[1]
JOB = ("-m", "hsdp.tools.planner.workload")  # any entry point that exists; never started here
BURN_S = 1.5
BURN = f"""\
import os, time
wall, cpu = time.perf_counter(), time.process_time()
x = 0
while time.process_time() - cpu < {BURN_S}:
    for _ in range(20000):
        x += 1
wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
group = [line.split(":")[2] for line in open("/proc/self/cgroup") if "cpu" in line.split(":")[1].split(",")][0]
print(f"node={{os.environ['GROUP_RANK']}} wall_s={{wall:.3f}} cpu_s={{cpu:.3f}} group={{group}}", flush=True)
"""


def _need_cgroups() -> None:
    problem = cpu_groups.controller_problem()
    if problem:
        pytest.skip(problem)


def _groups_of(owner_pid: int) -> list[str]:
    return [g for g in list_cpu_groups(cpu_groups.CPU_ROOT)
            if (run := RunId.from_namespace(g)) and run.owner_pid == owner_pid]


# ---------------------------------------------------------------------------------------------------------
# The emulated run: a slow node is slow.
# ---------------------------------------------------------------------------------------------------------
def test_a_quarter_cpu_node_takes_longer_for_the_same_work_and_its_groups_go(tmp_path: Path) -> None:
    _need_cgroups()
    if os.geteuid() != 0 or find_tools() is None:
        pytest.skip("network emulation needs root and iproute2 (`ip` and `tc`)")
    script = tmp_path / "burn.py"
    script.write_text(BURN)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "hsdp", "launch", "--nodes", "2", "--nproc-per-node", "1", "--node-cpus",
           "1.0,0.25", "--require-emulation", "--", str(script)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, output
    found = {int(n): (float(w), float(c), g)
             for n, w, c, g in re.findall(r"node=(\d) wall_s=([\d.]+) cpu_s=([\d.]+) group=(\S+)", output)}
    assert sorted(found) == [0, 1], output
    for node, (_, _, group) in found.items():  # each rank ran in its node's group, named after the run
        run = RunId.from_namespace(group.strip("/"))
        assert run is not None and run.owner_pid == proc.pid and group.endswith(f"-n{node}"), group
    (fast_wall, _, _), (slow_wall, slow_cpu, _) = found[0], found[1]
    assert slow_wall > 2 * fast_wall, f"node 1 (0.25 CPU) {slow_wall:.2f} s vs node 0 (1 CPU) {fast_wall:.2f} s"
    assert slow_cpu / slow_wall < 0.3, f"node 1 used {slow_cpu / slow_wall:.2f} CPU, over its 0.25 budget"
    assert _groups_of(proc.pid) == [], "cpu groups left behind"


# ---------------------------------------------------------------------------------------------------------
# Loopback, reaper, --cleanup: real groups, stand-in processes.
# ---------------------------------------------------------------------------------------------------------
def test_loopback_agents_start_inside_their_groups_which_are_removed_after(monkeypatch: pytest.MonkeyPatch,
                                                                           capsys: pytest.CaptureFixture) -> None:
    _need_cgroups()

    def stand_ins(nodes: int, nproc: int, script: list[str], env: dict, **_: object) -> list[AgentSpec]:
        show = "grep -E ':([a-z,]*,)?cpu(,[a-z,]*)?:' /proc/self/cgroup; echo threads=$OMP_NUM_THREADS"
        return [AgentSpec(("sh", "-c", show), {**os.environ, "OMP_NUM_THREADS": "8"}, f"node {i}")
                for i in range(nodes)]

    monkeypatch.setattr(emulated, "local_agents", stand_ins)
    options = emulated.LaunchOptions(JOB, nodes=2, nproc_per_node=2, no_emulation=True, node_cpus=(0.5,))
    assert options.node_cpus == (0.5, 0.5)
    assert emulated.launch(options) == 0
    out = capsys.readouterr().out
    name = cpu_groups.loopback_run().name
    for i in range(2):
        assert re.search(rf"^\[node {i}\] \d+:[\w,]*\bcpu\b[\w,]*:/{name}-n{i}$", out, re.M), out
    assert out.count("threads=1") == 2, out  # 0.5 CPU for 2 ranks: one thread each, not the 8 of the default
    assert _groups_of(os.getpid()) == []


def test_the_reaper_stops_what_is_left_in_the_groups_and_removes_them(tmp_path: Path) -> None:
    _need_cgroups()
    run = RunId(0, os.getpid(), process_start_ticks(os.getpid()) or 0)
    groups = CpuGroups(run.name, (0.5, 0.25))
    reaper = Reaper(run.name, None, str(tmp_path / "scratch"), cpu_groups.CPU_ROOT)
    try:
        groups.create()
        assert Path(groups.path(1), "cpu.cfs_quota_us").read_text().strip() == "25000"
        assert Path(groups.path(1), "cpu.shares").read_text().strip() == str(4 * 1024)
        sleepers = [subprocess.Popen(groups.wrap(i, ["sleep", "60"])) for i in range(2)]
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not all(
                str(p.pid) in Path(groups.path(i), "cgroup.procs").read_text().split() for i, p in enumerate(sleepers)):
            time.sleep(0.02)
        reaper.release()  # as if the launcher had died: the reaper stops the sleepers, then removes the groups
        assert [p.wait(timeout=10) for p in sleepers] == [-15, -15]
        assert _groups_of(os.getpid()) == []
    finally:
        groups.teardown()


def test_cleanup_removes_the_groups_of_dead_launchers_only() -> None:
    _need_cgroups()
    dead = subprocess.Popen(["true"])
    dead.wait()
    me = os.getpid()
    dead_run, live_run = RunId(0, dead.pid, 1), RunId(0, me, process_start_ticks(me) or 0)
    for run in (dead_run, live_run):
        CpuGroups(run.name, (1.0,)).create()
    try:
        removed = cpu_groups.cleanup_leftover_groups()
        assert f"{dead_run.name}-n0" in removed
        assert _groups_of(dead.pid) == [] and _groups_of(me) == [f"{live_run.name}-n0"]
    finally:
        for run in (dead_run, live_run):
            CpuGroups(run.name, ()).teardown()


# ---------------------------------------------------------------------------------------------------------
# Validation, before anything exists (no processes).
# ---------------------------------------------------------------------------------------------------------
def test_budgets_are_one_per_node_or_one_for_all() -> None:
    assert parse_node_cpus("1.0,0.5") == (1.0, 0.5) and parse_node_cpus("2") == (2.0,)
    assert node_budgets((0.5,), 3, cpu_count=2) == (0.5, 0.5, 0.5)
    assert node_budgets((1, 0.25), 2, cpu_count=2) == (1.0, 0.25)
    assert cpu_groups.quota_us(0.25) == 25_000 and cpu_groups.quota_us(1.5) == 150_000


@pytest.mark.parametrize(("cpus", "fix"), [
    ((1.0, 0.5, 0.5), "3 values for 2 nodes: give one per node or a single value"),
    ((1.0, 0.0), "finite, positive"), ((-1.0,), "finite, positive"),
    ((float("nan"),), "finite, positive"), ((float("inf"), 1.0), "finite, positive"),
    ((0.001,), "smallest budget the kernel enforces is 0.01 CPU"),
    ((1.0, 3.0), "this machine has 2 CPUs; give at most 2"),
])
def test_bad_budgets_name_the_fix(cpus: tuple[float, ...], fix: str) -> None:
    with pytest.raises(ValueError, match=re.escape(fix)):
        node_budgets(cpus, 2, cpu_count=2)


def test_bad_budgets_are_refused_before_anything_is_created(monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture,
                                                            tmp_path: Path) -> None:
    from hsdp.apps.cli import main

    started = []
    monkeypatch.setattr(emulated, "launch", lambda options: started.append(options) or 0)
    too_many = str((os.cpu_count() or 1) + 1)
    for bad, fix in [("1,2,3", "3 values for 2 nodes"), ("fast,slow", "comma-separated (e.g. 1.0,0.5)"),
                     ("0", "finite, positive"), (too_many, f"give at most {os.cpu_count()}")]:
        assert main(["launch", "--nodes", "2", "--node-cpus", bad, "--", *JOB]) == 2, bad
        assert fix in capsys.readouterr().err, bad
    # No writable controller: refused with what is needed, also before anything runs.
    monkeypatch.setattr(cpu_groups, "CPU_ROOT", str(tmp_path / "missing"))
    assert main(["launch", "--node-cpus", "0.5", "--", *JOB]) == 2
    err = capsys.readouterr().err
    assert "needs the cgroup v1 cpu controller mounted and writable" in err and "run as root" in err, err
    assert started == []


def test_the_controller_check_accepts_a_mounted_writable_controller(tmp_path: Path) -> None:
    (tmp_path / "cpu.cfs_quota_us").write_text("-1\n")
    assert cpu_groups.controller_problem(str(tmp_path)) is None
    assert "not mounted there" in (cpu_groups.controller_problem(str(tmp_path / "none")) or "")


def test_agents_are_wrapped_into_their_groups_with_threads_their_budget_covers() -> None:
    groups = CpuGroups("hsdp-0-1-2", (4.0, 0.5), root="/cg")
    agents = [AgentSpec(("python", "-m", "agent", str(i)), {"OMP_NUM_THREADS": "3"}, f"node {i}") for i in range(2)]
    wrapped = emulated.in_cpu_groups(agents, groups, nproc_per_node=1)
    assert wrapped[1].command[1:] == ("-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', "/cg/hsdp-0-1-2-n1",
                                      "python", "-m", "agent", "1")
    assert [a.env["OMP_NUM_THREADS"] for a in wrapped] == ["3", "1"]  # capped at the budget, never raised
    kept = emulated.in_cpu_groups(agents, groups, 1, env={"OMP_NUM_THREADS": "3"})  # the user's choice stays
    assert [a.env["OMP_NUM_THREADS"] for a in kept] == ["3", "3"]
    assert emulated.in_cpu_groups(agents, None, 1) == agents


def test_the_reaper_still_imports_only_the_standard_library() -> None:
    import ast

    from hsdp.tools.launch import reaper

    tree = ast.parse(Path(reaper.__file__).read_text())
    nodes = list(ast.walk(tree))
    names = {alias.name.split(".")[0] for node in nodes if isinstance(node, ast.Import) for alias in node.names}
    names |= {node.module.split(".")[0] for node in nodes if isinstance(node, ast.ImportFrom) and node.module}
    assert names - {"__future__"} <= sys.stdlib_module_names, names - sys.stdlib_module_names
