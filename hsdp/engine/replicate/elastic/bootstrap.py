"""Joining an elastic job: read the environment, reach the coordinator, be admitted (``init_mesh(elastic=True)``).

Each replica is its own torchrun job: its world is the replica (the shard group). The environment names the
coordinator (``$HSDP_COORDINATOR``, ``host:port``), this replica's stable id (``$HSDP_REPLICA_ID``; ``hsdp launch
--elastic`` sets the node index) and the job's prefix on the coordinator (``$HSDP_ELASTIC_JOB``, default
``default``). Every check runs before any collective; the incarnation and the admission step are then told by
the replica's leader (local rank 0 of its job), the one rank that registered and waited for it, through the
replica's own rendezvous store (its other ranks wait as long as the leader may: ``ElasticPolicy.leader_wait``).
A replica that comes after the job completed is told so and ends cleanly (:class:`JobCompleted`).

A job of replicas of different shard degrees is declared on the coordinator (``hsdp coordinator
--nproc-per-replica 2,1,1``; ``hsdp launch --elastic`` with per-node rank counts does it): every replica learns
each id's rank count when it joins (:class:`Joined`), before its model is wrapped, so it reduces over pieces
from its first step to its last (the path never changes mid-run), and its data does not move when others leave.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from hsdp.engine.replicate.elastic.client import CoordinatorClient, JobCompleted, connect
from hsdp.engine.replicate.elastic.protocol import COORDINATOR_ENV, JOB_ENV, REPLICA_ID_ENV, ElasticPolicy, key
from hsdp.engine.store_exchange import exchange


@dataclass(frozen=True)
class Joined:
    """What a replica learns when it joins: its ``client``, the configured replica count, and each id's rank
    count when the job declared replicas of different degrees (``None``: one rank count for every replica)."""

    client: CoordinatorClient
    replicas: int
    ranks: tuple[int, ...] | None


@dataclass(frozen=True)
class ElasticEnv:
    address: str
    replica_id: int
    job: str


def elastic_env(coordinator: str | None, env: Mapping[str, str] | None = None) -> ElasticEnv:
    """The coordinator address (argument, else ``$HSDP_COORDINATOR``), replica id and job, or ``ValueError``."""
    env = os.environ if env is None else env
    address = coordinator or env.get(COORDINATOR_ENV)
    if not address:
        raise ValueError(f"init_mesh(elastic=True) needs the coordinator's address: set {COORDINATOR_ENV}=host:port "
                         f"(start one with `hsdp coordinator --port PORT --replicas N`; `hsdp launch --elastic` "
                         f"does both), or pass coordinator='host:port'")
    text = env.get(REPLICA_ID_ENV, "")
    if not text.isdigit():
        raise ValueError(f"init_mesh(elastic=True) needs this replica's stable id: set {REPLICA_ID_ENV} to 0, 1, ... "
                         f"(one per replica group, e.g. the node index), got {text!r}")
    return ElasticEnv(address, int(text), env.get(JOB_ENV, "default"))


def join(found: ElasticEnv, degree: int, policy: ElasticPolicy, tp_degree: int = 1) -> Joined:
    """Connect every rank and register this replica of ``degree`` ranks (``tp_degree`` tp ranks per shard
    position) with its leader (every rank's heartbeat starts). Admission waits until the replica is ready
    (:func:`admit`). :class:`JobCompleted` on every rank when the job is over already; ``ValueError`` on every
    rank when its id is out of range, or its rank count is not the one the job declared for its id."""
    store = connect(found.address, found.job, policy)
    client = CoordinatorClient(store, found.address, found.job, found.replica_id, dist.get_rank(), policy)
    client.tp_degree = tp_degree
    answer: dict[str, object] = {}
    if client.leader:
        try:
            client.raise_if_completed()  # a restart that was still starting when training ended
            served = json.loads(store.get(key(found.job, "coordinator")).decode())
            answer["replicas"] = configured = int(served["replicas"])
            answer["ranks"] = served.get("ranks")
            if found.replica_id >= configured:
                raise ValueError(f"{REPLICA_ID_ENV}={found.replica_id} is outside the coordinator's {configured} "
                                 f"replicas (ids 0..{configured - 1}): start it with more --replicas")
            _check_declared(found.replica_id, degree, tp_degree, served.get("ranks"))
            answer["incarnation"] = client.register(degree)
        except (ValueError, TimeoutError, JobCompleted) as e:
            answer.update(_failure(e))
    told = _told(client, answer, "its registration")
    if not client.leader:  # the leader beats since it registered
        client.beat(int(told["incarnation"]))
    ranks = told.get("ranks")
    return Joined(client, int(told["replicas"]), None if ranks is None else tuple(ranks))


def _check_declared(replica_id: int, degree: int, tp_degree: int, ranks: list[int] | None) -> None:
    """``ValueError`` naming the fix when the job declared rank counts per id (replicas of different degrees)
    and this replica's is not its id's, or some id's count is no whole number of tensor-parallel groups."""
    if ranks is None:
        return
    if ranks[replica_id] != degree:
        raise ValueError(f"replica {replica_id} has {degree} rank(s), the coordinator declares {ranks[replica_id]} "
                         f"for it (--nproc-per-replica {','.join(map(str, ranks))}): start it with torchrun "
                         f"--nproc-per-node {ranks[replica_id]}, or fix the coordinator's --nproc-per-replica")
    if any(n % tp_degree for n in ranks):
        raise ValueError(f"tensor_parallel_degree={tp_degree} does not divide every replica's rank count "
                         f"({list(ranks)}, --nproc-per-replica): every replica holds whole tensor-parallel groups")


def admit(client: CoordinatorClient) -> int:
    """Tell the coordinator this replica is ready (its model and optimizer exist) and wait for admission; the
    step it joins at, on every rank of the replica (the leader asks and tells the others through the store).
    :class:`JobCompleted` on every rank when the job ended before this replica was admitted."""
    answer: dict[str, object] = {}
    if client.leader:
        try:
            client.ready()
            answer["step"] = client.admitted()
        except (ValueError, TimeoutError, JobCompleted) as e:
            answer.update(_failure(e))
    return int(_told(client, answer, "its admission")["step"])


def rejoin(client: CoordinatorClient, degree: int) -> int:
    """A live replica the coordinator dropped (its heartbeat starved past the timeout): register a new
    incarnation (every rank beats for it) and be admitted again like a restarted replica, without a restart;
    the step it joins at, on every rank. The caller heals it from the quorum of that step."""
    answer: dict[str, object] = {}
    if client.leader:
        try:
            answer["incarnation"] = client.register(degree)
        except (RuntimeError, TimeoutError) as e:
            answer.update(_failure(e))
    incarnation = int(_told(client, answer, "its new registration")["incarnation"])
    if not client.leader:
        client.beat(incarnation)
    return admit(client)


def _failure(error: BaseException) -> dict[str, object]:
    return {"completed": str(error)} if isinstance(error, JobCompleted) else {"error": str(error)}


def _told(client: CoordinatorClient, answer: dict[str, object], what: str) -> dict[str, object]:
    """The leader's ``answer`` on every rank of the replica, through the replica's rendezvous store (the other
    ranks wait at most ``ElasticPolicy.leader_wait``); the leader's error raised on every rank."""
    wait = client.policy.leader_wait
    try:
        told = json.loads(exchange(json.dumps(answer) if client.leader else "{}", timedelta(seconds=wait))[0])
    except TimeoutError as e:
        client.close()
        raise ValueError(f"replica {client.replica_id} rank {client.rank}: its leader (local rank 0) did not tell "
                         f"{what} by the coordinator at {client.address} within {wait:g} s (join_timeout "
                         f"{client.policy.join_timeout:g} s + 2 x connect_timeout; {e}): see rank 0's error, or "
                         f"raise ElasticPolicy.join_timeout") from None
    if "completed" in told:
        client.close()
        if client.leader:  # SystemExit(0) prints nothing: say once why this replica ends
            print(f"hsdp elastic: {told['completed']}", file=sys.stderr, flush=True)
        raise JobCompleted(str(told["completed"]))
    if "error" in told:
        client.close()
        raise ValueError(told["error"])
    return told

