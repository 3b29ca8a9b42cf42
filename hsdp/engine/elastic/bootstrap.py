"""Joining an elastic job: read the environment, reach the coordinator, be admitted (``init_mesh(elastic=True)``).

Each replica is its own torchrun job: its world is the replica (the shard group). The environment names the
coordinator (``$HSDP_COORDINATOR``, ``host:port``), this replica's stable id (``$HSDP_REPLICA_ID``; ``hsdp launch
--elastic`` sets the node index) and the job's prefix on the coordinator (``$HSDP_ELASTIC_JOB``, default
``default``). Every check runs before any collective; the admission step is then broadcast from the replica's
leader (local rank 0 of its job), the one rank that registered and waited for it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hsdp.engine.elastic.client import CoordinatorClient, connect
from hsdp.engine.elastic.protocol import COORDINATOR_ENV, JOB_ENV, REPLICA_ID_ENV, ElasticPolicy, key


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


def join(found: ElasticEnv, degree: int, device: torch.device,
         policy: ElasticPolicy) -> tuple[CoordinatorClient, int, int]:
    """Connect every rank, register this replica (its leader) and wait for admission; ``(client, step it joins
    at, configured replica count)``. One broadcast over the replica's world."""
    store = connect(found.address, found.job, policy)
    leader = dist.get_rank() == 0
    client = CoordinatorClient(store, found.address, found.job, found.replica_id, leader, policy)
    answer = torch.zeros(2, dtype=torch.int64, device=device)
    error = ""
    if leader:
        try:
            answer[1] = configured = _configured(store, found)
            if found.replica_id >= configured:
                raise ValueError(f"{REPLICA_ID_ENV}={found.replica_id} is outside the coordinator's {configured} "
                                 f"replicas (ids 0..{configured - 1}): start it with more --replicas")
            client.register(degree)
            answer[0] = client.admitted()
        except (ValueError, TimeoutError) as e:
            error = str(e)
            answer[0] = -1
    dist.broadcast(answer, 0)
    if int(answer[0]) < 0:
        client.close()
        raise ValueError(error or f"replica {found.replica_id} was refused by the coordinator at {found.address} "
                                  f"(see rank 0's error)")
    return client, int(answer[0]), int(answer[1])


def _configured(store: dist.Store, found: ElasticEnv) -> int:
    return int(json.loads(store.get(key(found.job, "coordinator")).decode())["replicas"])
