"""``--profile``: a ``torch.profiler`` trace of a few training steps on every rank.

Every collective hsdp issues is a labelled region (see ``hsdp.engine.collectives.profiler_region``):
``hsdp::all_gather[shard] Block(blocks.0)``, ``hsdp::reduce_scatter[shard] ...``,
``hsdp::all_reduce[replicate] blocks.0``, each followed by a ``... wait`` region where the rank waited for
it, so a trace shows which unit's communication overlapped compute and which was exposed. Traces are
chrome JSON, ``<run>/profile/rank<r>.json``: open them in Perfetto (ui.perfetto.dev) or
``chrome://tracing``.

Every thread is recorded: on CPUs the inter-node hops are issued from hsdp's hop worker thread
(``hsdp-hops``, see ``hsdp/engine/hop_worker.py``), which ``torch.profiler`` leaves out by default. In a
profiler of your own, pass ``experimental_config=torch._C._profiler._ExperimentalConfig(profile_all_threads=True)``
to see them.
"""

from __future__ import annotations

import os

import torch
from torch.profiler import ProfilerActivity, profile


def profile_window(start_step: int, end_step: int, steps: int) -> tuple[int, int]:
    """1-based ``(first, last)`` steps to record: skip the session's first step (allocations, warm-up)
    when there is room, never past ``end_step``."""
    first = start_step + 2 if end_step - start_step >= steps + 1 else start_step + 1
    return first, min(end_step, first + steps - 1)


class StepProfiler:
    """Records steps ``first..last`` when ``enabled``; call :meth:`before` and :meth:`after` around each
    step. The trace is written when ``last`` ends (or on :meth:`close`, if the run stops earlier)."""

    def __init__(self, enabled: bool, window: tuple[int, int], out_dir: str, rank: int) -> None:
        self.enabled = enabled
        self.first, self.last = window
        self.path = os.path.join(out_dir, f"rank{rank}.json")
        self._prof: profile | None = None

    def before(self, step: int) -> None:
        if self.enabled and step == self.first:
            activities = [ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(ProfilerActivity.CUDA)
            self._prof = profile(activities=activities, experimental_config=_all_threads())
            self._prof.start()

    def after(self, step: int) -> str | None:
        """The trace's path once it is written (at ``last``), else ``None``."""
        if self._prof is None or step != self.last:
            return None
        return self.close()

    def close(self) -> str | None:
        if self._prof is None:
            return None
        self._prof.stop()
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        self._prof.export_chrome_trace(self.path)
        self._prof = None
        return self.path


def _all_threads() -> torch._C._profiler._ExperimentalConfig:
    """Record the hop worker's regions too (the profiler's default is the thread that started it)."""
    return torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
