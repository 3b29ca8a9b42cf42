"""Batch weights that equalize the ranks' step times, from per-rank seconds measured at the same batch.

A rank that takes ``t_r`` seconds per step at the even batch ``b`` gets weight ``1 / t_r`` (normalised so the
slowest rank weighs 1, three significant digits: what ``parallel.batch_weights`` and
``hsdp.distributed_sampler(weights=)`` take). If a rank's time is proportional to its batch, the weighted split
``b_r = G w_r / sum w`` of the same global batch ``G`` then takes ``N / sum(1 / t)`` seconds on every rank (the
harmonic mean of the times) instead of ``max t``: :func:`expected_speedup`. What does not scale with the batch
(communication, the optimizer step, launch overheads) makes that an upper bound, and on a uniform machine the
weights are about 1 (the ranks' noise, rounded).

Which time a rank measures matters: wall time inside a step is paced by the slowest rank as soon as a collective
synchronises the ranks, so the times here are *busy* seconds (a step less the time the host was blocked in
collectives, measurable where a wait blocks the host: CPU ranks on gloo) or, on GPUs, forward+backward of the
unwrapped model timed on every rank at once (``hsdp.tools.planner.metrics.profile_ranks``). Pure Python.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# Per-rank times a metrics file may hold, best first: busy seconds of the measured steps (CPU), the compute
# profile's forward+backward per rank (any device), each rank's own wall seconds (synchronised: about even).
RANK_TIME_KEYS = ("busy_s_per_rank", "compute_s_per_rank", "step_s_per_rank")


def balanced_weights(seconds: Sequence[float], digits: int = 3) -> list[float]:
    """``weight_r = max(t) / t_r`` to ``digits`` significant digits, one per rank (the slowest weighs 1).
    ``ValueError`` for no times or a time that is not a finite positive number."""
    if not seconds:
        raise ValueError("no per-rank times to balance: measure at least one rank")
    bad = [t for t in seconds if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t)
           or t <= 0]
    if bad:
        raise ValueError(f"per-rank step times must be finite positive seconds, got {bad[:3]}: measure more steps "
                         f"(the warm-up is not timed)")
    slowest = max(seconds)
    return [float(f"{slowest / t:.{digits}g}") for t in seconds]


def expected_speedup(seconds: Sequence[float]) -> float:
    """Step time at the even split over the weighted split's, if a rank's time is proportional to its batch:
    ``max(t) x mean(1 / t)`` (1 when the ranks are equal)."""
    return max(seconds) * statistics.fmean(1 / t for t in seconds)


@dataclass(frozen=True)
class WeightProposal:
    """Weights for the ranks of measured runs: which per-rank time they come from (one of
    :data:`RANK_TIME_KEYS`), its median per rank over ``runs`` runs, the weights, each rank's peak memory."""

    source: str
    seconds: tuple[float, ...]
    weights: tuple[float, ...]
    runs: int
    peak_memory_bytes: tuple[float, ...] = ()

    @property
    def expected_speedup(self) -> float:
        return expected_speedup(self.seconds)

    def as_dict(self) -> dict[str, Any]:
        return {"source": self.source, "seconds_per_rank": list(self.seconds), "weights": list(self.weights),
                "runs": self.runs, "peak_memory_bytes_per_rank": list(self.peak_memory_bytes),
                "expected_speedup": self.expected_speedup}


def _per_rank_median(rows: Sequence[Sequence[float]]) -> tuple[float, ...]:
    return tuple(statistics.median(r[i] for r in rows) for i in range(len(rows[0])))


def propose_weights(runs: Sequence[dict[str, Any]]) -> WeightProposal | None:
    """Weights from the per-rank times of metrics files (``hsdp tune``'s runs of one layout, all at the same
    batch per rank): the first of :data:`RANK_TIME_KEYS` every run holds for all its ranks. ``None`` when no
    run has per-rank times (files from before they were recorded) or the runs disagree on the rank count."""
    ok = [r for r in runs if "error" not in r]
    for key in RANK_TIME_KEYS:
        rows = [r.get(key) for r in ok]
        if not rows or any(not row for row in rows) or len({len(row) for row in rows}) != 1:
            continue
        seconds = _per_rank_median(rows)
        memory = [r.get("peak_memory_bytes_per_rank") for r in ok]
        peaks = tuple(max(col) for col in zip(*memory)) if all(memory) and len({len(m) for m in memory}) == 1 else ()
        return WeightProposal(key, seconds, tuple(balanced_weights(seconds)), len(rows), peaks)
    return None
