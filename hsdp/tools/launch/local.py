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
import select
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


@dataclass(frozen=True)
class Service:
    """A started process the agents rely on (the elastic coordinator): see :func:`start_service`."""

    proc: subprocess.Popen[bytes]
    label: str


def start_service(spec: AgentSpec, ready: str, timeout_s: float, sink: IO[str] | None = None) -> tuple[Service, str]:
    """Start ``spec`` and wait until it prints a line starting with ``ready``; the service and that line.

    The lines before it (and it) are copied to ``sink`` (default: stdout) with the label. No thread is
    started (the agents are forked later, and forking must not meet another thread's locks): the pipe is
    read a byte at a time, so nothing after the line is taken from the pump that reads on later.
    ``RuntimeError`` with the service's output when it exits or stays silent for ``timeout_s`` first."""
    sink = sink or sys.stdout
    proc = _spawn(spec)
    try:
        return _wait_ready(proc, spec.label, ready, timeout_s, sink)
    except BaseException:  # Ctrl-C included: the service must not outlive a launcher that gives up on it
        _signal_groups([proc], signal.SIGKILL)
        proc.wait()
        raise


def _wait_ready(proc: subprocess.Popen[bytes], label: str, ready: str, timeout_s: float,
                sink: IO[str]) -> tuple[Service, str]:
    assert proc.stdout is not None
    fd, line = proc.stdout.fileno(), b""
    seen: list[str] = []
    deadline = time.monotonic() + timeout_s
    while True:
        readable, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        byte = os.read(fd, 1) if readable else b""
        if byte and byte != b"\n":
            line += byte
            continue
        text = line.decode("utf-8", errors="replace")
        if byte:
            sink.write(f"[{label}] {text}\n")
            sink.flush()
            seen.append(text)
            line = b""
            if text.startswith(ready):
                return Service(proc, label), text
            continue
        _signal_groups([proc], signal.SIGKILL)
        proc.wait()
        error = proc.stderr.read().decode("utf-8", errors="replace") if proc.stderr else ""
        said = "\n".join([*seen, text, error]).strip()
        how = "exited" if readable else f"printed no {ready!r} line within {timeout_s:g} s"
        raise RuntimeError(f"{label} {how}: {said or '(no output)'}")


def _spawn(agent: AgentSpec) -> subprocess.Popen[bytes]:
    # Own session: one killpg reaches the process and everything it forked.
    return subprocess.Popen(list(agent.command), env=dict(agent.env), stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)


class Supervisor:
    """Run :class:`AgentSpec` processes together; stop all of them as soon as one fails.

    ``run()`` returns 0 when every process exits 0, else the exit status of the first that failed
    (``128 + signal`` when one was killed by a signal; 130 after Ctrl-C, 143 after SIGTERM).

    ``keep_going``: a failed agent does not stop the others (the nodes of an elastic job, each its own job,
    go on without it); ``run()`` returns once every agent has ended. ``services``: started processes the
    agents need (:func:`start_service`); their output is relayed, they are stopped after the agents, and one
    that fails (exits non-zero) while agents still run fails the run with its status, stopping the agents;
    one that exits 0 has done its part: the agents get ``grace_s`` to end, then are stopped (status 1).
    """

    def __init__(self, agents: Sequence[AgentSpec], *, grace_s: float = DEFAULT_GRACE_S,
                 stdout: IO[str] | None = None, stderr: IO[str] | None = None, keep_going: bool = False,
                 services: Sequence[Service] = ()) -> None:
        self.agents = list(agents)
        self.grace_s = grace_s
        self.keep_going = keep_going
        self.services = list(services)
        self._out = stdout or sys.stdout
        self._err = stderr or sys.stderr
        self._lock = threading.Lock()
        self._procs: list[subprocess.Popen[bytes]] = []
        self._pumps: list[threading.Thread] = []

    def run(self) -> int:
        with handle_signals([signal.SIGTERM], raise_interrupted):
            try:
                self._start()
                return self._wait_for_the_agents()
            except KeyboardInterrupt as e:  # Ctrl-C, or a signal turned into Interrupted
                self._write(self._err, "launcher", "interrupted: stopping every node\n")
                return 128 + (e.signum if isinstance(e, Interrupted) else signal.SIGINT)
            finally:
                self.stop()
                for t in self._pumps:
                    t.join(timeout=5.0)

    def _start(self) -> None:
        for agent in self.agents:
            self._procs.append(_spawn(agent))
        # Readers start after every fork: preexec_fn must not run while other threads hold locks.
        labelled = [*zip([a.label for a in self.agents], self._procs), *((s.label, s.proc) for s in self.services)]
        for label, proc in labelled:
            for stream, sink in ((proc.stdout, self._out), (proc.stderr, self._err)):
                t = threading.Thread(target=self._pump, args=(stream, sink, label), daemon=True)
                t.start()
                self._pumps.append(t)

    def _wait_for_the_agents(self) -> int:
        reported: set[int] = set()  # agents whose failure was reported
        done: set[int] = set()  # services that finished their part (exit status 0)
        first: int | None = None
        deadline: float | None = None  # set when a service finished: the agents must end by then
        while True:
            codes = [p.poll() for p in self._procs]
            for i, (agent, code) in enumerate(zip(self.agents, codes)):
                if code in (None, 0) or i in reported:
                    continue
                reported.add(i)
                first = _exit_code(code) if first is None else first
                if not self.keep_going or len(self.agents) == 1:
                    others = "stopping the others" if len(self.agents) > 1 else "done"
                    self._write(self._err, "launcher", f"{agent.label} exited with status {code}: {others}")
                    return first
                self._write(self._err, "launcher", f"{agent.label} exited with status {code}: the other nodes go on")
            if all(c is not None for c in codes):
                return 0 if first is None else first
            if deadline is not None and time.monotonic() > deadline:
                self._write(self._err, "launcher", f"nodes still running {self.grace_s:g} s after a service "
                                                   f"finished: stopping them")
                return 1 if first is None else first
            for j, service in enumerate(self.services):
                code = service.proc.poll()
                if code is not None and j not in done:
                    done.add(j)
                    if code == 0:  # its work is done (the coordinator: no replica left); the agents are ending
                        self._write(self._err, "launcher", f"{service.label} finished; waiting for the nodes")
                        deadline = time.monotonic() + self.grace_s
                        continue
                    self._write(self._err, "launcher", f"{service.label} exited with status {code} while the nodes "
                                                       f"ran: stopping them")
                    return _exit_code(code)
            time.sleep(_POLL_S)

    def stop(self) -> None:
        """SIGTERM every live agent's process group, then SIGKILL what is left after ``grace_s``; then the
        services alike (the agents may need them until they end)."""
        stop_groups(self._procs, self.grace_s)
        stop_groups([s.proc for s in self.services], self.grace_s)

    def _pump(self, stream: IO[bytes], sink: IO[str], label: str) -> None:
        for raw in iter(stream.readline, b""):
            self._write(sink, label, raw.decode("utf-8", errors="replace"))
        stream.close()

    def _write(self, sink: IO[str], label: str, text: str) -> None:
        line = text if text.endswith("\n") else text + "\n"
        with self._lock:  # whole lines only: the nodes' outputs interleave by line, never inside one
            sink.write(f"[{label}] {line}")
            sink.flush()


def stop_groups(procs: Sequence[subprocess.Popen[bytes]], grace_s: float = DEFAULT_GRACE_S) -> None:
    """SIGTERM the process group of each live process in ``procs`` (each leads its own session), SIGKILL what is
    left after ``grace_s``; return once they are gone.

    torchrun starts each worker in a session of its own, out of its agent's group: a worker that outlives its
    agent is ended by its parent-death signal, except a stopped one (SIGSTOP, a debugger), which holds that
    signal pending forever. So the workers' sessions found at the start are SIGKILLed after the grace too."""
    live = [p for p in procs if p.poll() is None]
    workers = _child_sessions([p.pid for p in live])
    _signal_groups(live, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while live and time.monotonic() < deadline:
        live = [p for p in live if p.poll() is None]
        time.sleep(_POLL_S)
    _signal_groups(live, signal.SIGKILL)
    for pid in workers:
        with contextlib.suppress(ProcessLookupError, PermissionError):  # ended with its agent: nothing left
            os.killpg(pid, signal.SIGKILL)
    for p in live:
        p.wait()


def _child_sessions(parents: Sequence[int]) -> list[int]:
    """The children of ``parents`` that lead a session of their own (torchrun's workers); none without /proc."""
    found = []
    with contextlib.suppress(OSError):
        entries = [e for e in os.listdir("/proc") if e.isdigit()]
        for entry in entries:
            with contextlib.suppress(OSError, ValueError, IndexError):
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, pgrp, session
                pid, ppid, session = int(entry), int(fields[1]), int(fields[3])
                if ppid in parents and session == pid:
                    found.append(pid)
    return found


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
