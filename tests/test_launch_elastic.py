"""``hsdp launch --elastic`` and ``hsdp coordinator``: one torchrun job per node, a coordinator, restarts.

Without processes: the arguments and what they refuse (an elastic-only flag without --elastic, nodes of
different rank counts, a minimum out of range, bad coordinator input), the command and environment each
node's torchrun gets and the coordinator's command (both parsed back by their own parsers), the address
flowing from the coordinator's printed line into every node, the membership lines and summary.

With small processes (no torch): the supervisor lets the other nodes go on when one fails, and fails the
run when the coordinator dies; a service is ready on its line, or reported with its output.

With torch: the coordinator command on a free port (its address line, a taken port refused, SIGTERM ends it
with a summary and status 0). Real ``hsdp launch --elastic`` runs, a node killed or stopped, restarted by its
torchrun and rejoining, are ``tests/test_elastic.py``'s.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from launched import launch_env

from hsdp.apps.cli import build_parser
from hsdp.apps.cli import launch as launch_cli
from hsdp.engine.replicate.elastic.protocol import Quorum
from hsdp.tools.coordinator.config import CoordinatorConfig
from hsdp.tools.coordinator.events import MembershipLog
from hsdp.tools.launch import elastic
from hsdp.tools.launch.elastic import (
    ElasticOptions,
    coordinator_command,
    elastic_agents,
    loopback_places,
    namespace_places,
    replica_command,
)
from hsdp.tools.launch.emulated import LaunchOptions
from hsdp.tools.launch.layout import NodeLayout
from hsdp.tools.launch.local import AgentSpec, Service, Supervisor, start_service, stop_groups, threads_per_rank
from hsdp.tools.launch.netns import ClusterSpec, RunId

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------------------
# Arguments and refusals (no process).
# ---------------------------------------------------------------------------------------------------------
def _launch_args(*flags: str, script: str = "train.py") -> argparse.Namespace:
    return build_parser().parse_args(["launch", *flags, "--", script])


def test_elastic_flags_parse_with_three_restarts_by_default(tmp_path: Path) -> None:
    args = _launch_args("--elastic", "--nodes", "3", "--nproc-per-node", "2")
    assert launch_cli._elastic(args) == ElasticOptions(max_restarts=3, min_replicas=None)
    assert launch_cli.ELASTIC_RESTARTS == elastic.DEFAULT_RESTARTS
    args = _launch_args("--elastic", "--max-restarts", "0", "--min-replicas", "1", "--heartbeat-timeout", "4.5")
    assert launch_cli._elastic(args) == ElasticOptions(max_restarts=0, min_replicas=1, heartbeat_timeout=4.5)
    assert launch_cli._elastic(_launch_args("--nodes", "2")) is None
    script = tmp_path / "s.py"
    script.write_text("")
    options = LaunchOptions((str(script),), nodes=3, nproc_per_node=(2, 2, 2), elastic=ElasticOptions())
    assert options.layout.nprocs == (2, 2, 2)


@pytest.mark.parametrize(("flags", "message"), [
    (["--max-restarts", "2"], "only apply to an elastic job: add --elastic"),
    (["--min-replicas", "1"], "only apply to an elastic job"),
    (["--heartbeat-timeout", "5"], "--heartbeat-timeout only apply to an elastic job"),
    (["--elastic", "--heartbeat-timeout", "0"], "--heartbeat-timeout 0.0: give a positive number of seconds"),
    (["--elastic", "--nodes", "3", "--min-replicas", "4"], "give a count in 1..3"),
    (["--elastic", "--nodes", "3", "--min-replicas", "0"], "give a count in 1..3"),
    (["--elastic", "--max-restarts", "-1"], "--max-restarts -1: give a whole number, at least 0"),
])
def test_launch_refuses_bad_elastic_input_before_starting_anything(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], message: str) -> None:
    script = tmp_path / "s.py"
    script.write_text("raise SystemExit('must not run')\n")
    args = _launch_args(*flags, script=str(script))
    assert launch_cli.run_launch(args) == 2
    err = capsys.readouterr().err
    assert message in err and "usage: hsdp launch" in err, err


@pytest.mark.parametrize(("flags", "message"), [
    (["--port", "0", "--replicas", "0"], "--replicas 0: an elastic job needs at least 1 replica"),
    (["--port", "0", "--replicas", "3", "--min-replicas", "4"], "--min-replicas 4: give a count in 1..3"),
    (["--port", "70000", "--replicas", "2"], "--port 70000: give a TCP port"),
    (["--port", "0", "--replicas", "2", "--heartbeat-timeout", "0"], "--heartbeat-timeout 0.0: give a positive"),
    (["--port", "0", "--replicas", "2", "--job", "a/b"], "without '/'"),
])
def test_coordinator_refuses_bad_input(capsys: pytest.CaptureFixture[str], flags: list[str], message: str) -> None:
    args = build_parser().parse_args(["coordinator", *flags])
    assert args.func(args) == 2
    assert message in capsys.readouterr().err


def test_coordinator_config_defaults_to_a_majority() -> None:
    assert CoordinatorConfig(port=0, replicas=3).min_replicas == 2
    assert CoordinatorConfig(port=0, replicas=4).min_replicas == 3
    assert CoordinatorConfig(port=0, replicas=1).policy().heartbeat_timeout == 3.0


# ---------------------------------------------------------------------------------------------------------
# What each node and the coordinator run (no process).
# ---------------------------------------------------------------------------------------------------------
def test_every_node_is_its_own_torchrun_job_told_the_coordinator_and_its_id() -> None:
    from torch.distributed.run import parse_args

    layout = NodeLayout.of(2, 3)
    agents = elastic_agents(loopback_places(3), layout, ["--tee", "3", "train.py", "--lr", "1"], "127.0.0.1:4321",
                            ElasticOptions(max_restarts=5, job="j"), {"EXTRA": "1"})
    assert [a.label for a in agents] == ["node 0", "node 1", "node 2"]
    for i, agent in enumerate(agents):
        assert agent.command[:3] == (sys.executable, "-m", "hsdp.tools.launch.agent")
        parsed = parse_args(list(agent.command[3:]))
        assert parsed.standalone and parsed.nnodes == "1" and parsed.nproc_per_node == "2"
        assert parsed.max_restarts == 5 and parsed.local_addr == "127.0.0.1" and parsed.tee == "3"
        assert parsed.training_script == "train.py" and parsed.training_script_args == ["--lr", "1"]
        assert agent.env["HSDP_COORDINATOR"] == "127.0.0.1:4321" and agent.env["HSDP_REPLICA_ID"] == str(i)
        assert agent.env["HSDP_ELASTIC_JOB"] == "j" and agent.env["EXTRA"] == "1"
        assert agent.env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"  # a restart's workers get a fresh store
        assert agent.env["OMP_NUM_THREADS"] == str(threads_per_rank(6))  # all ranks of the machine share it
        assert "GLOO_SOCKET_IFNAME" not in agent.env


def test_in_namespaces_each_node_enters_its_own_and_the_coordinator_sits_on_node_0() -> None:
    spec = ClusterSpec(3, 10**9, 0.0, RunId(7, 1234, 99))
    places = namespace_places("/sbin/ip", spec)
    agents = elastic_agents(places, NodeLayout.of(1, 3), ["train.py"], "10.213.7.1:555", ElasticOptions())
    for i, agent in enumerate(agents):
        node = spec.node(i)
        assert agent.command[:4] == ("/sbin/ip", "netns", "exec", node.namespace)
        assert agent.command[4:7] == (sys.executable, "-m", "hsdp.tools.launch.agent")
        assert agent.env["GLOO_SOCKET_IFNAME"] == node.interface and agent.env["HSDP_REPLICA_ID"] == str(i)
        assert agent.env["HSDP_COORDINATOR"] == "10.213.7.1:555"
    command = coordinator_command(places[0], NodeLayout.of(1, 3), ElasticOptions(min_replicas=1, job="j",
                                                                                   heartbeat_timeout=4.5))
    assert command[:4] == ["/sbin/ip", "netns", "exec", spec.node(0).namespace]
    assert command[4:7] == [sys.executable, "-m", "hsdp"]
    args = build_parser().parse_args(command[7:])
    assert (args.command, args.host, args.port, args.replicas, args.min_replicas, args.job, args.start_grace,
            args.heartbeat_timeout) == ("coordinator", "10.213.7.1", 0, 3, 1, "j", elastic.START_GRACE_S, 4.5)
    assert args.linger == float("inf")  # a node restarted too late to train is told the job completed
    assert args.nproc_per_replica is None  # one rank count: nothing to declare
    # Nodes of different rank counts: replicas of different degrees, each id's count told to the coordinator.
    mixed = build_parser().parse_args(coordinator_command(places[0], NodeLayout.of((2, 1, 1), 3), ElasticOptions())[7:])
    assert (mixed.replicas, mixed.nproc_per_replica) == (3, "2,1,1")
    assert replica_command(2, 0, ["-m", "pkg"])[-2:] == ["-m", "pkg"]


def test_run_elastic_hands_the_printed_address_to_every_node_and_wraps_them(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, object] = {}

    def fake_start(spec: AgentSpec, ready: str, timeout_s: float) -> tuple[Service, str]:
        seen["coordinator"] = spec
        proc = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
        return Service(proc, spec.label), f"{ready}127.0.0.1:777"

    class FakeSupervisor:
        def __init__(self, agents: list[AgentSpec], *, keep_going: bool, services: list[Service]) -> None:
            seen.update(agents=agents, keep_going=keep_going, services=services)

        def run(self) -> int:
            return 7

    monkeypatch.setattr(elastic, "start_service", fake_start)
    monkeypatch.setattr(elastic, "Supervisor", FakeSupervisor)
    wrapped = lambda agents: [AgentSpec(("wrapped", *a.command), a.env, a.label) for a in agents]  # noqa: E731
    code = elastic.run_elastic(loopback_places(2), NodeLayout.of(1, 2), ["t.py"], ElasticOptions(), wrap=wrapped)
    assert code == 7 and seen["keep_going"] is True
    agents = seen["agents"]
    assert isinstance(agents, list) and all(a.command[0] == "wrapped" for a in agents)
    assert [a.env["HSDP_COORDINATOR"] for a in agents] == ["127.0.0.1:777"] * 2
    coordinator = seen["coordinator"]
    assert isinstance(coordinator, AgentSpec) and "--replicas" in coordinator.command


# ---------------------------------------------------------------------------------------------------------
# Membership lines (no process).
# ---------------------------------------------------------------------------------------------------------
def _inc(number: int, degree: int = 2) -> SimpleNamespace:
    return SimpleNamespace(number=number, degree=degree)


def _state(step: int, epoch: int, members: dict, pending: dict | None = None, quorum: Quorum | None = None,
           history: list | None = None, stopped: str = "", refusals: list | None = None, completed: str = "",
           finishers: set | None = None, gone: set | None = None) -> SimpleNamespace:
    return SimpleNamespace(step=step, epoch=epoch, members=members, pending=pending or {}, quorum=quorum,
                           history=history or [], stopped=stopped, refusals=refusals or [], completed=completed,
                           finished={r for r, _ in finishers or ()}, finishers=finishers or set(),
                           gone=gone or set())


def test_membership_log_says_what_changed_and_nothing_else() -> None:
    log = MembershipLog(heartbeat_timeout=3.0, clock=lambda: 0.0)
    text = lambda lines: [line.split(" ", 1)[1] for line in lines]  # noqa: E731 - without the time stamp
    pending = {0: _inc(1), 1: _inc(1), 2: _inc(1)}
    assert text(log.observe(_state(0, -1, {}, pending))) == [
        f"replica {r} registered (incarnation 1, 2 ranks), waiting to be admitted" for r in range(3)]
    three = {0: _inc(1), 1: _inc(1), 2: _inc(1)}
    assert text(log.observe(_state(0, 0, three, quorum=Quorum(0, 0, (0, 1, 2), (1, 1, 1), (1, 2), 0)))) == [
        "step 0, epoch 0: started with replicas [0, 1, 2] (healed from replica 0)"]
    history = [(s, "commit", (0, 1, 2)) for s in range(3)]
    assert log.observe(_state(3, 0, three, quorum=Quorum(3, 0, (0, 1, 2), (1, 1, 1)), history=history)) == []
    history = [*history, (3, "abort", (0, 1, 2))]
    two = {0: _inc(1), 1: _inc(1)}
    assert text(log.observe(_state(4, 1, two, {2: _inc(2)}, Quorum(4, 1, (0, 1), (1, 1)), history))) == [
        "replica 2 registered (incarnation 2, 2 ranks), waiting to be admitted",
        "step 3 discarded (a member failed or went silent during it); replicas [0, 1, 2]",
        "step 4, epoch 1: replica 2 left (no heartbeat for 3 s); replicas [0, 1]"]
    assert text(log.observe(_state(6, 2, {**two, 2: _inc(2)}, quorum=Quorum(6, 2, (0, 1, 2), (1, 1, 2), (2,), 0),
                                   history=history))) == [
        "step 6, epoch 2: replica 2 rejoined (incarnation 2, healed from replica 0); replicas [0, 1, 2]"]
    assert text(log.observe(_state(9, 2, two, {1: _inc(2)}, history=history))) == [
        "replica 1 registered (incarnation 2, 2 ranks), waiting to be admitted"]
    refused = [(1, 2, "replica id 1 of job 'j' is in use by a live replica (incarnation 1): give every ...")]
    assert text(log.observe(_state(9, 2, two, history=history, refusals=refused))) == [
        "replica 1 incarnation 2 refused: replica id 1 of job 'j' is in use by a live replica (incarnation 1)"]
    assert log.observe(_state(9, 2, two, history=history, refusals=refused)) == []  # said once
    assert text(log.observe(_state(9, 2, {0: _inc(1)}, history=history, stopped="1 live replica(s)",
                                   refusals=refused))) == [
        "job stopped at step 9: 1 live replica(s)"]
    summary = log.summary(_state(9, 2, {0: _inc(1)}, history=history, stopped="1 live", refusals=refused), "j",
                          125.0)
    assert "after 2m05s" in summary and "4 (3 committed, 1 discarded)" in summary
    assert "1 join(s), 1 departure(s), 1 refused; last epoch 2" in summary and "stopped at step 9: 1 live" in summary


def test_the_end_names_the_replicas_that_finished_not_one_that_died_beside_them() -> None:
    """Replicas 0 and 2 finish while replica 1 dies in the same pass: the job completed, replica 1 left."""
    log = MembershipLog(heartbeat_timeout=3.0, clock=lambda: 0.0)
    three = {0: _inc(1), 1: _inc(1), 2: _inc(1)}
    log.observe(_state(0, 0, three, quorum=Quorum(0, 0, (0, 1, 2), (1, 1, 1))))
    end = _state(12, 0, {}, completed="done", finishers={(0, 1), (2, 1)}, gone={(1, 1)})
    assert [line.split(" ", 1)[1] for line in log.observe(end)] == [
        "job completed after step 11: replicas 0, 2 finished training"]
    assert "completed after step 11: replicas 0, 2 finished training" in log.summary(end, "j", 60.0)


def test_serve_reports_a_replica_that_came_and_went_and_exits_once_none_is_left() -> None:
    import torch.distributed as dist

    from hsdp.engine.replicate.elastic.client import CoordinatorClient
    from hsdp.engine.replicate.elastic.protocol import ElasticPolicy
    from hsdp.tools.coordinator.service import serve

    lines: list[str] = []
    address = threading.Event()

    class Out:
        def write(self, text: str) -> None:
            lines.extend(text.splitlines())
            address.set() if any(line.startswith("HSDP_COORDINATOR=") for line in lines) else None

        def flush(self) -> None:
            pass

    def replica() -> None:  # one replica of one rank: admitted, commits step 0, dies during step 1
        address.wait(30)
        where = next(line for line in lines if line.startswith("HSDP_COORDINATOR=")).split("=")[1]
        host, port = where.rsplit(":", 1)
        store = dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False)
        client = CoordinatorClient(store, where, "t", 0, 0, ElasticPolicy(heartbeat_interval=0.1,
                                                                            heartbeat_timeout=2.0))
        client.register(1)
        client.ready()  # its model and optimizer are built
        assert client.admitted() == 0 and client.quorum(0).members == (0,)
        client.vote(0, True)
        assert client.decision(0)
        client.want(1)
        client.quorum(1)
        client.close()  # no heartbeat, no vote: dead

    thread = threading.Thread(target=replica, daemon=True)
    thread.start()
    config = CoordinatorConfig(port=0, replicas=1, host="127.0.0.1", job="t", heartbeat_timeout=2.0)
    assert serve(config, out=Out(), linger=0.1) == 0  # no replica left: the job is over
    thread.join(5)
    said = [line.split(" ", 1)[1] for line in lines if line[:2].isdigit()]  # the time-stamped lines
    if said[0].startswith("replica 0 registered"):  # seen waiting for a poll or more (not when admitted at once)
        assert said.pop(0) == "replica 0 registered (incarnation 1, 1 rank), waiting to be admitted"
    assert said[:2] == ["step 0, epoch 0: started with replicas [0]",
                        "step 1 discarded (a member failed or went silent during it); replicas [0]"], "\n".join(lines)
    assert len(said) == 3 and said[2].startswith("job stopped at step 2: "), "\n".join(lines)
    assert "  steps decided: 2 (1 committed, 1 discarded)" in lines, lines


# ---------------------------------------------------------------------------------------------------------
# Supervising (small processes, no torch).
# ---------------------------------------------------------------------------------------------------------
def _python(code: str, label: str) -> AgentSpec:
    return AgentSpec((sys.executable, "-c", code), dict(os.environ), label)


def test_keep_going_lets_the_other_nodes_finish_and_returns_the_failed_status(tmp_path: Path) -> None:
    done = tmp_path / "done"
    agents = [_python("raise SystemExit(3)", "node 0"),
              _python(f"import time; time.sleep(1.0); open({str(done)!r}, 'w').close()", "node 1")]
    out = tmp_path / "out.txt"
    with open(out, "w") as sink:
        assert Supervisor(agents, keep_going=True, stdout=sink, stderr=sink).run() == 3
    assert done.exists(), out.read_text()
    assert "node 0 exited with status 3: the other nodes go on" in out.read_text()


def test_stopping_an_agent_ends_its_stopped_worker_in_a_session_of_its_own(tmp_path: Path) -> None:
    # As torchrun starts a worker: a session of its own, out of the agent's process group; the worker stopped.
    pid_file = tmp_path / "worker.pid"
    worker = "import os, signal; os.kill(os.getpid(), signal.SIGSTOP)"
    agent = (f"import subprocess, sys, time; w = subprocess.Popen([sys.executable, '-c', {worker!r}], "
             f"start_new_session=True); open({str(pid_file)!r}, 'w').write(str(w.pid)); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", agent], start_new_session=True)
    deadline = time.monotonic() + 30
    while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    pid = int(pid_file.read_text())
    while _proc_state(pid) != "T" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _proc_state(pid) == "T"
    stop_groups([proc], grace_s=1.0)
    while _proc_state(pid) not in ("", "Z") and time.monotonic() < deadline:  # a zombie until init reaps it
        time.sleep(0.05)
    assert _proc_state(pid) in ("", "Z"), "the stopped worker outlived its agent"


def _proc_state(pid: int) -> str:
    """A process's state letter (``""``: gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return ""


def test_a_service_is_ready_on_its_line_and_its_failure_stops_the_nodes(tmp_path: Path) -> None:
    out = tmp_path / "out.txt"
    service_code = "print('hello'); print('READY=x:1', flush=True); import time; time.sleep(0.5); exit({})"
    with open(out, "w") as sink:
        service, line = start_service(_python(service_code.format(3), "svc"), "READY=", 30.0, sink)
        assert line == "READY=x:1"
        started = time.monotonic()
        code = Supervisor([_python("import time; time.sleep(60)", "node 0")], keep_going=True, services=[service],
                          stdout=sink, stderr=sink).run()
        assert code == 3 and time.monotonic() - started < 30
        # A service that exits 0 has done its part: the nodes are waited for, not stopped.
        service, _ = start_service(_python(service_code.format(0), "svc"), "READY=", 30.0, sink)
        code = Supervisor([_python("import time; time.sleep(1.5)", "node 0")], keep_going=True, services=[service],
                          stdout=sink, stderr=sink).run()
        assert code == 0
    text = out.read_text()
    assert "[svc] hello" in text and "svc exited with status 3 while the nodes ran: stopping them" in text
    assert "svc finished; waiting for the nodes" in text
    with open(os.devnull, "w") as sink, pytest.raises(RuntimeError, match="svc exited: boom"):
        start_service(_python("import sys; print('boom'); sys.exit(1)", "svc"), "READY=", 30.0, sink)


# ---------------------------------------------------------------------------------------------------------
# Real processes.
# ---------------------------------------------------------------------------------------------------------
def test_the_coordinator_prints_its_address_refuses_a_taken_port_and_ends_cleanly_on_sigterm() -> None:
    command = [sys.executable, "-m", "hsdp", "coordinator", "--port", "0", "--replicas", "2", "--host", "127.0.0.1"]
    proc = subprocess.Popen(command, cwd=ROOT, env=launch_env("c"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        assert proc.stdout is not None
        lines = [proc.stdout.readline() for _ in range(2)]  # what it serves, then the address alone on its line
        match = re.fullmatch(r"HSDP_COORDINATOR=127\.0\.0\.1:(\d+)\n", lines[1])
        assert match and "elastic job 'default', 2 replica(s)" in lines[0], lines
        taken = subprocess.run([*command[:5], match.group(1), *command[6:]], cwd=ROOT, env=launch_env("c"),
                               capture_output=True, text=True, timeout=60)
        assert taken.returncode == 1 and "cannot serve on 127.0.0.1" in taken.stderr, taken.stderr
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0, rest
    assert "summary of elastic job 'default'" in rest and "never started" in rest, rest
