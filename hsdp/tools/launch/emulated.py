"""``hsdp launch``: run a torchrun job on an emulated cluster of network namespaces, or on loopback.

With root and iproute2 (``ip``, ``tc``), every node is a network namespace behind a rate-limited link
(:mod:`hsdp.tools.launch.netns`) and runs one torchrun agent (``ip netns exec <ns> python -m
hsdp.tools.launch.agent ...``, see :func:`hsdp.tools.launch.local.torchrun_command`) with node 0's address as
the rendezvous. Without them the nodes fall back to plain local processes on loopback
(:func:`hsdp.tools.launch.local.local_agents`) after a one-line warning, unless emulation is required.
With ``node_cpus`` (``--node-cpus``), each node's agent and ranks also run in a cpu cgroup of their own
(:mod:`hsdp.tools.launch.cpu_groups`): a slow node, on one machine, in either mode.

Cleanup is layered so that no namespace, link, cpu group or process outlives the run:

  * success, a failing rank, Ctrl-C, SIGTERM/SIGHUP: :class:`~hsdp.tools.launch.local.Supervisor` stops the agents,
    then ``finally`` tears the namespaces and cpu groups down (with those signals ignored, so a second Ctrl-C
    cannot cut the teardown short), stopping any worker an agent left behind;
  * SIGKILL of the launcher: the agents get SIGTERM from the kernel (parent-death signal) and the
    :class:`~hsdp.tools.launch.reaper.Reaper` removes the namespaces and cpu groups;
  * anything else (a crashed machine): ``hsdp launch --cleanup``.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hsdp.engine.faults.signals import handle_signals
from hsdp.tools.launch import cpu_groups
from hsdp.tools.launch.cpu_groups import CpuGroupError, CpuGroups, cleanup_leftover_groups, loopback_run
from hsdp.tools.launch.elastic import ElasticOptions, NodePlace, loopback_places, namespace_places, run_elastic
from hsdp.tools.launch.entry import missing_entry_point
from hsdp.tools.launch.layout import NodeLayout
from hsdp.tools.launch.local import (
    AgentSpec,
    Interrupted,
    Supervisor,
    agent_env,
    local_agents,
    raise_interrupted,
    torchrun_command,
)
from hsdp.tools.launch.netns import (
    PREFIX,
    ClusterSpec,
    EmulatedCluster,
    NetnsError,
    Tools,
    allocated_run,
    cleanup_leftovers,
    find_tools,
)
from hsdp.tools.launch.reaper import Reaper
from hsdp.tools.launch.shaping import ShapingError, netem_missing_note
from hsdp.tools.launch.traffic import TrafficReport, node_traffic, print_report, write_json
from hsdp.tools.quantities import parse_duration, parse_tc_rate

MASTER_PORT = 29500  # node 0's namespace is fresh: no other program can hold a port there
USAGE_ERROR = 2  # emulation required but unavailable: the exit status of a command-line error
MAX_NODES = 250  # one /24 holds the node addresses
_RANK_PREFIX = "[rank${rank}]: "
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@dataclass(frozen=True)
class LaunchOptions:
    """One ``hsdp launch``: ``nodes`` nodes of ``nproc_per_node`` ranks each, or of ``nproc_per_node[i]``
    ranks on node ``i`` (a tuple of exactly ``nodes`` counts: a heterogeneous cluster, see
    :mod:`hsdp.tools.launch.layout`), running ``script_args`` (``script.py ...`` or ``-m module ...``)
    behind links of ``bandwidth`` (bits or bytes per second, e.g. ``"1gbit"``, ``"1GB/s"``) and ``latency``
    (one-way node-to-node delay, e.g. ``"1ms"``; ``"0"`` for none). ``env`` adds variables for every rank.

    ``no_emulation`` runs on loopback on purpose (a baseline; no warning), ``require_emulation`` makes the
    loopback fallback an error.

    ``node_cpus`` caps each node's agent and ranks at that many CPUs (floats; one value for every node, or
    one per node), in a cgroup v1 cpu group per node; it is stored as one value per node. A hard cap, and a
    scheduler weight that keeps each node near its budget against other busy processes while the budgets
    sum to at most the machine's CPUs (see :mod:`hsdp.tools.launch.cpu_groups`).

    ``elastic``: every node is one replica of an elastic job, its own torchrun job restarted on failure, all
    meeting on a coordinator this launch runs (:mod:`hsdp.tools.launch.elastic`).

    ``ValueError`` on construction for an empty or missing script or module, bad counts, rates, durations or
    CPU budgets, both of those flags, or ``node_cpus`` where the cgroup v1 cpu controller is not writable."""

    script_args: tuple[str, ...]
    nodes: int = 2
    nproc_per_node: int | tuple[int, ...] = 1
    bandwidth: str = "1gbit"
    latency: str = "0"
    require_emulation: bool = False
    no_emulation: bool = False
    stats_json: str | None = None
    env: Mapping[str, str] | None = None
    node_cpus: tuple[float, ...] | None = None
    elastic: ElasticOptions | None = None

    def __post_init__(self) -> None:
        # Checked here, before anything is created: a typo must not cost a cluster setup and teardown.
        if not self.script_args:
            raise ValueError("nothing to run: pass a script and its arguments after `--`")
        if not 1 <= self.nodes <= MAX_NODES:
            raise ValueError(f"nodes={self.nodes} must be in 1..{MAX_NODES}")
        layout = NodeLayout.of(self.nproc_per_node, self.nodes)  # a bad count, a list of the wrong length
        if self.elastic is not None:
            self.elastic.check(layout)  # replicas of one degree, a reachable minimum
        if not isinstance(self.nproc_per_node, int):  # a list given: stored as a tuple, hashable as the rest
            object.__setattr__(self, "nproc_per_node", layout.nprocs)
        if self.require_emulation and self.no_emulation:
            raise ValueError("require_emulation and no_emulation contradict each other")
        parse_tc_rate(self.bandwidth)
        parse_duration(self.latency)
        missing = missing_entry_point(self.script_args, self.env)
        if missing:
            raise ValueError(missing)
        if self.node_cpus is not None:
            object.__setattr__(self, "node_cpus", cpu_groups.node_budgets(self.node_cpus, self.nodes))
            problem = cpu_groups.controller_problem()
            if problem:
                raise ValueError(problem)

    @property
    def layout(self) -> NodeLayout:
        """The ranks of each node."""
        return NodeLayout.of(self.nproc_per_node, self.nodes)


def _warn(message: str) -> None:
    print(f"hsdp launch: {message}", file=sys.stderr, flush=True)


def unavailable_reason(tools: Tools | None) -> str | None:
    """Why the network cannot be emulated here (``None``: it can)."""
    if os.geteuid() != 0:
        return "not running as root (network namespaces and tc need it)"
    if tools is None:
        return "`ip` or `tc` (iproute2) not found on PATH"
    return None


def torchrun_flags(log_dir: str) -> list[str]:
    """torchrun options placed before the script: tee each rank's output to the console, where torchrun
    prefixes every line with the global rank (the prefix template travels in the environment)."""
    return ["--tee", "3", "--log-dir", log_dir]


def rank_prefix_env() -> dict[str, str]:
    """Environment that makes torchrun prefix each output line with ``[rank<global rank>]:``."""
    return {"TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": _RANK_PREFIX}


def namespace_agents(tools: Tools, spec: ClusterSpec, nproc_per_node: int | Sequence[int],
                     script_args: Sequence[str], env: Mapping[str, str] | None = None) -> list[AgentSpec]:
    """One torchrun agent per node, started inside the node's namespace and bound to its link, running
    ``nproc_per_node`` ranks (or ``nproc_per_node[i]`` on node ``i``)."""
    layout = NodeLayout.of(nproc_per_node, spec.nodes)
    width = len(f"node {spec.nodes - 1}") + 2
    base = {**agent_env(layout.world_size, width, {**(env or {}), **rank_prefix_env()}), **layout.agent_env()}
    agents = []
    for i, n in enumerate(layout.nprocs):
        node = spec.node(i)
        torchrun = torchrun_command(spec.nodes, i, n, spec.master_addr, MASTER_PORT, script_args)
        agents.append(AgentSpec((tools.ip, "netns", "exec", node.namespace, *torchrun),
                                {**base, **node.env()}, f"node {i}"))
    return agents


def in_cpu_groups(agents: Sequence[AgentSpec], groups: CpuGroups | None, nproc_per_node: int | Sequence[int],
                  env: Mapping[str, str] | None = None) -> list[AgentSpec]:
    """Each node's agent started inside its cpu group (unchanged without ``groups``), with no more intra-op
    threads per rank than its node's budget covers for its own rank count (``nproc_per_node``, or
    ``nproc_per_node[i]`` for node ``i``), unless ``env`` sets ``OMP_NUM_THREADS``: a real slow node has
    fewer cores, not the same threads sliced thinner."""
    if groups is None:
        return list(agents)
    nprocs = NodeLayout.of(nproc_per_node, len(agents)).nprocs
    wrapped = []
    for i, agent in enumerate(agents):
        threads = dict(agent.env)
        if "OMP_NUM_THREADS" not in (env or {}):
            fit = max(1, int(groups.budgets[i] // nprocs[i]))
            threads["OMP_NUM_THREADS"] = str(min(int(threads.get("OMP_NUM_THREADS", fit)), fit))
        wrapped.append(AgentSpec(groups.wrap(i, agent.command), threads, agent.label))
    return wrapped


def _create_cpu_groups(options: LaunchOptions, run_name: str, parts: dict[str, Any]) -> CpuGroups | None:
    if options.node_cpus is None:
        return None
    groups = parts["cpu"] = CpuGroups(run_name, options.node_cpus)  # recorded first: a partial create is undone
    groups.create()
    return groups


# ---------------------------------------------------------------------------------------------------------
# The two ways to run.
# ---------------------------------------------------------------------------------------------------------
def _run_agents(agents: list[AgentSpec]) -> tuple[int, float]:
    started = time.monotonic()
    code = Supervisor(agents).run()
    return code, time.monotonic() - started


def _run_elastic(options: LaunchOptions, places: list[NodePlace], script: list[str], env: dict[str, str],
                 groups: CpuGroups | None) -> tuple[int, float]:
    assert options.elastic is not None
    started = time.monotonic()
    code = run_elastic(places, options.layout, script, options.elastic, env,
                       lambda agents: in_cpu_groups(agents, groups, options.nproc_per_node, options.env))
    return code, time.monotonic() - started


def _finish(report: TrafficReport, stats_json: str | None) -> int:
    print_report(report)
    if stats_json:
        write_json(report, stats_json)
    return report.exit_code


def _run_fallback(options: LaunchOptions) -> int:
    parts: dict[str, Any] = {}
    try:
        logs = parts["logs"] = tempfile.mkdtemp(prefix=f"{PREFIX}-logs-")
        groups = None
        if options.node_cpus is not None:
            run = loopback_run()
            # No namespaces to hold the processes: the reaper stops what is left in the groups and removes them.
            parts["reaper"] = Reaper(run.name, None, logs, cpu_groups.CPU_ROOT)
            groups = _create_cpu_groups(options, run.name, parts)
        script = [*torchrun_flags(logs), *options.script_args]
        env = {**(options.env or {}), **rank_prefix_env()}
        if options.elastic is not None:
            code, elapsed = _run_elastic(options, loopback_places(options.nodes), script, env, groups)
        else:
            agents = local_agents(options.nodes, options.nproc_per_node, script, env)
            code, elapsed = _run_agents(in_cpu_groups(agents, groups, options.nproc_per_node, options.env))
    except CpuGroupError as e:
        _warn(f"error: {e}")
        return 1
    finally:
        _tear_down(parts)
    return _finish(TrafficReport(False, options.nodes, options.layout.nproc_per_node, code, elapsed),
                   options.stats_json)


def _set_up(tools: Tools, options: LaunchOptions, bandwidth: int, latency: float,
            parts: dict[str, Any]) -> EmulatedCluster:
    # Everything created is recorded in `parts` at once, so the caller's `finally` can remove it whatever
    # is interrupted where.
    parts["logs"] = tempfile.mkdtemp(prefix=f"{PREFIX}-logs-")
    with allocated_run(tools) as run:
        # The reaper first: from here on even a SIGKILLed launcher leaves nothing behind.
        parts["reaper"] = Reaper(run.name, tools.ip, parts["logs"],
                                 cpu_groups.CPU_ROOT if options.node_cpus is not None else None)
        cluster = parts["cluster"] = EmulatedCluster(tools, ClusterSpec(options.nodes, bandwidth, latency, run))
        cluster.create_switch()  # reserves the subnet: allocations after this lock see it
    cluster.create_nodes()
    _create_cpu_groups(options, cluster.spec.run.name, parts)
    if latency > 0 and not cluster.latency_emulated:
        _warn(netem_missing_note(latency))
    return cluster


def _tear_down(parts: dict[str, Any]) -> None:
    with handle_signals(_STOP_SIGNALS, signal.SIG_IGN):  # a second Ctrl-C must not cut this short
        if "cluster" in parts:
            parts["cluster"].teardown()
        if "cpu" in parts:  # after the namespaces, whose removal stops their processes: the groups are empty
            parts["cpu"].teardown()
        if "reaper" in parts:
            parts["reaper"].release()
        if "logs" in parts:
            shutil.rmtree(parts["logs"], ignore_errors=True)


def _run_job(tools: Tools, cluster: EmulatedCluster, options: LaunchOptions, parts: dict[str, Any]) -> int:
    spec = cluster.spec
    before = cluster.counters()
    script = [*torchrun_flags(parts["logs"]), *options.script_args]
    if options.elastic is not None:
        code, elapsed = _run_elastic(options, namespace_places(tools.ip, spec), script,
                                     {**(options.env or {}), **rank_prefix_env()}, parts.get("cpu"))
    else:
        agents = namespace_agents(tools, spec, options.nproc_per_node, script, options.env)
        code, elapsed = _run_agents(in_cpu_groups(agents, parts.get("cpu"), options.nproc_per_node, options.env))
    report = TrafficReport(True, spec.nodes, options.layout.nproc_per_node, code, elapsed, spec.bandwidth_bit_s,
                           spec.latency_s, cluster.latency_emulated, node_traffic(spec, before, cluster.counters()))
    return _finish(report, options.stats_json)


def _setup_failed(error: Exception, options: LaunchOptions) -> int | None:
    if options.require_emulation:
        _warn(f"error: network emulation required but its setup failed: {error}")
        return USAGE_ERROR
    _warn(f"warning: network emulation failed ({error}); running the nodes as local processes on loopback")
    return None


def _run_emulated(tools: Tools, options: LaunchOptions, bandwidth: int, latency: float) -> int | None:
    """Exit status of the emulated run; ``None`` when the network could not be set up and the caller should
    fall back (whatever was created is removed before this returns, in every case)."""
    parts: dict[str, Any] = {}
    with handle_signals(_STOP_SIGNALS, raise_interrupted):
        try:
            try:
                cluster = _set_up(tools, options, bandwidth, latency, parts)
            except (NetnsError, ShapingError) as e:
                return _setup_failed(e, options)
            except CpuGroupError as e:  # not the network's fault: the loopback would fail alike
                _warn(f"error: {e}")
                return 1
            return _run_job(tools, cluster, options, parts)
        except Interrupted as e:
            _warn("interrupted: removing the emulated cluster")
            return 128 + e.signum
        finally:
            _tear_down(parts)


def launch(options: LaunchOptions) -> int:
    """Run the job; return its exit status (0 when every rank succeeded, else the first failing agent's,
    ``128 + n`` after signal ``n``; 2 when emulation is required but unavailable).

    Prints the per-node inter-node traffic table at the end and, with ``stats_json``, writes it as JSON.
    """
    if options.no_emulation:
        return _run_fallback(options)
    bandwidth, latency = parse_tc_rate(options.bandwidth), parse_duration(options.latency)
    tools = find_tools()
    reason = unavailable_reason(tools)
    if reason is not None:
        if options.require_emulation:
            _warn(f"error: network emulation required but unavailable: {reason}")
            return USAGE_ERROR
        _warn(f"warning: no network emulation ({reason}); running the nodes as local processes on loopback")
        return _run_fallback(options)
    assert tools is not None
    code = _run_emulated(tools, options, bandwidth, latency)
    return _run_fallback(options) if code is None else code


def cleanup() -> int:
    """``hsdp launch --cleanup``: remove what runs whose launcher died left behind (network namespaces, cpu
    groups, the processes in them); print what went."""
    tools = find_tools()
    reason = unavailable_reason(tools)
    groups_problem = cpu_groups.controller_problem()
    if (reason is not None or tools is None) and groups_problem is not None:
        _warn(f"nothing to clean up: {reason}")
        return 0
    removed = cleanup_leftovers(tools) if reason is None and tools is not None else []
    for name in removed:
        print(f"removed network namespace {name}")
    groups = cleanup_leftover_groups() if groups_problem is None else []
    for name in groups:
        print(f"removed cpu group {name}")
    if not removed and not groups:
        print("no leftovers of earlier runs")
    return 0
