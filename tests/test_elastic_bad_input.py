"""Elastic replicas: bad input and bad situations end in one message that names the fix, within seconds.

Each case of the elastic bad-input list, where the other elastic tests do not already check it (they do: a
malformed address or a coordinator serving another job, ``test_elastic_protocol.py``; an id used twice by a
live member, and the quorum below its minimum, there and in ``test_train_elastic.py``; the coordinator's and
``hsdp launch --elastic``'s own flags, ``test_launch_elastic.py``):

- no coordinator reachable: ``hsdp train parallel.elastic=true`` (one rank, torchrun's environment, the default
  timeouts) says the address and the command that starts one within 15 s, with no C++ trace around it;
- a replica id outside the coordinator's range, a shard degree the replica's job does not have, and an elastic
  mesh with options it does not support (the replica-sharded optimizer, Streaming DiLoCo with two fragments' syncs
  in flight at once, DiLoCo with buffers broadcast every step, a plain torch optimizer stepping it): one one-rank
  replica of a real job against an in-process coordinator;
- one replica id used twice before either was admitted (as when two jobs start on one coordinator and job
  name): the first is admitted, the second refused naming ``HSDP_REPLICA_ID`` and ``HSDP_ELASTIC_JOB``; a
  restart before admission (the earlier incarnation went silent) is admitted, not refused;
- two jobs on one coordinator prefix: the second job's replicas are refused while the first one's train
  (same ids: the id is in use; another rank count: the counts differ; ``hsdp train`` replicas with another
  configuration: the job's configuration differs, naming the first one's run directory);
- below the minimum: the reason names ``--min-replicas`` and what to do next.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch.distributed as dist
from elastic_clients import ReplicaClient

from hsdp.apps.train.config_io import resolve_config
from hsdp.apps.train.elastic_run import prepare_elastic_run_dir
from hsdp.engine.replicate.elastic.client import QuorumLost, connect
from hsdp.engine.replicate.elastic.protocol import ElasticPolicy
from hsdp.tools.coordinator.server import Coordinator

POLICY = ElasticPolicy(heartbeat_interval=0.05, heartbeat_timeout=0.5, connect_timeout=2.0, join_timeout=20.0)
BOUND_S = 15.0  # every refusal arrives well within this, even on a loaded two-core machine

# One rank of a one-replica job: the refusals on a real elastic mesh, then `hsdp train` with nothing listening
# at its coordinator address (last: it ends the process group). Prints one JSON line: case -> error, seconds.
_PROGRAM = r"""
import json, os, sys, threading, time
import torch, torch.distributed as dist
sys.path.insert(0, os.environ["TESTS_DIR"])
from models import ParityNet, batch, loss_fn
import hsdp
from hsdp.apps.train import command
from hsdp.tools.coordinator.server import Coordinator

said = {}
def attempt(case, run):
    start = time.monotonic()
    try:
        run()
        said[case] = {"error": None}
    except Exception as e:
        said[case] = {"error": f"{type(e).__name__}: {e}"}
    said[case]["s"] = time.monotonic() - start

policy = hsdp.ElasticPolicy(heartbeat_interval=0.05, heartbeat_timeout=2.0, connect_timeout=5.0)
master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
coordinator = Coordinator(master, "bad", replicas=1, policy=policy)
threading.Thread(target=coordinator.serve, daemon=True).start()
os.environ.update(HSDP_COORDINATOR=f"127.0.0.1:{master.port}", HSDP_ELASTIC_JOB="bad", HSDP_REPLICA_ID="1")
attempt("id outside", lambda: hsdp.init_mesh(elastic=policy))
os.environ["HSDP_REPLICA_ID"] = "0"
attempt("shard degree", lambda: hsdp.init_mesh(2, elastic=policy))
attempt("tp degree", lambda: hsdp.init_mesh(elastic=policy, tensor_parallel_degree=2))
mesh = hsdp.init_mesh(elastic=policy)
for case, options in [("replica-sharded optimizer", {"shard_optimizer_across_replicas": True}),
                      ("streaming diloco", {"replica_sync": hsdp.DiLoCo(every=4, fragments=2, delay=3)}),
                      ("diloco buffers", {"replica_sync": hsdp.DiLoCo(every=4), "broadcast_buffers": True})]:
    attempt(case, lambda: hsdp.ShardedModel(ParityNet(), mesh=mesh, **options))
model = hsdp.ShardedModel(ParityNet(), mesh=mesh)
plain = torch.optim.SGD(model.parameters(), lr=0.1)
def plain_step():
    x, y = batch(0, 0)
    loss_fn(model(x), y).backward()
    plain.step()
attempt("plain optimizer", plain_step)
os.environ["HSDP_COORDINATOR"] = f"127.0.0.1:{os.environ['CLOSED_PORT']}"
start = time.monotonic()
status = command.main(["parallel.elastic=true", "--out", os.environ["RUN_DIR"]])
said["hsdp train unreachable"] = {"status": status, "s": time.monotonic() - start}
print(json.dumps(said), flush=True)
os._exit(0)  # the replica's heartbeat and groups need no orderly teardown here
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def one_rank_replica(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str]:
    """What the one-rank replica said (its JSON line) and its stderr."""
    closed, run_dir = _free_port(), tmp_path_factory.mktemp("elastic_bad") / "run"
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "OMP_NUM_THREADS": "1",
           "TESTS_DIR": str(Path(__file__).parent), "CLOSED_PORT": str(closed), "RUN_DIR": str(run_dir)}
    done = subprocess.run([sys.executable, "-c", _PROGRAM], env=env, capture_output=True, text=True, timeout=240)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert done.returncode == 0 and lines, done.stdout[-3000:] + done.stderr[-3000:]
    said = json.loads(lines[-1])
    said["closed port"] = closed
    return said, done.stderr


@pytest.mark.parametrize(("case", "fix"), [
    ("id outside", "HSDP_REPLICA_ID=1 is outside the coordinator's 1 replicas (ids 0..0): start it with more "
                   "--replicas"),
    ("shard degree", "sharding_degree=2: an elastic replica is one torchrun job sharded over all its 1 ranks; drop "
                     "sharding_degree or start 2 ranks per job"),
    ("tp degree", "tensor_parallel_degree=2 does not divide the world size 1: every tensor-parallel group is 2 "
                  "adjacent ranks"),
    ("replica-sharded optimizer", "turn shard_optimizer_across_replicas off"),
    ("streaming diloco", "Streaming DiLoCo (every=4, fragments=2, delay=3) on an elastic mesh keeps one fragment's "
                         "sync in flight at a time, so a fragment's update must land before the next fragment "
                         "starts: use delay <= every // fragments (2) there"),
    ("diloco buffers", "buffers broadcast every step (running statistics: BatchNorm) is not supported yet: pass "
                       "broadcast_buffers=False"),
    ("plain optimizer", "SGD steps the parameters of a model that is elastic (a step the coordinator discards must "
                        "not be applied) directly: wrap it, optimizer = hsdp.ShardedOptimizer(model, optimizer)"),
])
def test_an_elastic_replica_refuses_what_it_cannot_do_naming_the_fix(one_rank_replica: tuple[dict, str], case: str,
                                                                    fix: str) -> None:
    said, _ = one_rank_replica
    error = said[case]["error"]
    assert error is not None and error.startswith("ValueError: ") and fix in error, error
    assert said[case]["s"] < BOUND_S


def test_hsdp_train_without_a_coordinator_names_the_address_and_the_command(one_rank_replica: tuple[dict, str]
                                                                            ) -> None:
    said, err = one_rank_replica
    port = said["closed port"]
    assert said["hsdp train unreachable"]["status"] == 2
    assert said["hsdp train unreachable"]["s"] < BOUND_S  # the default connect timeout, 10 s, not a hang
    (line,) = [line for line in err.splitlines() if line.startswith("hsdp train: error:")]
    assert line.startswith(f"hsdp train: error: no hsdp coordinator reachable at 127.0.0.1:{port} within 10 s"), line
    assert f"start one with `hsdp coordinator --port {port} --replicas N` on that host" in line
    assert "frame #" not in err and "socket.cpp" not in err  # no C++ trace buries the line


# ---------------------------------------------------------------------------------------------------------
# The coordinator's refusals, with real store clients in this process.
# ---------------------------------------------------------------------------------------------------------
@pytest.fixture(params=[10.0])
def coordinator(request: pytest.FixtureRequest) -> Iterator[tuple[str, Coordinator]]:
    """A coordinator of 3 replicas (at least 2) serving job "job" in a thread; ``request.param``: how long it
    waits at the start for all three before starting with two."""
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    coord = Coordinator(master, "job", replicas=3, policy=POLICY, start_grace=request.param)
    stop = threading.Event()
    thread = threading.Thread(target=coord.serve, args=(stop.is_set,), daemon=True)
    thread.start()
    yield f"127.0.0.1:{master.port}", coord
    ReplicaClient.close_all()  # heartbeats stop before the store they beat on goes
    stop.set()
    thread.join()


def _client(address: str, replica: int, degree: int = 2) -> ReplicaClient:
    """A replica's leader that registered (``degree`` ranks) and is ready to be admitted."""
    client = ReplicaClient(connect(address, "job", POLICY), address, "job", replica, 0, POLICY)
    client.register(degree)
    client.ready()
    return client


def _refusal(client: ReplicaClient) -> tuple[str, float]:
    start = time.monotonic()
    with pytest.raises(ValueError) as caught:
        client.admitted()
    return str(caught.value), time.monotonic() - start


IN_USE = ("is in use by a live replica (incarnation 1): give every replica group its own HSDP_REPLICA_ID, or run "
          "a second job under another HSDP_ELASTIC_JOB prefix (hsdp coordinator --job NAME) or coordinator")


def test_an_id_used_twice_before_admission_admits_the_first_and_refuses_the_second(
        coordinator: tuple[str, Coordinator]) -> None:
    address, _ = coordinator
    first, second = _client(address, 0), _client(address, 0)  # both beat: two replicas claim id 0
    others = [_client(address, r) for r in (1, 2)]
    message, waited = _refusal(second)
    assert message == f"replica id 0 of job 'job' {IN_USE}" and waited < BOUND_S
    assert first.admitted() == 0 and [c.admitted() for c in others] == [0, 0]
    assert first.quorum(0).incarnations == (1, 1, 1)  # the first claim of id 0 trains, not the second


def test_a_restart_before_admission_takes_the_silent_incarnations_place(coordinator: tuple[str, Coordinator]) -> None:
    address, coord = coordinator
    crashed = _client(address, 0)
    crashed.close()  # its heartbeat stops, as a killed process's does; torchrun then starts it again
    restarted = _client(address, 0)  # registered while the crashed one still counts as alive
    deadline = time.monotonic() + BOUND_S
    while getattr(coord.state.pending.get(0), "number", 0) != 2:  # it took the crashed one's place
        assert time.monotonic() < deadline and not any(c.refused for c in coord.state.claims)
        time.sleep(0.01)
    others = [_client(address, r) for r in (1, 2)]  # now: else the first quorum could still take the crashed one
    assert restarted.admitted() == 0 and restarted.quorum(0).incarnations == (2, 1, 1)
    assert [c.admitted() for c in others] == [0, 0]


def test_a_second_job_on_one_coordinator_prefix_is_refused_while_the_first_trains(
        coordinator: tuple[str, Coordinator]) -> None:
    address, _ = coordinator
    job = {r: _client(address, r) for r in range(3)}
    assert [c.admitted() for c in job.values()] == [0, 0, 0]
    for c in job.values():
        c.vote(0, True)
        c.vote(0, True)
    assert job[0].decision(0)
    message, waited = _refusal(_client(address, 1))  # the second job's replica 1: same id, while 1 is live
    assert message == f"replica id 1 of job 'job' {IN_USE}" and waited < BOUND_S
    job[2].close()  # a free slot: a replica of another rank count must not fill it
    message, waited = _refusal(_client(address, 2, degree=4))
    assert message.startswith("replica 2 of job 'job' has 4 rank(s), the job's replicas have 2: every replica "
                              "needs the same number of ranks"), message
    assert "start it with 2 ranks (torchrun --nproc-per-node 2), or run a different job under its own " \
           "HSDP_ELASTIC_JOB" in message and waited < BOUND_S


@pytest.mark.parametrize("coordinator", [0.5], indirect=True)  # with two of three after 0.5 s
def test_replicas_of_another_rank_count_are_refused_at_the_start_and_the_rest_start(
        coordinator: tuple[str, Coordinator]) -> None:
    address, coord = coordinator
    wrong = _client(address, 0, degree=1)  # the lowest id, but the only one with 1 rank
    right = [_client(address, r, degree=2) for r in (1, 2)]
    message, waited = _refusal(wrong)
    assert "replica 0 of job 'job' has 1 rank(s), the job's replicas have 2" in message and waited < BOUND_S
    assert [c.admitted() for c in right] == [0, 0]
    assert right[0].quorum(0).members == (1, 2) and coord.state.degree == 2


def test_declared_rank_counts_admit_replicas_of_different_degrees_and_refuse_misfits() -> None:
    """``--nproc-per-replica 2,1,1``: replicas of 2 and 1 ranks train together (the quorum carries their counts);
    a replica of another count than its id's, or of another tensor-parallel degree, is refused naming the fix."""
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    coord = Coordinator(master, "job", replicas=3, policy=POLICY, start_grace=0.5, ranks=(2, 1, 1))
    stop = threading.Event()
    thread = threading.Thread(target=coord.serve, args=(stop.is_set,), daemon=True)
    thread.start()
    address = f"127.0.0.1:{master.port}"
    try:
        wrong = _client(address, 2, degree=2)  # id 2 was declared with 1 rank
        right = [_client(address, 0, degree=2), _client(address, 1, degree=1)]
        message, waited = _refusal(wrong)
        assert message.startswith("replica 2 of job 'job' has 2 rank(s), its id was declared with 1 "
                                  "(--nproc-per-replica 2,1,1): start it with 1 ranks"), message
        assert waited < BOUND_S and [c.admitted() for c in right] == [0, 0]
        assert right[0].quorum(0).members == (0, 1) and right[0].quorum(0).ranks == (2, 1)
        tp = ReplicaClient(connect(address, "job", POLICY), address, "job", 2, 0, POLICY)
        tp.tp_degree = 2  # one rank count right, but not the job's tensor-parallel degree
        tp.register(1)
        tp.ready()
        message, waited = _refusal(tp)
        assert "has tensor_parallel_degree=2, the job's replicas have 1" in message and waited < BOUND_S
    finally:
        ReplicaClient.close_all()
        stop.set()
        thread.join()


def test_below_the_minimum_the_reason_says_what_to_do(coordinator: tuple[str, Coordinator]) -> None:
    address, _ = coordinator
    clients = [_client(address, r) for r in range(3)]
    assert [c.admitted() for c in clients] == [0, 0, 0]
    for c in clients:
        c.vote(0, True)
        c.vote(0, True)
    assert clients[0].decision(0)
    clients[1].close()
    clients[2].close()
    clients[0].want(1)
    start = time.monotonic()
    with pytest.raises(QuorumLost) as caught:
        clients[0].quorum(1)
    assert time.monotonic() - start < BOUND_S
    assert "1 live replica(s) [0] is below the minimum of 2 (--min-replicas): to go on, start a new job (a new " \
           "coordinator) from a checkpoint with at least 2 live replicas, or with a lower --min-replicas" in str(
               caught.value)


# ---------------------------------------------------------------------------------------------------------
# hsdp train: replicas of two jobs on one coordinator prefix (the coordinator cannot tell them apart).
# ---------------------------------------------------------------------------------------------------------
def _replica(store: dist.Store, replica: int) -> SimpleNamespace:
    """What ``prepare_elastic_run_dir`` reads of one replica's rank 0: its channel, mesh and elastic layer."""
    client = SimpleNamespace(store=store, job="train", address="127.0.0.1:1")
    layer = SimpleNamespace(client=client, replica_id=replica)
    return SimpleNamespace(mesh=SimpleNamespace(elastic=layer), comm=None, is_root=True)


def test_hsdp_train_refuses_a_replica_of_another_configuration_on_the_jobs_prefix(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("hsdp.apps.train.elastic_run.on_rank0", lambda comm, tag, check: check())  # one rank
    store = dist.HashStore()
    ours = resolve_config(None, ["parallel.elastic=true", f"train.out_dir={tmp_path / 'a'}"])
    theirs = resolve_config(None, ["parallel.elastic=true", f"train.out_dir={tmp_path / 'b'}"])
    prepare_elastic_run_dir(ours, _replica(store, 0))
    prepare_elastic_run_dir(ours, _replica(store, 1))  # the same job's next replica (or a restart)
    with pytest.raises(ValueError) as caught:
        prepare_elastic_run_dir(theirs, _replica(store, 2))
    assert str(caught.value) == (
        f"replica 2: elastic job 'train' on the coordinator at 127.0.0.1:1 already trains another configuration "
        f"(its first replica's, out_dir {str(tmp_path / 'a')!r}): start every replica of a job with the same "
        f"configuration, or run a second job under its own HSDP_ELASTIC_JOB (hsdp coordinator --job NAME) or "
        f"coordinator")
    assert os.listdir(tmp_path) == []  # refused before anything is written
