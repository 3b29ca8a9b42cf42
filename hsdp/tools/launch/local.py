"""Emulate a multi-node job on one machine: one torchrun agent per "node", all on the loopback interface.

torchrun stays the launcher: each agent is torchrun's (``python -m hsdp.tools.launch.agent --nnodes N --node-rank
i ...``, torchrun with an orderly exit, see :mod:`hsdp.tools.launch.agent`) with a static rendezvous at
``127.0.0.1:<free port>``, exactly as on N real machines. This module only starts the agents and supervises
them:

  * every output line is prefixed with ``[node i]`` (pipes read by one thread each);
  * when an agent exits non-zero the others are stopped (SIGTERM to its process group, SIGKILL after a
    grace period), because their ranks would otherwise block in a collective until the timeout;
  * Ctrl-C (or SIGTERM to the launcher) stops every agent and its workers.

:class:`Supervisor` runs any list of commands, so other launchers (e.g. one agent per network namespace)
can reuse it with their own :func:`torchrun_command` wrapping.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import IO, Any

from hsdp.engine.faults.launcher import set_parent_death_signal
from hsdp.engine.faults.signals import handle_signals
from hsdp.tools.launch.layout import NodeLayout

LOOPBACK = "127.0.0.1"
AGENT_MODULE = "hsdp.tools.launch.agent"  # torchrun with an orderly exit; a name only, so torch is not imported
DEFAULT_GRACE_S = 10.0
_POLL_S = 0.1


@dataclass(frozen=True)
class AgentSpec:
    """One supervised process: ``command`` run with exactly ``env``; its output lines get ``label``."""

    command: tuple[str, ...]
    env: Mapping[str, str]
    label: str


# ---------------------------------------------------------------------------------------------------------
# Building the agents' commands and environments (pure functions).
# ---------------------------------------------------------------------------------------------------------
def free_port(host: str = LOOPBACK) -> int:
    """A TCP port that was free a moment ago (the OS picks it; a tiny race with other programs remains)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask, which containers narrow), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def threads_per_rank(total_ranks: int, cpus: int | None = None) -> int:
    """Intra-op threads per rank so the ranks together do not oversubscribe the CPUs."""
    return max(1, (usable_cpus() if cpus is None else cpus) // max(1, total_ranks))


def torchrun_command(nodes: int, node_rank: int, nproc_per_node: int, master_addr: str, master_port: int,
                     script_args: Sequence[str]) -> list[str]:
    """The torchrun agent command of node ``node_rank``, which runs ``nproc_per_node`` ranks (its own count:
    nodes may differ); ``script_args`` is ``script.py ...`` or ``-m module ...``.

    torchrun's own agent behind :mod:`hsdp.tools.launch.agent`, which makes node 0's agent (the store's host)
    exit last, so a successful job does not end with torchrun's exit-barrier traceback."""
    return [
        sys.executable, "-m", AGENT_MODULE,
        "--nnodes", str(nodes), "--node-rank", str(node_rank), "--nproc-per-node", str(nproc_per_node),
        "--master-addr", master_addr, "--master-port", str(master_port),
        *script_args,
    ]


def agent_env(total_ranks: int, label_width: int, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The current environment plus what the workers need behind a line-prefixing pipe; ``extra`` wins."""
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = str(threads_per_rank(total_ranks))
    # Workers write into a pipe: without this their prints arrive in blocks, long after the fact.
    env["PYTHONUNBUFFERED"] = "1"
    if "COLUMNS" not in env and sys.stdout.isatty():
        # Rich sizes tables to COLUMNS when not on a terminal; leave room for the "[node i] " prefix.
        env["COLUMNS"] = str(max(40, shutil.get_terminal_size().columns - label_width - 1))
    env.update(extra or {})
    return env


def _validate(nodes: int, nproc_per_node: int | Sequence[int], script_args: Sequence[str]) -> NodeLayout:
    layout = NodeLayout.of(nproc_per_node, nodes)
    if not script_args:
        raise ValueError("script_args is empty: pass a script and its arguments, or ['-m', 'module', ...]")
    return layout


# ---------------------------------------------------------------------------------------------------------
# Supervising the agents.
# ---------------------------------------------------------------------------------------------------------
def _die_with_parent() -> None:
    # Linux: the agent gets SIGTERM if the launcher dies, even by SIGKILL, so no orphaned job keeps
    # running; torchrun forwards the SIGTERM to its workers.
    set_parent_death_signal(signal.SIGTERM)


def _exit_code(returncode: int) -> int:
    """A shell-style exit status: ``128 + n`` for a process killed by signal ``n``."""
    return 128 - returncode if returncode < 0 else returncode


class Supervisor:
    """Run :class:`AgentSpec` processes together; stop all of them as soon as one fails.

    ``run()`` returns 0 when every process exits 0, else the exit status of the first that failed
    (``128 + signal`` when one was killed by a signal; 130 after Ctrl-C, 143 after SIGTERM).
    """

    def __init__(self, agents: Sequence[AgentSpec], *, grace_s: float = DEFAULT_GRACE_S,
                 stdout: IO[str] | None = None, stderr: IO[str] | None = None) -> None:
        self.agents = list(agents)
        self.grace_s = grace_s
        self._out = stdout or sys.stdout
        self._err = stderr or sys.stderr
        self._lock = threading.Lock()
        self._procs: list[subprocess.Popen[bytes]] = []
        self._pumps: list[threading.Thread] = []

    def run(self) -> int:
        with handle_signals([signal.SIGTERM], raise_interrupted):
            try:
                self._start()
                return self._wait_for_first_failure()
            except KeyboardInterrupt as e:  # Ctrl-C, or a signal turned into Interrupted
                self._write(self._err, "launcher", "interrupted: stopping every node\n")
                return 128 + (e.signum if isinstance(e, Interrupted) else signal.SIGINT)
            finally:
                self.stop()
                for t in self._pumps:
                    t.join(timeout=5.0)

    def _start(self) -> None:
        on_linux = sys.platform.startswith("linux")
        for agent in self.agents:
            # Own session: one killpg reaches the agent and every worker it forked.
            proc = subprocess.Popen(list(agent.command), env=dict(agent.env), stdin=subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                                    preexec_fn=_die_with_parent if on_linux else None)
            self._procs.append(proc)
        # Readers start after every fork: preexec_fn must not run while other threads hold locks.
        for agent, proc in zip(self.agents, self._procs):
            for stream, sink in ((proc.stdout, self._out), (proc.stderr, self._err)):
                t = threading.Thread(target=self._pump, args=(stream, sink, agent.label), daemon=True)
                t.start()
                self._pumps.append(t)

    def _wait_for_first_failure(self) -> int:
        while True:
            codes = [p.poll() for p in self._procs]
            failed = [(a, c) for a, c in zip(self.agents, codes) if c not in (None, 0)]
            if failed:
                agent, code = failed[0]
                others = "stopping the others" if len(self.agents) > 1 else "done"
                self._write(self._err, "launcher", f"{agent.label} exited with status {code}: {others}")
                return _exit_code(code)
            if all(c == 0 for c in codes):
                return 0
            time.sleep(_POLL_S)

    def stop(self) -> None:
        """SIGTERM every live agent's process group, then SIGKILL what is left after ``grace_s``."""
        live = [p for p in self._procs if p.poll() is None]
        _signal_groups(live, signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        while live and time.monotonic() < deadline:
            live = [p for p in live if p.poll() is None]
            time.sleep(_POLL_S)
        _signal_groups(live, signal.SIGKILL)
        for p in live:
            p.wait()

    def _pump(self, stream: IO[bytes], sink: IO[str], label: str) -> None:
        for raw in iter(stream.readline, b""):
            self._write(sink, label, raw.decode("utf-8", errors="replace"))
        stream.close()

    def _write(self, sink: IO[str], label: str, text: str) -> None:
        line = text if text.endswith("\n") else text + "\n"
        with self._lock:  # whole lines only: the nodes' outputs interleave by line, never inside one
            sink.write(f"[{label}] {line}")
            sink.flush()


def _signal_groups(procs: Sequence[subprocess.Popen[bytes]], sig: signal.Signals) -> None:
    for p in procs:
        with contextlib.suppress(ProcessLookupError, PermissionError):  # already gone
            os.killpg(p.pid, sig)


class Interrupted(KeyboardInterrupt):
    """A stop signal arrived (see :func:`raise_interrupted`); ``signum`` says which, for the ``128 + n`` exit
    status. A ``KeyboardInterrupt``, so the code that handles Ctrl-C handles it too."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def raise_interrupted(signum: int, frame: Any) -> None:
    """A signal handler that interrupts the main thread as Ctrl-C does, with :class:`Interrupted`."""
    raise Interrupted(signum)


# ---------------------------------------------------------------------------------------------------------
# The entry point.
# ---------------------------------------------------------------------------------------------------------
def local_agents(nodes: int, nproc_per_node: int | Sequence[int], script_args: Sequence[str],
                 env: Mapping[str, str] | None = None, master_port: int | None = None) -> list[AgentSpec]:
    """The agents of an emulated job of ``nodes`` nodes rendezvousing on the loopback: ``nproc_per_node``
    ranks on each, or ``nproc_per_node[i]`` on node ``i`` (see :class:`~hsdp.tools.launch.layout.NodeLayout`)."""
    layout = _validate(nodes, nproc_per_node, script_args)
    port = free_port() if master_port is None else master_port
    width = len(f"node {nodes - 1}") + 2
    base = {**agent_env(layout.world_size, width, env), **layout.agent_env()}
    return [
        AgentSpec(tuple(torchrun_command(nodes, i, n, LOOPBACK, port, script_args)), base, f"node {i}")
        for i, n in enumerate(layout.nprocs)
    ]


def launch_local(nodes: int, nproc_per_node: int | Sequence[int], script_args: list[str],
                 env: Mapping[str, str] | None = None) -> int:
    """Run ``script_args`` on ``nodes`` emulated nodes of ``nproc_per_node`` ranks each (or one count per
    node); return the exit status (0 on success, else the first failing agent's).

    ``env`` adds variables on top of the current environment (and overrides the defaults set here, e.g.
    ``OMP_NUM_THREADS``, which is the usable CPUs divided by the total number of ranks).
    """
    return Supervisor(local_agents(nodes, nproc_per_node, script_args, env)).run()
