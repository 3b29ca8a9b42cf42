"""Per-node CPU budgets for ``hsdp launch --node-cpus``: one cgroup v1 ``cpu`` group per emulated node.

A node's torchrun agent is moved into its group before it starts anything (its command is wrapped in
``sh -c 'echo $$ > <group>/cgroup.procs && exec ...'``), so the agent, every rank it forks and every thread
of those (gloo's included) share the node's budget: ``cpu.cfs_quota_us = cpus * cpu.cfs_period_us`` of CPU
time per 100 ms period, a hard cap: a node at 0.5 never runs faster than half a CPU.

A cap alone is not a budget on a busy machine: a node at 1.0 competing with other busy processes gets a fair
share of a core, maybe a third, and a "fast" node is then no faster than a slow one. So each group also
weighs :data:`WEIGHT_PER_CPU` per budgeted CPU in the scheduler (``cpu.shares``; a plain process weighs
1024): while the budgets sum to at most the machine's CPUs, every node gets close to its budget whatever else
runs, and the other processes share what is left. Budgets summing to more contend beyond their caps.

Groups are named after the run (``<run>-n<i>``, the names of :class:`hsdp.tools.launch.netns.RunId`) and
sit directly under the controller's root, so a leftover is recognisable from its name alone, as the
namespaces are. A loopback run (no namespaces) uses the subnet index 0 in its name; no namespace carries
it. Removal (:func:`hsdp.tools.launch.reaper.remove_cpu_groups`) lives in the standard-library-only reaper,
which also removes them after a SIGKILLed launcher.
"""

from __future__ import annotations

import math
import os
import shutil
from collections.abc import Sequence

from hsdp.tools.launch.netns import RunId, process_start_ticks
from hsdp.tools.launch.reaper import list_cpu_groups, remove_cpu_groups

CPU_ROOT = "/sys/fs/cgroup/cpu"
PERIOD_US = 100_000  # the kernel's default period: throttling granularity of 100 ms
MIN_QUOTA_US = 1_000  # the kernel refuses smaller quotas
WEIGHT_PER_CPU = 16 * 1024  # cpu.shares per budgeted CPU: 16 busy plain processes' worth (see the docstring)
MAX_SHARES = 262_144  # the kernel's largest cpu.shares
_ENTER = 'echo $$ > "$0/cgroup.procs" && exec "$@"'  # $$ is the shell, which then becomes the command


class CpuGroupError(RuntimeError):
    """Creating or configuring a node's cpu group failed; the message names the file and the error."""


def parse_node_cpus(text: str) -> tuple[float, ...]:
    """``"1.0,0.5"`` -> ``(1.0, 0.5)``; ``ValueError`` naming the fix for anything but comma-separated numbers."""
    try:
        return tuple(float(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"--node-cpus {text!r}: give one CPU count per node, comma-separated (e.g. 1.0,0.5), "
                         f"or one for every node (e.g. 0.5)") from None


def node_budgets(cpus: Sequence[float], nodes: int, cpu_count: int | None = None) -> tuple[float, ...]:
    """One CPU budget per node: ``cpus`` itself (``nodes`` values) or its single value repeated.

    ``ValueError`` naming the fix for another count, a value that is not finite and positive, below the
    kernel's smallest quota (0.01 CPU) or above ``cpu_count`` (default: ``os.cpu_count()``)."""
    values = tuple(float(c) for c in cpus)
    if len(values) not in (1, nodes):
        raise ValueError(f"node_cpus has {len(values)} values for {nodes} nodes: give one per node or a "
                         f"single value for all of them")
    limit = cpu_count if cpu_count is not None else (os.cpu_count() or 1)
    for i, c in enumerate(values):
        if not math.isfinite(c) or c <= 0:
            raise ValueError(f"node_cpus[{i}]={c}: a CPU budget must be a finite, positive number of CPUs")
        if c * PERIOD_US < MIN_QUOTA_US:
            raise ValueError(f"node_cpus[{i}]={c}: the smallest budget the kernel enforces is "
                             f"{MIN_QUOTA_US / PERIOD_US} CPU")
        if c > limit:
            raise ValueError(f"node_cpus[{i}]={c}: this machine has {limit} CPUs; give at most {limit}")
    return values * nodes if len(values) == 1 else values


def controller_problem(root: str | None = None) -> str | None:
    """Why per-node CPU budgets cannot be set here (under ``root``, default :data:`CPU_ROOT`), naming what is
    needed (``None``: they can)."""
    root = root or CPU_ROOT
    needs = (f"--node-cpus needs the cgroup v1 cpu controller mounted and writable at {root} "
             f"(run as root, e.g. a privileged container)")
    if not os.path.isfile(os.path.join(root, "cpu.cfs_quota_us")):
        return f"{needs}; it is not mounted there (a cgroup v2-only system has no such directory)"
    if not os.access(root, os.W_OK):
        return f"{needs}; {root} is not writable by this user" + (" (not root)" if os.geteuid() != 0 else "")
    return None


def quota_us(cpus: float) -> int:
    """``cpu.cfs_quota_us`` for a budget of ``cpus`` CPUs per :data:`PERIOD_US`."""
    return max(MIN_QUOTA_US, round(cpus * PERIOD_US))


def shares(cpus: float) -> int:
    """``cpu.shares`` of a node budgeted ``cpus`` CPUs (at least the kernel's minimum of 2)."""
    return min(MAX_SHARES, max(2, round(cpus * WEIGHT_PER_CPU)))


def loopback_run() -> RunId:
    """The name owner of a run without namespaces: this launcher (PID and start time), subnet index 0."""
    pid = os.getpid()
    return RunId(0, pid, process_start_ticks(pid) or 0)


class CpuGroups:
    """The cpu groups of one run: ``create()`` makes one per budget, ``wrap(i, command)`` starts a command
    in node ``i``'s group, ``teardown()`` stops what is left in them and removes them (idempotent, also after
    a partial ``create()``)."""

    def __init__(self, run_name: str, budgets: Sequence[float], root: str | None = None) -> None:
        self.run_name = run_name
        self.budgets = tuple(budgets)
        self.root = root or CPU_ROOT

    def path(self, node: int) -> str:
        """Node ``node``'s group directory."""
        return os.path.join(self.root, f"{self.run_name}-n{node}")

    def create(self) -> None:
        """One group per node with its quota; :class:`CpuGroupError` on any failure (the caller tears down)."""
        for i, cpus in enumerate(self.budgets):
            path = self.path(i)
            try:
                os.mkdir(path)
            except OSError as e:
                raise CpuGroupError(f"cannot create the cpu group of node {i} ({path}): {e}") from e
            self._write(path, "cpu.cfs_period_us", PERIOD_US)
            self._write(path, "cpu.cfs_quota_us", quota_us(cpus))
            self._write(path, "cpu.shares", shares(cpus))

    @staticmethod
    def _write(path: str, name: str, value: int) -> None:
        try:
            with open(os.path.join(path, name), "w") as f:
                f.write(f"{value}\n")
        except OSError as e:
            raise CpuGroupError(f"cannot write {value} to {os.path.join(path, name)}: {e}") from e

    def wrap(self, node: int, command: Sequence[str]) -> tuple[str, ...]:
        """``command`` run inside node ``node``'s group from its first instruction (same PID: ``exec``)."""
        return (shutil.which("sh") or "/bin/sh", "-c", _ENTER, self.path(node), *command)

    def teardown(self) -> list[str]:
        """Stop the processes still in the run's groups and remove the groups; the names removed."""
        return remove_cpu_groups(self.root, self.run_name)


def cleanup_leftover_groups(root: str | None = None) -> list[str]:
    """Remove the cpu groups (and the processes in them) of every run whose launcher is gone; runs whose
    launcher is alive are left alone. Returns the group names removed."""
    root = root or CPU_ROOT
    dead = {run for run in map(RunId.from_namespace, list_cpu_groups(root)) if run and not run.owner_alive()}
    return [name for run in sorted(dead, key=lambda r: r.name) for name in remove_cpu_groups(root, run.name)]
