"""Joining an elastic job: read the environment, reach the coordinator, be admitted (``init_mesh(elastic=True)``).

Each replica is its own torchrun job: its world is the replica (the shard group). The environment names the
coordinator (``$HSDP_COORDINATOR``, ``host:port``), this replica's stable id (``$HSDP_REPLICA_ID``; ``hsdp launch
--elastic`` sets the node index) and the job's prefix on the coordinator (``$HSDP_ELASTIC_JOB``, default
``default``). Every check runs before any collective; the admission step is then told by the replica's
leader (local rank 0 of its job), the one rank that registered and waited for it, through the replica's own
rendezvous store.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch.distributed as dist

from hsdp.engine.elastic.client import CoordinatorClient, connect
from hsdp.engine.elastic.protocol import COORDINATOR_ENV, JOB_ENV, REPLICA_ID_ENV, ElasticPolicy, key
from hsdp.engine.store_exchange import exchange


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


def join(found: ElasticEnv, degree: int, policy: ElasticPolicy) -> tuple[CoordinatorClient, int]:
    """Connect every rank and register this replica (its leader: the heartbeat starts); ``(client, configured
    replica count)``. Admission waits until the replica is ready (:func:`admit`)."""
    store = connect(found.address, found.job, policy)
    leader = dist.get_rank() == 0
    client = CoordinatorClient(store, found.address, found.job, found.replica_id, leader, policy)
    answer: dict[str, object] = {}
    if leader:
        try:
            answer["replicas"] = configured = _configured(store, found)
            if found.replica_id >= configured:
                raise ValueError(f"{REPLICA_ID_ENV}={found.replica_id} is outside the coordinator's {configured} "
                                 f"replicas (ids 0..{configured - 1}): start it with more --replicas")
            client.register(degree)
        except (ValueError, TimeoutError) as e:
            answer["error"] = str(e)
    # The leader's answer to the replica's other ranks: through the replica's rendezvous store.
    told = json.loads(exchange(json.dumps(answer) if leader else "{}")[0])
    if "error" in told:
        client.close()
        raise ValueError(told["error"])
    return client, int(told["replicas"])


def admit(client: CoordinatorClient) -> int:
    """Tell the coordinator this replica is ready (its model and optimizer exist) and wait for admission; the
    step it joins at, on every rank of the replica (the leader asks and tells the others through the store)."""
    answer: dict[str, object] = {}
    if client.leader:
        try:
            client.ready()
            answer["step"] = client.admitted()
        except (ValueError, TimeoutError) as e:
            answer["error"] = str(e)
    told = json.loads(exchange(json.dumps(answer) if client.leader else "{}")[0])
    if "error" in told:
        client.close()
        raise ValueError(told["error"])
    return int(told["step"])


def _configured(store: dist.Store, found: ElasticEnv) -> int:
    return int(json.loads(store.get(key(found.job, "coordinator")).decode())["replicas"])
