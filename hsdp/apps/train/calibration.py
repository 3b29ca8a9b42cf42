"""``parallel.batch_weights = "auto"``: weights from the first steps' per-rank busy seconds at the even split.

Every rank times its first :data:`CALIBRATION_STEPS` training steps (real steps, at the even split): its wall
seconds less the seconds its host was blocked in the model's collectives (``exposed_comm_s``), i.e. the time
it computed. The first step is a warm-up (allocator, first collectives) and not counted; after the last, the
ranks gather their medians and every rank weighs ``slowest / own`` (:func:`hsdp.tools.planner.balance.
balanced_weights`), the same list everywhere. Measurable where a wait blocks the host (CPU ranks on gloo); on
GPUs the stream waits instead, so "auto" is refused there: give the weights of ``hsdp tune`` or ``hsdp plan``.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from hsdp.apps.train.ranks import RankChannel
from hsdp.tools.planner.balance import balanced_weights, expected_speedup

CALIBRATION_STEPS = 4  # one warm-up step, then three timed ones


@dataclass
class Calibration:
    """This rank's busy seconds of the calibration steps; :meth:`add` returns the weights once complete."""

    steps: int = CALIBRATION_STEPS
    busy: list[float] = field(default_factory=list)
    result: dict[str, Any] | None = None  # once done: busy seconds per rank, weights, the step they apply after

    @property
    def done(self) -> bool:
        return self.result is not None

    def add(self, step: int, seconds: float, waited: float | None, channel: RankChannel) -> list[float] | None:
        """Count one step (``waited``: its blocked seconds, ``None`` where unmeasured); after the last calibration
        step, a collective: every rank's median, and the weights (the same on every rank). Call it on every rank
        after every step until it returns the weights."""
        if waited is None:
            raise ValueError('parallel.batch_weights = "auto" times each rank\'s busy seconds, measured only where a '
                             "wait blocks the host (CPU ranks): give the weights as a list (hsdp tune, hsdp plan)")
        self.busy.append(max(seconds - waited, 1e-9))
        if len(self.busy) < self.steps:
            return None
        timed = self.busy[1:] if self.steps > 1 else self.busy  # the first step warms up
        per_rank = [float(x) for x in channel.gather(statistics.median(timed))]
        weights = balanced_weights(per_rank)
        self.result = {"steps": self.steps, "after_step": step, "busy_s_per_rank": per_rank, "weights": weights,
                       "expected_speedup": expected_speedup(per_rank)}
        return weights
