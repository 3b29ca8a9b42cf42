"""Rank 0's progress display: a live bar with loss, tokens/s and ETA, or plain lines behind a pipe.

A terminal gets a rich progress bar. Behind a pipe (``hsdp train``'s own launcher and torchrun prefix
every output line, which cannot carry cursor movements) a line is printed every ``log_every`` steps
instead. Ranks other than 0 show nothing.
"""

from __future__ import annotations

import time
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)


def format_eta(seconds: float) -> str:
    """``1:02:03``, ``2:03`` or ``0:07``; ``?`` when unknown."""
    if seconds != seconds or seconds < 0:  # NaN or negative: no estimate yet
        return "?"
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class Reporter:
    """Progress of steps ``start_step + 1 .. steps`` (``start_step`` > 0 when resuming)."""

    def __init__(self, console: Console, steps: int, log_every: int, enabled: bool, start_step: int = 0) -> None:
        self.console = console
        self.steps = steps
        self.log_every = log_every
        self.enabled = enabled
        self.start_step = start_step
        self.live = enabled and console.is_terminal
        self._progress: Progress | None = None
        self._task: Any = None
        self._started = time.perf_counter()

    def __enter__(self) -> Reporter:
        self._started = time.perf_counter()
        if self.live:
            self._progress = Progress(
                TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]:.3f}"), TextColumn("{task.fields[tps]:,.0f} tok/s"),
                TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(), console=self.console)
            self._progress.start()
            self._task = self._progress.add_task("train", total=self.steps, completed=self.start_step,
                                                 loss=float("nan"), tps=0.0)
        return self

    def eta_seconds(self, step: int) -> float:
        """Remaining seconds at the average pace of this session's steps so far."""
        done = step - self.start_step
        if done <= 0:
            return float("nan")
        return (time.perf_counter() - self._started) / done * (self.steps - step)

    def update(self, step: int, loss: float, tokens_per_s: float) -> None:
        if not self.enabled:
            return
        if self._progress is not None:
            self._progress.update(self._task, completed=step, loss=loss, tps=tokens_per_s)
        elif step % self.log_every == 0 or step == self.steps or step == self.start_step + 1:
            self.console.print(f"step {step:>5}/{self.steps}  loss {loss:.3f}  {tokens_per_s:,.0f} tok/s  "
                               f"eta {format_eta(self.eta_seconds(step))}")

    def note(self, text: str) -> None:
        """A line above the bar (evaluation results, checkpoints, warnings)."""
        if self.enabled:
            self.console.print(text, markup=False)  # paths may contain "[...]"

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()
