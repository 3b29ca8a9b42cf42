"""What elastic replicas and their coordinator say to each other: store keys, quorums, decisions, timeouts.

The coordinator (``hsdp coordinator``, ``hsdp/tools/coordinator/server.py``) hosts a ``TCPStore`` and is the
only one that decides; replicas write requests and read decisions, all under one job prefix:

* ``reg/<id>/<incarnation>``: a replica started (its leader, local rank 0); ``inc/<id>`` counts incarnations
  (a torchrun restart, or a live replica the coordinator dropped registering again, is a new one).
  ``hb/<id>/<incarnation>/<rank>``: the heartbeat counter of each of its ranks, which the coordinator watches
  with its own clock (no clock is compared across hosts): a replica is alive while every rank beats, so a
  stopped or starved rank of any position costs the job one step, not the watchdog's bound;
  ``probe/<id>/<incarnation>/<rank>``: ``host:port`` of that rank's liveness port (``liveness.py``), which the
  coordinator connects to when a rank's reduction failed or a member is late for a step: refused, the process is
  gone and the replica is dropped at once (a slow or stopped rank still answers: the heartbeat judges those);
  ``done/<id>/<incarnation>/<rank>``: that rank ended normally (training finished), so its silence is no
  failure; a replica all of whose ranks did is *finished*;
* ``ready/<id>/<incarnation>``: its model and optimizer exist (a replica is admitted only then, so a member's
  heal never waits for a joiner's start-up); ``admit/<id>/<incarnation>``: the step the coordinator admits it
  at, or ``reject/...``: why not (the id is used by a live replica, even one not yet admitted; the replica has
  another rank count than the job's, or than its id's in a job of replicas of different degrees, or another
  tensor-parallel degree; the job stopped);
* ``want/<step>/<id>``: a member reached step ``step``; ``quorum/<step>``: the members of that step (JSON,
  :class:`Quorum`), published once every live member asked, or ``stop`` below the minimum;
* ``ok/<step>/<id>`` (a counter, one per rank) and ``fail/<step>``: each rank's vote on whether its
  inter-node reduction of the step completed; ``decision/<step>``: ``commit`` when every rank of every member
  voted ok, ``abort`` when one failed or a member died. Every rank applies the optimizer step only on commit,
  so no step is applied twice or by some replicas only;
* ``down/<epoch>``: a member of that epoch died or a rank's reduction failed: ranks still waiting in that epoch's
  groups give up at once (``handles.py``: gloo cannot abort a collective in flight);
* ``completed``: the last members left finished (the job is over, not lost): a replica arriving later (a restart
  still starting when training ended) is told so and ends cleanly
  (:class:`~hsdp.engine.replicate.elastic.client.JobCompleted`).

Pure data; the timeouts live in :class:`ElasticPolicy`, chosen so that inner ones are shorter than outer ones.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

COORDINATOR_ENV = "HSDP_COORDINATOR"  # host:port of the coordinator's store
REPLICA_ID_ENV = "HSDP_REPLICA_ID"  # this replica's stable id (hsdp launch: the node index)
JOB_ENV = "HSDP_ELASTIC_JOB"  # the job's key prefix on the coordinator (two jobs may share one coordinator)
COMMIT, ABORT, STOP = "commit", "abort", "stop"
COMPLETED = "completed"  # the job-level key the coordinator sets once the job is over (see the module docstring)


@dataclass(frozen=True)
class ElasticPolicy:
    """Timeouts of elastic training, in seconds, from the innermost out.

    ``heartbeat_interval``: how often each rank of a replica bumps its heartbeat; ``heartbeat_timeout``: silence
    of any of a replica's ranks after which the coordinator drops the replica (a SIGSTOPped rank too, whatever
    its position), and the others' collectives still waiting for it give up (a live replica dropped so, its
    heartbeat starved, registers again and is healed); ``hop_timeout``: the replicate groups' own timeout, the
    last resort when the coordinator itself is gone (below the watchdog's stuck-transport bound, twice
    ``FaultPolicy.timeout``, so the collective fails before the watchdog ends the replica); ``connect_timeout``:
    how long a rank tries to reach the coordinator before it raises naming the address; ``join_timeout``: how
    long a replica waits to be admitted (its ranks but the leader wait for the leader's answer that long, plus
    twice ``connect_timeout`` for the leader's own round trips: :attr:`leader_wait`). The watchdog's own timeout
    (``FaultPolicy.timeout``, 45 s) stays above all
    of them, so a dead peer replica costs a step, never the job.
    """

    heartbeat_interval: float = 0.25
    heartbeat_timeout: float = 3.0
    hop_timeout: float = 60.0
    connect_timeout: float = 10.0
    join_timeout: float = 300.0

    def __post_init__(self) -> None:
        if not 0 < self.heartbeat_interval < self.heartbeat_timeout:
            raise ValueError(f"need 0 < heartbeat_interval < heartbeat_timeout, got {self.heartbeat_interval} and "
                             f"{self.heartbeat_timeout}")
        if self.hop_timeout <= 0 or self.connect_timeout <= 0 or self.join_timeout <= 0:
            raise ValueError("elastic timeouts must be positive")

    @property
    def leader_wait(self) -> float:
        """How long a replica's other ranks wait for what its leader learns from the coordinator (registration,
        admission): the leader's own bound, ``join_timeout``, and its round trips to the coordinator."""
        return self.join_timeout + 2 * self.connect_timeout


@dataclass(frozen=True)
class Quorum:
    """The replicas that reduce together at ``step``: ``members`` (replica ids, sorted; their incarnations in
    ``incarnations``), of which ``joiners`` are new and are healed from ``source`` (a member that trained the
    previous step) before the step; ``epoch`` changes whenever the members do (the replicate groups are rebuilt
    under it). ``ranks``: each member's rank count (its torchrun job's world, tp ranks included), in member
    order: a job of replicas of different degrees reduces over the pieces of exactly these degrees."""

    step: int
    epoch: int
    members: tuple[int, ...]
    incarnations: tuple[int, ...]
    joiners: tuple[int, ...] = ()
    source: int | None = None
    ranks: tuple[int, ...] = ()

    def to_json(self) -> str:
        return json.dumps({"step": self.step, "epoch": self.epoch, "members": list(self.members),
                           "incarnations": list(self.incarnations), "joiners": list(self.joiners),
                           "source": self.source, "ranks": list(self.ranks)})

    @classmethod
    def from_json(cls, text: str) -> Quorum:
        d = json.loads(text)
        return cls(d["step"], d["epoch"], tuple(d["members"]), tuple(d["incarnations"]), tuple(d["joiners"]),
                   d["source"], tuple(d.get("ranks", ())))

    def index(self, replica_id: int) -> int:
        """This replica's rank in the quorum's groups (members in id order)."""
        return self.members.index(replica_id)


def key(job: str, *parts: object) -> str:
    """A store key under the job's prefix."""
    return "/".join(["hsdp", job, *map(str, parts)])
