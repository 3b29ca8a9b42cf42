"""Goodput: the expected fraction of wall time a job trains, given how often nodes fail and how it recovers.

Failures are a Poisson process in wall time: ``nodes`` failure domains, each failing once per ``node_mtbf_s`` on
average, so the job sees one every ``node_mtbf_s / nodes`` seconds. What a failure costs depends on the
recovery, one of three (each a small frozen policy):

:class:`CheckpointRestart` (every synchronous job: FSDP, plain HSDP)
    every rank stops, the job restarts and loads the last checkpoint, and redoes the work since it. The
    fraction is Daly's (2006) closed form for a checkpoint every ``interval_s`` of training that blocks for
    ``save_s`` and a restart of ``restart_s``, with failures during the restart and the redone work counted:
    ``interval / (e^(rate x restart) x (e^(rate x (interval + save)) - 1) / rate)``. To first order it is
    ``interval / (interval + save) x (1 - rate x (restart + (interval + save) / 2))``; the interval that
    maximizes it is near Young's ``sqrt(2 x save / rate)`` (:func:`young_interval`).
:class:`ElasticReplicas` (hsdp's elastic mesh, torchft, FT-HSDP)
    only the failed replica stops. Every replica pauses ``stall_s`` (until the failure is detected and the new
    quorum formed) and loses the step in flight (``step_s``); the failed replica is away ``rejoin_s`` (restart
    and heal from a live peer), its share of the capacity idle meanwhile. With ``q`` the replicas one node's
    failure takes down, each replica fails at ``rate x q`` and is away a fraction ``u = r J / (1 + r J)`` of
    the time (an alternating renewal: up ``1 / r`` on average, down ``J``), so
    ``fraction = (1 - rate x (stall + step)) x (1 - u)``.
:class:`ElasticDiLoCo` (hsdp's elastic DiLoCo, PRIME)
    replicas run ``phase_s`` of inner steps apart, and cross nodes only to sync: a failure stalls the others only
    when it hits a blocking sync (probability ``sync / (phase + sync)``: detection and a redo of the sync), and
    costs the failed replica its phase so far (``phase / 2`` on average) plus the wait for the next boundary after
    its restart (``phase / 2`` on average): it is away ``rejoin + phase`` per failure, same renewal as above.

Goodput here is relative to the same layout without failures: what the recovery loses, not what communication
or a slow node costs (the step time's business). ``fraction`` is exact for the formulas above; the
:class:`Goodput` breakdown (stalled, away, redone, saving) is its first-order split, which says where the time
goes. Not modelled: two failures overlapping in one replica, a failure that leaves fewer replicas than the job's
minimum (it then restarts from a checkpoint), failures of the coordinator or the checkpoint storage.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Failures:
    """``nodes`` failure domains, each failing once per ``node_mtbf_s`` seconds on average."""

    nodes: int
    node_mtbf_s: float

    def __post_init__(self) -> None:
        if self.nodes < 1 or not self.node_mtbf_s > 0:
            raise ValueError(f"Failures(nodes={self.nodes}, node_mtbf_s={self.node_mtbf_s}): give at least one node "
                             f"and a positive mean time between failures per node")

    @property
    def rate(self) -> float:
        """Failures per second of the whole job."""
        return self.nodes / self.node_mtbf_s

    @classmethod
    def observed(cls, nodes: int, failures: int, over_s: float) -> Failures:
        """The failure rate a job saw: ``failures`` interruptions over ``over_s`` seconds on ``nodes`` nodes."""
        return cls(nodes, nodes * over_s / failures)


@dataclass(frozen=True)
class CheckpointRestart:
    """Restart the whole job from the last checkpoint: one every ``interval_s`` of training, blocking
    ``save_s``; a restart (detect, reschedule, initialize, load) takes ``restart_s``."""

    interval_s: float
    save_s: float = 0.0
    restart_s: float = 600.0


@dataclass(frozen=True)
class ElasticReplicas:
    """Replicas leave and rejoin: ``replicas`` of them, ``per_failure`` taken down by one node's failure (1 when a
    replica spans one node or more; ``gpus_per_node / (S x T)`` when several share a node); the others pause
    ``stall_s`` and lose the step in flight (``step_s``); the failed one trains again after ``rejoin_s``."""

    replicas: int
    stall_s: float = 3.0
    step_s: float = 1.0
    rejoin_s: float = 60.0
    per_failure: int = 1


@dataclass(frozen=True)
class ElasticDiLoCo:
    """Elastic replicas syncing every ``phase_s`` (H inner steps); a sync blocks ``sync_s`` (0: overlapped,
    Streaming DiLoCo with a delay); ``stall_s`` is the detection before the survivors redo a sync a failure hit."""

    replicas: int
    phase_s: float
    sync_s: float = 0.0
    stall_s: float = 3.0
    rejoin_s: float = 60.0
    per_failure: int = 1


Recovery = CheckpointRestart | ElasticReplicas | ElasticDiLoCo


@dataclass(frozen=True)
class Goodput:
    """``fraction`` of wall time that trains, and its first-order split of the rest: every replica ``stalled``,
    capacity ``away`` (failed replicas restarting or waiting for a boundary, their lost work included),
    work ``redone`` after a restart, and time ``saving`` checkpoints."""

    fraction: float
    stalled: float = 0.0
    away: float = 0.0
    redone: float = 0.0
    saving: float = 0.0


def goodput(failures: Failures, recovery: Recovery) -> Goodput:
    """The expected fraction of wall time that trains under ``recovery`` (module docstring: the formulas)."""
    if isinstance(recovery, CheckpointRestart):
        return _checkpoint_restart(failures.rate, recovery)
    if recovery.replicas < 2:
        raise ValueError(f"{type(recovery).__name__} with {recovery.replicas} replica(s): a job with one replica "
                         f"has nobody to go on without it; use CheckpointRestart")
    if isinstance(recovery, ElasticReplicas):
        stall = failures.rate * (recovery.stall_s + recovery.step_s)
        return _elastic(failures.rate, recovery.replicas, recovery.per_failure, stall, recovery.rejoin_s)
    hit = recovery.sync_s / (recovery.phase_s + recovery.sync_s)
    stall = failures.rate * hit * (recovery.stall_s + recovery.sync_s)
    return _elastic(failures.rate, recovery.replicas, recovery.per_failure, stall,
                    recovery.rejoin_s + recovery.phase_s)


def _checkpoint_restart(rate: float, r: CheckpointRestart) -> Goodput:
    if not r.interval_s > 0 or r.save_s < 0 or r.restart_s < 0:
        raise ValueError(f"{r}: the checkpoint interval must be positive, the save and restart times not negative")
    segment = r.interval_s + r.save_s
    if rate == 0:
        return Goodput(r.interval_s / segment, saving=r.save_s / segment)
    wall = math.exp(rate * r.restart_s) * math.expm1(rate * segment) / rate  # Daly: expected wall time per segment
    useful = r.interval_s / segment
    return Goodput(r.interval_s / wall, stalled=useful * rate * r.restart_s, redone=useful * rate * segment / 2,
                   saving=r.save_s / segment)


def _elastic(rate: float, replicas: int, per_failure: int, stall: float, away_s: float) -> Goodput:
    """Every replica stalled a fraction ``stall``; each replica away ``away_s`` per failure that hits it."""
    if not 1 <= per_failure <= replicas:
        raise ValueError(f"per_failure={per_failure}: one node's failure takes down between 1 and all {replicas} "
                         f"replicas")
    hit = rate * per_failure / replicas  # failures per second of one replica
    away = hit * away_s / (1 + hit * away_s)
    running = max(0.0, 1 - stall)
    return Goodput(running * (1 - away), stalled=min(stall, 1.0), away=running * away)


def young_interval(save_s: float, failures: Failures) -> float:
    """Young's (1974) checkpoint interval, ``sqrt(2 x save / rate)``: near the one that maximizes goodput under
    :class:`CheckpointRestart` when saves are short against the time between failures."""
    return math.sqrt(2 * save_s / failures.rate)


def stall_for(fraction: float, failures: Failures) -> float:
    """The cost per failure (seconds of every rank's time) at which a job loses exactly ``1 - fraction`` of its
    wall time, to first order: how to read a published effective-training-time figure as a per-failure cost."""
    return (1 - fraction) / failures.rate
