"""What one ``hsdp coordinator`` serves, checked before anything starts (no torch: the launcher checks it too).

The coordinator's own timing is one number, ``heartbeat_timeout``: the silence after which it drops a
replica. It must exceed the replicas' heartbeat interval
(:class:`~hsdp.engine.replicate.elastic.protocol.ElasticPolicy`, 0.25 s by default), which the replicas
choose themselves.
"""

from __future__ import annotations

from dataclasses import dataclass

from hsdp.engine.replicate.elastic.protocol import ElasticPolicy

DEFAULT_JOB = "default"  # what the replicas assume without HSDP_ELASTIC_JOB
ANY_HOST = ("0.0.0.0", "::", "")  # listen addresses that say nothing about how others reach this machine
ADDRESS_LINE = "HSDP_COORDINATOR="  # the printed line that gives the address to export


def majority(replicas: int) -> int:
    """The default minimum of live replicas: more than half, so two halves of a split job never both go on."""
    return replicas // 2 + 1


def check_replicas(replicas: int, min_replicas: int | None, flag: str = "--replicas") -> int:
    """The minimum of live replicas for ``replicas`` configured ones (``min_replicas``, default a majority);
    ``ValueError`` naming the fix for a count below 1 or a minimum outside ``1..replicas``."""
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise ValueError(f"{flag} {replicas!r}: an elastic job needs at least 1 replica")
    minimum = majority(replicas) if min_replicas is None else min_replicas
    if isinstance(minimum, bool) or not isinstance(minimum, int) or not 1 <= minimum <= replicas:
        raise ValueError(f"--min-replicas {min_replicas!r}: give a count in 1..{replicas} (the replicas that must "
                         f"stay alive for the job to go on; default: a majority, {majority(replicas)})")
    return minimum


@dataclass(frozen=True)
class CoordinatorConfig:
    """One coordinator: the store on ``port`` (0: a free one, printed), printed as reachable at ``host``,
    deciding for ``replicas`` replica ids of ``job`` with at least ``min_replicas`` alive (default: a
    majority); ``start_grace`` seconds at step 0 to wait for every replica before starting with the minimum;
    ``linger`` seconds to serve on once the job completed (its last members finished), telling replicas that
    arrive late (a restart still starting) that the job is over, so they end cleanly; ``inf``: until stopped
    (``hsdp launch --elastic`` stops it once every node ended). ``nproc_per_replica``: each replica id's rank
    count, for replicas of different shard degrees (``None``: every replica has the first quorum's count).

    ``ValueError`` naming the fix for a port outside 0..65535, a bad count or minimum, an empty job name or
    one with ``/``, a timeout that is not positive, a negative linger, rank counts that are not one positive
    count per replica."""

    port: int
    replicas: int
    host: str = "0.0.0.0"
    min_replicas: int | None = None
    job: str = DEFAULT_JOB
    heartbeat_timeout: float = ElasticPolicy.heartbeat_timeout
    start_grace: float = 10.0
    linger: float = 5.0
    nproc_per_replica: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        counts = self.nproc_per_replica
        if counts is not None and (len(counts) != self.replicas or min(counts) < 1):
            raise ValueError(f"--nproc-per-replica {','.join(map(str, counts))}: give one rank count >= 1 per "
                             f"replica id 0..{self.replicas - 1}, e.g. 2,1,1 for three replicas of 2, 1 and 1 ranks")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port {self.port}: give a TCP port in 1..65535, or 0 for a free one")
        object.__setattr__(self, "min_replicas", check_replicas(self.replicas, self.min_replicas))
        if not self.job or "/" in self.job:
            raise ValueError(f"--job {self.job!r}: give a non-empty name without '/' (the replicas' HSDP_ELASTIC_JOB)")
        if not self.heartbeat_timeout > 0:
            raise ValueError(f"--heartbeat-timeout {self.heartbeat_timeout}: give a positive number of seconds")
        if not self.start_grace >= 0:
            raise ValueError(f"--start-grace {self.start_grace}: give a number of seconds, at least 0")
        if not self.linger >= 0:
            raise ValueError(f"--linger {self.linger}: give a number of seconds, at least 0 (inf: until stopped)")

    def policy(self) -> ElasticPolicy:
        """The coordinator's policy: only ``heartbeat_timeout`` matters to it (the interval is the replicas')."""
        return ElasticPolicy(heartbeat_interval=min(ElasticPolicy.heartbeat_interval, self.heartbeat_timeout / 2),
                             heartbeat_timeout=self.heartbeat_timeout)
