"""The elastic coordinator's decisions, with real store clients in one process (no process groups).

Three replicas register and the first quorum heals everyone from replica 0; a replica whose heartbeat stops
is dropped: the step it did not vote on is aborted, the next quorum has a new epoch without it; a restarted
incarnation of it is admitted at a later step and healed from a live member; a second replica claiming a
live id is rejected naming the fix; below the minimum the job is stopped (``QuorumLost``). Bad addresses and
an absent coordinator raise a ``ValueError`` naming the command within the connect timeout.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import torch.distributed as dist
from elastic_clients import ReplicaClient
from harness import run_distributed

from hsdp.engine.faults.policy import FaultPolicy
from hsdp.engine.replicate.elastic.bootstrap import admit
from hsdp.engine.replicate.elastic.client import CoordinatorClient, JobCompleted, QuorumLost, connect, parse_address
from hsdp.engine.replicate.elastic.protocol import ElasticPolicy
from hsdp.tools.coordinator.server import Coordinator

POLICY = ElasticPolicy(heartbeat_interval=0.05, heartbeat_timeout=0.4, connect_timeout=2.0, join_timeout=20.0)


@pytest.fixture()
def coordinator() -> Iterator[tuple[str, Coordinator]]:
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    coord = Coordinator(master, "job", replicas=3, policy=POLICY)
    stop = threading.Event()
    thread = threading.Thread(target=coord.serve, args=(stop.is_set,), daemon=True)
    thread.start()
    yield f"127.0.0.1:{master.port}", coord
    ReplicaClient.close_all()
    stop.set()
    thread.join()


def _client(address: str, replica: int) -> ReplicaClient:
    client = ReplicaClient(connect(address, "job", POLICY), address, "job", replica, 0, POLICY)
    client.register(degree=2)
    client.ready()
    return client


def _vote_all(clients: dict[int, ReplicaClient], step: int) -> None:
    for c in clients.values():
        c.vote(step, True)
        c.vote(step, True)  # two ranks per replica


def test_membership_changes_at_step_boundaries(coordinator: tuple[str, Coordinator]) -> None:
    address, coord = coordinator
    clients = {r: _client(address, r) for r in range(3)}
    assert [c.admitted() for c in clients.values()] == [0, 0, 0]
    first = clients[1].quorum(0)
    assert (first.members, first.joiners, first.source, first.epoch) == ((0, 1, 2), (1, 2), 0, 0)
    _vote_all(clients, 0)
    assert clients[2].decision(0) is True
    for c in clients.values():
        c.want(1)
    assert clients[0].quorum(1).joiners == ()
    clients[2].close()  # its heartbeat stops before it votes
    live = {r: clients[r] for r in (0, 1)}
    _vote_all(live, 1)
    assert clients[0].decision(1) is False  # a member died: nobody applies step 1
    for c in live.values():
        c.want(2)
    second = clients[0].quorum(2)
    assert (second.members, second.epoch) == ((0, 1), 1)
    _vote_all(live, 2)
    assert clients[1].decision(2) is True
    back = _client(address, 2)  # the restarted replica: a new incarnation of id 2
    for c in live.values():
        c.want(3)
    assert back.admitted() == 3
    third = back.quorum(3)
    assert (third.members, third.incarnations, third.joiners, third.source, third.epoch) == (
        (0, 1, 2), (1, 1, 2), (2,), 0, 2)
    duplicate = _client(address, 2)
    with pytest.raises(ValueError, match="replica id 2 of job 'job' is in use by a live replica"):
        duplicate.admitted()
    assert [(step, decision) for step, decision, _ in coord.state.history] == [
        (0, "commit"), (1, "abort"), (2, "commit")]


def test_below_the_minimum_the_job_stops(coordinator: tuple[str, Coordinator]) -> None:
    address, _ = coordinator
    clients = {r: _client(address, r) for r in range(3)}
    for c in clients.values():
        c.admitted()
    _vote_all(clients, 0)
    assert clients[0].decision(0)
    clients[1].close()
    clients[2].close()  # a majority of 3 is 2: one live replica is not enough
    clients[0].want(1)
    with pytest.raises(QuorumLost, match="below the minimum of 2"):
        clients[0].quorum(1)
    late = _client(address, 1)  # e.g. torchrun restarting a replica after the job stopped: told, not kept waiting
    with pytest.raises(ValueError, match="the elastic job 'job' stopped: 1 live replica"):
        late.admitted()


def test_a_replica_is_dropped_within_the_heartbeat_timeout_when_a_rank_that_is_not_its_leader_stops(
        coordinator: tuple[str, Coordinator]) -> None:
    address, _ = coordinator
    clients = {r: _client(address, r) for r in range(3)}
    for c in clients.values():
        c.admitted()
    _vote_all(clients, 0)
    assert clients[0].decision(0)
    for c in clients.values():
        c.want(1)
    assert clients[0].quorum(1).members == (0, 1, 2)
    clients[2].others[0].close()  # rank 1 of replica 2 stops (SIGSTOP, a hung host); its leader still beats
    stopped = time.monotonic()
    _vote_all({r: clients[r] for r in (0, 1)}, 1)
    assert clients[0].decision(1) is False  # replica 2 cannot finish the step: discarded, not waited for
    waited = time.monotonic() - stopped
    assert waited < POLICY.heartbeat_timeout + 1.0, waited
    for c in clients.values():
        c.want(2)
    assert clients[0].quorum(2).members == (0, 1)


def test_a_late_replica_of_a_job_whose_members_finished_is_told_it_completed(
        coordinator: tuple[str, Coordinator]) -> None:
    address, coord = coordinator
    clients = {r: _client(address, r) for r in range(3)}
    for c in clients.values():
        c.admitted()
    _vote_all(clients, 0)
    assert clients[0].decision(0)
    clients[2].close()  # killed: torchrun restarts it
    for c in (clients[0], clients[1]):
        c.want(1)
    assert clients[0].quorum(1).members == (0, 1)
    _vote_all({r: clients[r] for r in (0, 1)}, 1)
    assert clients[0].decision(1)  # the last step: both end their training normally
    clients[0].close(finished=True)
    clients[1].close(finished=True)
    late = _client(address, 2)  # the restart, still starting when training ended
    with pytest.raises(JobCompleted) as caught:
        late.admitted()
    assert caught.value.code == 0 and "completed" in str(caught.value) and "checkpoint" not in str(caught.value)
    assert coord.state.completed and not coord.state.stopped
    assert coord.state.finishers == {(0, 1), (1, 1)}


def test_a_job_that_lost_every_replica_says_to_start_again_from_a_checkpoint(
        coordinator: tuple[str, Coordinator]) -> None:
    address, coord = coordinator
    clients = {r: _client(address, r) for r in range(3)}
    for c in clients.values():
        c.admitted()
    _vote_all(clients, 0)
    assert clients[0].decision(0)
    for c in clients.values():
        c.close()  # every replica dies at once, none finished
    late = _client(address, 2)
    with pytest.raises(ValueError, match=r"no live replica holds the model state at step 1 .* start a new job from a "
                                         r"checkpoint"):
        late.admitted()
    assert coord.state.stopped and not coord.state.completed


# A heartbeat timeout far above what the probes take: what a probe decides shows in the timing.
PATIENT = ElasticPolicy(heartbeat_interval=0.05, heartbeat_timeout=4.0, connect_timeout=10.0, join_timeout=20.0)


@pytest.fixture(scope="module")
def patient_store() -> Iterator[dist.TCPStore]:
    # One store for these tests, a job each (as jobs share a coordinator): starting a store server per test
    # in one process now and then leaves a new client's connect waiting seconds on a busy machine.
    yield dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


@pytest.fixture()
def patient(patient_store: dist.TCPStore, request: pytest.FixtureRequest) -> Iterator[tuple[str, Coordinator]]:
    job = f"patient-{request.node.name}"
    coord = Coordinator(patient_store, job, replicas=3, policy=PATIENT)
    stop = threading.Event()
    thread = threading.Thread(target=coord.serve, args=(stop.is_set,), daemon=True)
    thread.start()
    yield f"127.0.0.1:{patient_store.port}", coord
    ReplicaClient.close_all()
    stop.set()
    thread.join()


def _started(address: str, job: str) -> dict[int, ReplicaClient]:
    clients = {}
    for r in range(3):
        clients[r] = ReplicaClient(connect(address, job, PATIENT), address, job, r, 0, PATIENT)
        clients[r].register(degree=2)
        clients[r].ready()
    for c in clients.values():
        c.admitted()
    _vote_all(clients, 0)
    assert clients[0].decision(0)
    return clients


@pytest.mark.parametrize("when", ["in the hop", "between steps"])
def test_a_dead_replica_is_dropped_at_the_coordinators_probe_not_after_the_heartbeat_timeout(
        patient: tuple[str, Coordinator], when: str) -> None:
    address, coord = patient
    clients = _started(address, coord.job)
    for c in clients.values():
        c.want(1)
    assert clients[0].quorum(1).members == (0, 1, 2)
    live = {r: clients[r] for r in (0, 1)}
    if when == "in the hop":  # its peers' reduction breaks: they vote so, and the coordinator probes everyone
        clients[2].close()  # SIGKILL: its liveness ports close with the process
        died = time.monotonic()
        for c in live.values():
            c.vote(1, False, "connection reset by peer")
            c.vote(1, True)
        assert clients[0].decision(1) is False
    else:  # it dies after voting: the others ask for the next step and it never does
        _vote_all(clients, 1)
        assert clients[0].decision(1) is True
        clients[2].close()
        died = time.monotonic()
    for c in live.values():
        c.want(2)
    assert clients[0].quorum(2).members == (0, 1)
    waited = time.monotonic() - died
    assert waited < 1.0 < PATIENT.heartbeat_timeout, waited
    assert (2, 1) in coord.state.gone


def test_a_slow_replica_is_kept_and_a_stopped_one_is_left_to_the_heartbeat(
        patient: tuple[str, Coordinator]) -> None:
    address, coord = patient
    clients = _started(address, coord.job)
    clients[0].want(1)
    clients[1].want(1)
    time.sleep(1.0)  # replica 2 is slow: probed ten times meanwhile, its ports answer
    clients[2].want(1)
    assert clients[0].quorum(1).members == (0, 1, 2) and not coord.state.gone
    _vote_all(clients, 1)
    assert clients[0].decision(1)
    for c in (clients[2], *clients[2].others):
        c._stop_beat()  # SIGSTOP: silent, but the kernel still answers for its ports
    stopped = time.monotonic()
    clients[0].want(2)
    clients[1].want(2)
    assert clients[0].quorum(2).members == (0, 1)
    waited = time.monotonic() - stopped
    # Not by a probe (a refused one drops within 0.2 s, and says so in ``gone``): by its heartbeat's silence,
    # which a busy machine may have started a little before the stop.
    assert 1.5 < waited < PATIENT.heartbeat_timeout + 1.0, waited
    assert not coord.state.gone


def test_a_replica_that_finished_is_not_taken_for_dead_by_the_probe(patient: tuple[str, Coordinator]) -> None:
    address, coord = patient
    clients = _started(address, coord.job)
    clients[2].close(finished=True)  # its training is done: its ports close as a dead one's would
    clients[0].want(1)
    clients[1].want(1)  # replica 2 is late for step 1: probed, refused, and found finished
    assert clients[0].quorum(1).members == (0, 1)
    assert (2, 1) in coord.state.finishers and not coord.state.gone


class _Distant:
    """A coordinator's store 30 ms away: every call costs a round trip."""

    def __init__(self, store: dist.Store) -> None:
        self.store = store

    def __getattr__(self, name: str) -> object:
        call = getattr(self.store, name)

        def slow(*args: object) -> object:
            time.sleep(0.03)
            return call(*args)

        return slow


def test_waiting_for_admission_measures_the_join_timeout() -> None:
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    policy = ElasticPolicy(join_timeout=1.0)
    client = CoordinatorClient(_Distant(master), f"127.0.0.1:{master.port}", "job", 0, 0, policy)  # type: ignore[arg-type]
    client.incarnation = 1  # registered; no coordinator decides here
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"not admitted .* within 1 s"):
        client.admitted()
    assert time.monotonic() - start < 1.5  # the round trips count (counting only the pauses took 7 s)


def _admission_without_a_leader(rank: int, world_size: int) -> tuple[str, float] | None:
    """Rank 0, the replica's leader, never tells its admission (stuck before it asked); rank 1 waits for it."""
    policy = ElasticPolicy(join_timeout=1.0, connect_timeout=0.5)
    if rank == 0:
        return None  # the file store outlives it: rank 1 waits on the leader's key alone
    store = dist.distributed_c10d._get_default_store()
    client = CoordinatorClient(store, "127.0.0.1:1", "job", 0, rank, policy)
    start = time.monotonic()
    try:
        admit(client)
    except ValueError as e:
        return str(e), time.monotonic() - start
    return "admitted", time.monotonic() - start


def test_ranks_other_than_the_leader_wait_for_admission_as_long_as_the_join_timeout_says() -> None:
    _, (message, waited) = run_distributed(_admission_without_a_leader, 2, timeout=60)
    assert 1.9 < waited < 6.0, waited  # join_timeout + 2 x connect_timeout, not a fixed 5 minutes
    assert message.startswith("replica 0 rank 1: its leader (local rank 0) did not tell its admission by the "
                              "coordinator at 127.0.0.1:1 within 2 s (join_timeout 1 s"), message
    assert "raise ElasticPolicy.join_timeout" in message


def test_unreachable_or_wrong_coordinator_fails_fast_naming_the_fix() -> None:
    with pytest.raises(ValueError, match="not host:port"):
        parse_address("localhost")
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"no hsdp coordinator reachable at 127.0.0.1:1 .*hsdp coordinator --port 1"):
        connect("127.0.0.1:1", "job", ElasticPolicy(connect_timeout=1.0))
    assert time.monotonic() - start < 10
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    Coordinator(master, "other", replicas=1)
    with pytest.raises(ValueError, match="serves no elastic job 'job'"):
        connect(f"127.0.0.1:{master.port}", "job", ElasticPolicy(connect_timeout=1.0))


def test_elastic_mesh_refusals_before_any_process(monkeypatch: pytest.MonkeyPatch) -> None:
    from hsdp.engine.mesh_init import init_mesh
    from hsdp.engine.replicate.elastic.bootstrap import elastic_env

    with pytest.raises(ValueError, match="drop device_mesh and per-replica degree lists"):
        init_mesh([2, 1], elastic=True)
    with pytest.raises(ValueError, match=r"FaultPolicy\(timeout=3\) must be above ElasticPolicy\(heartbeat_timeout=4\)"
                       r".*raise FaultPolicy.timeout"):
        init_mesh(elastic=ElasticPolicy(heartbeat_timeout=4.0), fault_policy=FaultPolicy(timeout=3.0, interval=0.5))
    with monkeypatch.context() as env:  # tensor parallelism combines with elastic; a T not dividing the job does not
        env.setenv("HSDP_COORDINATOR", "127.0.0.1:1")
        env.setenv("HSDP_REPLICA_ID", "0")
        env.setenv("WORLD_SIZE", "3")
        with pytest.raises(ValueError, match="tensor_parallel_degree=2 does not divide the world size 3"):
            init_mesh(elastic=True, tensor_parallel_degree=2)
    monkeypatch.delenv("HSDP_COORDINATOR", raising=False)
    with pytest.raises(ValueError, match=r"set HSDP_COORDINATOR=host:port .*hsdp coordinator --port PORT"):
        init_mesh(elastic=True)
    with pytest.raises(ValueError, match="set HSDP_REPLICA_ID to 0, 1"):
        elastic_env("127.0.0.1:1", {"HSDP_REPLICA_ID": "x"})
    assert elastic_env(None, {"HSDP_COORDINATOR": "h:1", "HSDP_REPLICA_ID": "2"}).job == "default"
