"""What one training session produced: its per-step records (and from them this rank's traffic per step)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any


@dataclass
class LoopResult:
    """This session's steps: their records (every rank holds them) and this rank's traffic totals."""

    records: list[dict[str, Any]] = field(default_factory=list)
    checkpoints: list[str] = field(default_factory=list)
    checkpoint_step: int | None = None  # the step of the newest of ``checkpoints``
    trace: str | None = None
    stopped_by_signal: bool = False  # a rank got SIGTERM: every rank stopped after the last record's step
    batch: dict[str, Any] | None = None  # parallel.batch_weights: weights, sequences per rank, calibration
    quorum_lost: str = ""  # elastic: why the coordinator stopped the job below its minimum of replicas
    lost_at: int = 0  # ... and the last step finished then
    mean_bytes: bool = False  # DiLoCo: the inter-node bytes come as one spike every H steps; per step is their mean

    def add(self, record: dict[str, Any]) -> None:
        """Append a finished step's record."""
        self.records.append(record)

    def bytes_per_step(self, group: str) -> float:
        """This rank's bytes sent in ``group`` ("shard" or "replicate") per step: the median over the session's
        steps, the steady state (with ``mean_bytes``, the mean). (With the optimizer sharded across replicas a
        step's slice all-gathers partly run during the next step's forward: the first step counts fewer, and a
        mean would too.)"""
        values = [r[f"{group}_bytes"] for r in self.records]
        if not values:
            return 0.0
        return float(statistics.fmean(values) if self.mean_bytes else statistics.median(values))

    @property
    def steps(self) -> int:
        return len(self.records)

    @property
    def tokens(self) -> int:
        return sum(r["step_tokens"] for r in self.records)

    @property
    def seconds(self) -> float:
        return sum(r["step_s"] for r in self.records)
