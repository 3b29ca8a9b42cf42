"""``hsdp launch --nproc-per-node 2,1``: nodes of different sizes on one machine.

Two real launches of 2 nodes x (2, 1) ranks, on loopback and in network namespaces (the latter needs root
and iproute2, as in tests/test_launch.py, and skips with the reason otherwise). Each rank only initialises
gloo (no hsdp mesh), all-reduces rank + 1 over the 3 ranks and writes torchrun's variables to a file; the
test asserts the node-major layout (node 0: ranks 0, 1; node 1: rank 2), each rank's LOCAL_WORLD_SIZE and
the reports' per-node counts. The rest needs no process: parsing, the node-count rule, the agents' commands
and environments, the per-node CPU fit, the traffic table and JSON, and usage errors raised before anything
starts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from hsdp.tools.launch import emulated
from hsdp.tools.launch.cpu_groups import CpuGroups
from hsdp.tools.launch.layout import IDENTICAL_WORKERS, NodeLayout, parse_nproc_per_node, resolve_nodes
from hsdp.tools.launch.local import AgentSpec, local_agents, threads_per_rank
from hsdp.tools.launch.netns import ClusterSpec, RunId, Tools, find_tools
from hsdp.tools.launch.traffic import NodeTraffic, TrafficReport, print_report, traffic_table, write_json

ROOT = Path(__file__).resolve().parents[1]
JOB = ("-m", "hsdp.tools.planner.workload")  # an entry point that exists; never started by the unit tests
RUN_TIMEOUT_S = 120
PROBE = """\
import json, os, sys
import torch
import torch.distributed as dist
dist.init_process_group("gloo")
total = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(total)
keys = ("RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "WORLD_SIZE", "GROUP_RANK")
seen = {k: int(os.environ[k]) for k in keys}
seen.update(dist_rank=dist.get_rank(), dist_world=dist.get_world_size(), sum=total.item())
with open(os.path.join(sys.argv[1], f"rank{seen['RANK']}.json"), "w") as f:
    json.dump(seen, f)
dist.destroy_process_group()
"""
# (LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK) of global ranks 0, 1, 2 with 2 ranks on node 0 and 1 on node 1.
EXPECTED = {0: (0, 2, 0), 1: (1, 2, 0), 2: (0, 1, 1)}


# ---------------------------------------------------------------------------------------------------------
# Real launches.
# ---------------------------------------------------------------------------------------------------------
def _launch(tmp_path: Path, launch_args: list[str]) -> tuple[str, dict]:
    script, out, stats = tmp_path / "probe.py", tmp_path / "ranks", tmp_path / "stats.json"
    script.write_text(PROBE)
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    # The equal-nodes shortcut set on purpose: the launcher must turn it off, or the ranks overlap.
    env[IDENTICAL_WORKERS] = "1"
    cmd = [sys.executable, "-m", "hsdp", "launch", *launch_args, "--stats-json", str(stats), "--", str(script),
           str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=RUN_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout
    seen = {int(p.stem.removeprefix("rank")): json.loads(p.read_text()) for p in out.glob("rank*.json")}
    assert sorted(seen) == [0, 1, 2], proc.stdout
    for rank, s in seen.items():
        assert (s["LOCAL_RANK"], s["LOCAL_WORLD_SIZE"], s["GROUP_RANK"]) == EXPECTED[rank], (rank, s)
        assert (s["RANK"], s["dist_rank"], s["WORLD_SIZE"], s["dist_world"]) == (rank, rank, 3, 3), s
        assert s["sum"] == 1 + 2 + 3, s  # the all-reduce spans both nodes
    report = json.loads(stats.read_text())
    assert (report["num_nodes"], report["nproc_per_node"], report["world_size"]) == (2, [2, 1], 3), report
    return proc.stdout, report


def test_two_nodes_of_two_and_one_ranks_on_loopback(tmp_path: Path) -> None:
    output, report = _launch(tmp_path, ["--nodes", "2", "--nproc-per-node", "2,1", "--no-emulation"])
    assert report["emulated"] is False and report["nodes"] == []
    assert "ranks per node: node 0: ranks 0-1, node 1: rank 2" in output, output
    # The launcher's loopback path (a node per torchrun agent, no namespaces): asked for, so it warns of nothing.
    assert "warning" not in output.lower(), output


def test_two_nodes_of_two_and_one_ranks_in_namespaces(tmp_path: Path) -> None:
    if os.geteuid() != 0 or find_tools() is None:
        pytest.skip("network emulation needs root and iproute2 (`ip` and `tc`)")
    # No --nodes: the list's length is the node count.
    output, report = _launch(tmp_path, ["--nproc-per-node", "2,1", "--require-emulation"])
    assert report["emulated"] is True and [n["node"] for n in report["nodes"]] == [0, 1], report
    assert all(n["sent_bytes"] > 0 and n["received_bytes"] > 0 for n in report["nodes"]), report
    rows = [line.split("│")[1:3] for line in output.splitlines() if line.count("│") >= 7]
    assert [[c.strip() for c in r] for r in rows] == [["0", "0-1"], ["1", "2"], ["total", "3"]], output


# ---------------------------------------------------------------------------------------------------------
# Parsing and the node-count rule.
# ---------------------------------------------------------------------------------------------------------
def test_parse_nproc_per_node_reads_one_count_or_one_per_node() -> None:
    assert parse_nproc_per_node("2") == 2
    assert parse_nproc_per_node("4,2") == (4, 2) and parse_nproc_per_node(" 4, 2 ") == (4, 2)
    assert parse_nproc_per_node("2,2") == (2, 2)
    for bad, says in [("0", "0 ranks on a node"), ("2,-1", "-1 ranks on a node"), ("two", "whole number"),
                      ("1.5", "whole number"), ("2,", "whole number"), ("", "whole number")]:
        with pytest.raises(ValueError, match=says):
            parse_nproc_per_node(bad)


def test_a_list_sets_the_node_count_and_nodes_must_agree_with_it() -> None:
    assert resolve_nodes(None, 3) == 2 and resolve_nodes(4, 3) == 4  # one count: as before
    assert resolve_nodes(None, (4, 2, 2)) == 3 and resolve_nodes(2, (4, 2)) == 2
    with pytest.raises(ValueError, match=r"gives 2 counts but --nodes is 3.*drop --nodes"):
        resolve_nodes(3, (2, 1))


def test_node_layout_numbers_ranks_node_major() -> None:
    layout = NodeLayout((4, 2))
    assert (layout.nodes, layout.world_size, layout.uniform) == (2, 6, False)
    assert [list(layout.ranks(i)) for i in range(2)] == [[0, 1, 2, 3], [4, 5]]
    assert layout.nproc_per_node == (4, 2) and NodeLayout.of(2, 3).nproc_per_node == 2
    assert NodeLayout.of((2, 2), 2).nproc_per_node == 2  # a uniform list reads as its count
    assert layout.describe() == "node 0: ranks 0-3, node 1: ranks 4-5" and NodeLayout((1,)).rank_span(0) == "0"
    assert layout.agent_env() == {IDENTICAL_WORKERS: "0"} and NodeLayout.of(2, 2).agent_env() == {}
    for bad, nodes, says in [((2, 1), 3, "2 counts for 3 nodes"), ((2, 0), 2, "node 1 has 0 ranks"),
                             ((2, True), 2, "node 1 has True ranks"), (0, 2, "node 0 has 0 ranks"),
                             (2.0, 2, "whole number"), ((1.5, 1), 2, "node 0 has 1.5"), (1, 0, "at least 1 node")]:
        with pytest.raises(ValueError, match=says):
            NodeLayout.of(bad, nodes)


# ---------------------------------------------------------------------------------------------------------
# The command line: a plan, or a usage error before anything starts.
# ---------------------------------------------------------------------------------------------------------
def test_the_cli_passes_the_counts_and_refuses_bad_ones_before_starting(monkeypatch: pytest.MonkeyPatch,
                                                                        capsys: pytest.CaptureFixture) -> None:
    from hsdp.apps.cli import main

    started: list[emulated.LaunchOptions] = []
    monkeypatch.setattr("hsdp.tools.launch.emulated.launch", lambda options: started.append(options) or 0)
    for args in (["--nproc-per-node", "4,2"], ["--nodes", "2", "--nproc-per-node", "4,2"], ["--nproc-per-node", "3"],
                 []):
        assert main(["launch", *args, "--", *JOB]) == 0, capsys.readouterr().err
    assert [(o.nodes, o.nproc_per_node) for o in started] == [(2, (4, 2)), (2, (4, 2)), (2, 3), (2, 1)]
    assert started[0].layout.world_size == 6
    for args, says in [(["--nodes", "3", "--nproc-per-node", "2,1"], "gives 2 counts but --nodes is 3"),
                       (["--nproc-per-node", "2,0"], "0 ranks on a node"),
                       (["--nproc-per-node", "-1"], "-1 ranks on a node"),
                       (["--nproc-per-node", "two"], "give a whole number of ranks per node"),
                       (["--nproc-per-node", "1.5,1"], "give a whole number of ranks per node")]:
        assert main(["launch", *args, "--", *JOB]) == 2, args
        err = capsys.readouterr().err
        assert says in err and "usage: hsdp launch" in err, (args, err)
    assert len(started) == 4  # nothing was started for the bad ones


def test_launch_options_store_a_list_as_a_tuple_and_check_its_length() -> None:
    options = emulated.LaunchOptions(JOB, nodes=2, nproc_per_node=[2, 1], no_emulation=True)  # type: ignore[arg-type]
    assert options.nproc_per_node == (2, 1) and options.layout.nprocs == (2, 1)
    hash(options)
    with pytest.raises(ValueError, match="3 counts for 2 nodes"):
        emulated.LaunchOptions(JOB, nodes=2, nproc_per_node=(2, 1, 1))


# ---------------------------------------------------------------------------------------------------------
# Agents: each node's torchrun gets its own count.
# ---------------------------------------------------------------------------------------------------------
def _flag(command: tuple[str, ...], name: str) -> str:
    return command[command.index(name) + 1]


def test_each_agent_gets_its_own_nproc_per_node_and_threads_for_the_whole_world() -> None:
    agents = local_agents(2, (2, 1), ["train.py"], master_port=29999)
    assert [_flag(a.command, "--nproc-per-node") for a in agents] == ["2", "1"]
    assert [_flag(a.command, "--node-rank") for a in agents] == ["0", "1"]
    assert all(_flag(a.command, "--nnodes") == "2" for a in agents)
    assert all(a.env["OMP_NUM_THREADS"] == str(threads_per_rank(3)) for a in agents)
    assert all(a.env[IDENTICAL_WORKERS] == "0" for a in agents)
    uniform = local_agents(2, 2, ["train.py"], master_port=29999)
    assert [_flag(a.command, "--nproc-per-node") for a in uniform] == ["2", "2"]
    assert uniform[0].env.get(IDENTICAL_WORKERS) == os.environ.get(IDENTICAL_WORKERS)  # left as it was
    with pytest.raises(ValueError, match="2 counts for 3 nodes"):
        local_agents(3, (2, 1), ["train.py"])


def test_namespace_agents_run_each_nodes_count_inside_its_namespace() -> None:
    spec = ClusterSpec(2, 10**9, 0.0, RunId(7, 4711, 1))
    agents = emulated.namespace_agents(Tools("/sbin/ip", "/sbin/tc"), spec, (1, 3), ["train.py"])
    assert [a.command[:4] for a in agents] == [("/sbin/ip", "netns", "exec", spec.node(i).namespace) for i in (0, 1)]
    assert [_flag(a.command, "--nproc-per-node") for a in agents] == ["1", "3"]
    assert [a.env["GLOO_SOCKET_IFNAME"] for a in agents] == ["hsdp-n0", "hsdp-n1"]
    assert all(a.env[IDENTICAL_WORKERS] == "0" for a in agents)


def test_a_nodes_cpu_budget_is_split_over_its_own_ranks() -> None:
    groups = CpuGroups("hsdp-0-1-2", (4.0, 2.0), root="/cg")
    agents = [AgentSpec(("agent", str(i)), {"OMP_NUM_THREADS": "8"}, f"node {i}") for i in range(2)]
    assert [a.env["OMP_NUM_THREADS"] for a in emulated.in_cpu_groups(agents, groups, (4, 1))] == ["1", "2"]
    assert [a.env["OMP_NUM_THREADS"] for a in emulated.in_cpu_groups(agents, groups, 2)] == ["2", "1"]


# ---------------------------------------------------------------------------------------------------------
# The report: per-node ranks in the table, JSON as before for uniform nodes.
# ---------------------------------------------------------------------------------------------------------
def _report(nproc_per_node: int | tuple[int, ...]) -> TrafficReport:
    nodes = tuple(NodeTraffic(i, f"10.213.0.{i + 1}", f"hsdp-n{i}", 100 * (i + 1), 50) for i in range(2))
    return TrafficReport(True, 2, nproc_per_node, 0, 1.0, 10**9, 0.0, False, nodes)


def test_the_table_names_each_nodes_ranks_and_the_json_keeps_uniform_counts_a_number(tmp_path: Path) -> None:
    console = Console(record=True, width=160)
    console.print(traffic_table(_report((4, 2))))
    rows = [[c.strip() for c in line.split("│")[1:3]] for line in console.export_text().splitlines()
            if line.count("│") >= 7]
    assert rows == [["0", "0-3"], ["1", "4-5"], ["total", "6"]], console.export_text()
    for counts, expected, world in [((4, 2), [4, 2], 6), (2, 2, 4)]:
        write_json(_report(counts), tmp_path / "stats.json")
        data = json.loads((tmp_path / "stats.json").read_text())
        assert (data["nproc_per_node"], data["world_size"], data["total_inter_node_bytes"]) == (expected, world, 300)
    loopback = Console(record=True, width=160)
    print_report(TrafficReport(False, 2, 2, 0, 1.0), loopback)
    assert "ranks per node" not in loopback.export_text()  # uniform: the output is as before
