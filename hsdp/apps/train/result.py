"""What one training session produced: its per-step records and this rank's traffic totals."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class LoopResult:
    """This session's steps: their records (every rank holds them) and this rank's traffic totals."""

    records: list[dict[str, Any]] = field(default_factory=list)
    checkpoints: list[str] = field(default_factory=list)
    checkpoint_step: int | None = None  # the step of the newest of ``checkpoints``
    shard_bytes: float = 0.0  # this rank's, summed over the session's steps
    replicate_bytes: float = 0.0
    trace: str | None = None
    stopped_by_signal: bool = False  # a rank got SIGTERM: every rank stopped after the last record's step

    def add(self, record: dict[str, Any]) -> None:
        """Append a finished step's record and count its traffic."""
        self.records.append(record)
        self.shard_bytes += record["shard_bytes"]
        self.replicate_bytes += record["replicate_bytes"]

    @property
    def steps(self) -> int:
        return len(self.records)

    @property
    def tokens(self) -> int:
        return sum(r["step_tokens"] for r in self.records)

    @property
    def seconds(self) -> float:
        return sum(r["step_s"] for r in self.records)
