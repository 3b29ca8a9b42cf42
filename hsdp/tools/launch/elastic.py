"""``hsdp launch --elastic``: every emulated node is one replica of an elastic job, with its own torchrun job.

The non-elastic launch starts one torchrun agent per node, all in one static rendezvous: one job, one world,
and a rank that dies ends it. Here each node is a job of its own (``--standalone --nnodes 1
--max-restarts K``: its own rendezvous store on its own loopback, its world the node's ranks, as
``hsdp.init_mesh(elastic=True)`` expects), and the nodes meet only on the coordinator
(``hsdp coordinator``), which this launch starts first, on node 0 (its namespace and address, or the
loopback), and stops last. Every rank gets ``HSDP_COORDINATOR`` (the address the coordinator printed),
``HSDP_REPLICA_ID`` (its node's index) and ``HSDP_ELASTIC_JOB``.

A node whose rank dies is restarted by its own torchrun (up to K times), rejoins and is healed from a live
replica while the others go on; a node that fails past its restarts ends alone (the others go on if enough
replicas are left: the coordinator's ``--min-replicas``). The launch ends when every node's torchrun has
ended; its exit status is the first failed node's (0 when none failed).

Only the commands and environments are built here (pure functions, tested without processes); the network,
the cpu groups and the cleanup are the non-elastic launch's (:mod:`hsdp.tools.launch.emulated`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from hsdp.engine.replicate.elastic.protocol import COORDINATOR_ENV, JOB_ENV, REPLICA_ID_ENV
from hsdp.tools.coordinator.config import ADDRESS_LINE, DEFAULT_JOB, check_replicas
from hsdp.tools.launch.layout import NodeLayout
from hsdp.tools.launch.local import (
    AGENT_MODULE,
    LOOPBACK,
    AgentSpec,
    Supervisor,
    agent_env,
    start_service,
    stop_groups,
)
from hsdp.tools.launch.netns import ClusterSpec

DEFAULT_RESTARTS = 3  # torchrun restarts of each node before it counts as failed
START_GRACE_S = 60.0  # the nodes start together: the first step waits this long for all of them
# torchrun's c10d rendezvous shares its store with the workers by default, and a restart's workers then find
# the previous attempt's gloo addresses there (connectFullMesh: "Connection refused", pytorch/pytorch#135712,
# seen on torch 2.13 in about one restart of three); without sharing, each attempt's rank 0 hosts a fresh store.
UNSHARED_STORE = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
COORDINATOR_LABEL = "coordinator"
COORDINATOR_READY_S = 120.0  # its start is an interpreter and torch: seconds, more on a loaded machine


@dataclass(frozen=True)
class ElasticOptions:
    """The elastic part of one launch: each node's torchrun restarts it up to ``max_restarts`` times; the job
    goes on while at least ``min_replicas`` nodes live (default: a majority); ``job`` names it on the
    coordinator; ``heartbeat_timeout`` is the coordinator's (``None``: its default). ``ValueError`` naming the
    fix for a negative restart count, a bad job name or a timeout that is not positive."""

    max_restarts: int = DEFAULT_RESTARTS
    min_replicas: int | None = None
    job: str = DEFAULT_JOB
    heartbeat_timeout: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.max_restarts, bool) or not isinstance(self.max_restarts, int) or self.max_restarts < 0:
            raise ValueError(f"--max-restarts {self.max_restarts!r}: give a whole number, at least 0")
        if not self.job or "/" in self.job:
            raise ValueError(f"elastic job name {self.job!r}: give a non-empty name without '/'")
        if self.heartbeat_timeout is not None and not self.heartbeat_timeout > 0:
            raise ValueError(f"--heartbeat-timeout {self.heartbeat_timeout}: give a positive number of seconds")

    def check(self, layout: NodeLayout) -> None:
        """``ValueError`` naming the fix when ``layout`` cannot be an elastic job: ``min_replicas`` lies outside
        ``1..nodes``. Nodes of different rank counts are replicas of different shard degrees (the coordinator
        is told each node's count)."""
        check_replicas(layout.nodes, self.min_replicas, flag="--nodes")


@dataclass(frozen=True)
class NodePlace:
    """Where node ``i``'s processes run: ``prefix`` enters its namespace (empty on the loopback), ``env`` pins
    its collectives to its link, ``address`` is how the other nodes reach it."""

    prefix: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    address: str = LOOPBACK


def loopback_places(nodes: int) -> list[NodePlace]:
    """Every node a group of local processes on the loopback."""
    return [NodePlace() for _ in range(nodes)]


def namespace_places(ip: str, spec: ClusterSpec) -> list[NodePlace]:
    """Every node in its network namespace of ``spec``, behind its shaped link."""
    return [NodePlace((ip, "netns", "exec", node.namespace), node.env(), node.address)
            for node in map(spec.node, range(spec.nodes))]


def replica_command(nproc: int, max_restarts: int, script_args: Sequence[str]) -> list[str]:
    """One node's torchrun job: a single-node job with its own rendezvous on a free port of its loopback.

    ``--local-addr 127.0.0.1``: the job's store is found at the loopback, not at the machine's host name,
    which does not resolve to any address inside a node's namespace."""
    return [sys.executable, "-m", AGENT_MODULE, "--standalone", "--nnodes", "1", "--nproc-per-node", str(nproc),
            "--max-restarts", str(max_restarts), "--local-addr", LOOPBACK, *script_args]


def replica_env(address: str, node: int, job: str) -> dict[str, str]:
    """What node ``node``'s ranks need to find the coordinator and say which replica they are."""
    return {COORDINATOR_ENV: address, REPLICA_ID_ENV: str(node), JOB_ENV: job}


def coordinator_command(place: NodePlace, layout: NodeLayout, options: ElasticOptions) -> list[str]:
    """``hsdp coordinator`` on node ``place`` (node 0), on a free port it prints (so nothing can take it first),
    for the nodes of ``layout`` (told each node's rank count when they differ: replicas of different degrees);
    the first step waits up to :data:`START_GRACE_S` for every node (they all start now, but not equally fast
    on a busy machine: one that misses the start joins later and is healed, a step's cost). Once the job
    completed it serves on until this launch stops it after the last node: a node that torchrun restarted and
    that was still starting when the others finished is told the job is over and ends with status 0."""
    minimum = [] if options.min_replicas is None else ["--min-replicas", str(options.min_replicas)]
    timeout = [] if options.heartbeat_timeout is None else ["--heartbeat-timeout", f"{options.heartbeat_timeout:g}"]
    counts = [] if layout.uniform else ["--nproc-per-replica", ",".join(map(str, layout.nprocs))]
    return [*place.prefix, sys.executable, "-m", "hsdp", "coordinator", "--host", place.address, "--port", "0",
            "--replicas", str(layout.nodes), *minimum, *timeout, *counts, "--job", options.job, "--start-grace",
            f"{START_GRACE_S:g}", "--linger", "inf"]


def coordinator_spec(place: NodePlace, layout: NodeLayout, options: ElasticOptions,
                     env: Mapping[str, str] | None = None) -> AgentSpec:
    """The coordinator process: one thread of work (it polls a store), its lines unbuffered, torch's C++
    warnings off unless asked for (a store client's address without a host name, in a namespace, is not news)."""
    extra = {"TORCH_CPP_LOG_LEVEL": "ERROR", **os.environ, **(env or {}), "OMP_NUM_THREADS": "1",
             "PYTHONUNBUFFERED": "1", **place.env}
    return AgentSpec(tuple(coordinator_command(place, layout, options)), extra, COORDINATOR_LABEL)


def elastic_agents(places: Sequence[NodePlace], layout: NodeLayout, script_args: Sequence[str], address: str,
                   options: ElasticOptions, env: Mapping[str, str] | None = None) -> list[AgentSpec]:
    """One torchrun job per node of ``layout`` (placed by ``places``), its ranks told the coordinator's
    ``address``; ``env`` adds variables for every rank (and overrides the defaults of
    :func:`~hsdp.tools.launch.local.agent_env`)."""
    assert len(places) == layout.nodes, (len(places), layout.nodes)
    width = len(f"node {layout.nodes - 1}") + 2
    base = agent_env(layout.world_size, width, env)
    return [AgentSpec(tuple([*place.prefix, *replica_command(n, options.max_restarts, script_args)]),
                      {**UNSHARED_STORE, **base, **place.env, **replica_env(address, i, options.job)}, f"node {i}")
            for i, (place, n) in enumerate(zip(places, layout.nprocs))]


def run_elastic(places: Sequence[NodePlace], layout: NodeLayout, script_args: Sequence[str], options: ElasticOptions,
                env: Mapping[str, str] | None = None,
                wrap: Callable[[list[AgentSpec]], list[AgentSpec]] = list) -> int:
    """Start the coordinator on ``places[0]``, then every node's job (``wrap`` may put them in cpu groups), and
    supervise them until every node has ended; the exit status (the first failed node's, 0 if none failed;
    1 when the coordinator cannot start or exits early; ``128 + n`` after signal ``n``)."""
    try:
        service, line = start_service(coordinator_spec(places[0], layout, options, env), ADDRESS_LINE,
                                      COORDINATOR_READY_S)
    except RuntimeError as e:
        print(f"hsdp launch: error: the elastic coordinator did not start: {e}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        return 130
    try:
        address = line[len(ADDRESS_LINE):].strip()
        agents = wrap(elastic_agents(places, layout, script_args, address, options, env))
        return Supervisor(agents, keep_going=True, services=[service]).run()
    finally:
        stop_groups([service.proc])  # already stopped by the supervisor, unless it never ran
