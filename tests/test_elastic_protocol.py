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

from hsdp.engine.elastic.client import CoordinatorClient, QuorumLost, connect, parse_address
from hsdp.engine.elastic.protocol import ElasticPolicy
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
    stop.set()
    thread.join()


def _client(address: str, replica: int) -> CoordinatorClient:
    client = CoordinatorClient(connect(address, "job", POLICY), address, "job", replica, True, POLICY)
    client.register(degree=2)
    client.ready()
    return client


def _vote_all(clients: dict[int, CoordinatorClient], step: int) -> None:
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
    from hsdp.engine.elastic.bootstrap import elastic_env
    from hsdp.engine.mesh import init_mesh

    with pytest.raises(ValueError, match="drop device_mesh, tensor_parallel_degree and per-replica degree lists"):
        init_mesh(elastic=True, tensor_parallel_degree=2)
    with pytest.raises(ValueError, match="drop device_mesh, tensor_parallel_degree and per-replica degree lists"):
        init_mesh([2, 1], elastic=True)
    monkeypatch.delenv("HSDP_COORDINATOR", raising=False)
    with pytest.raises(ValueError, match=r"set HSDP_COORDINATOR=host:port .*hsdp coordinator --port PORT"):
        init_mesh(elastic=True)
    with pytest.raises(ValueError, match="set HSDP_REPLICA_ID to 0, 1"):
        elastic_env("127.0.0.1:1", {"HSDP_REPLICA_ID": "x"})
    assert elastic_env(None, {"HSDP_COORDINATOR": "h:1", "HSDP_REPLICA_ID": "2"}).job == "default"
