"""Stop a training job cleanly when the cluster asks: SIGTERM means "save and go", not "die now".

Schedulers preempt with SIGTERM and a grace period before SIGKILL (Slurm, Kubernetes; torchrun forwards
its own SIGTERM to the workers and waits 30 s). Inside the training loop :class:`StopSignals` turns
SIGTERM into a request; the loop shares the request with every rank inside the all-reduce it already does
for the step's loss (no extra collective), so all ranks stop after the same step, save a checkpoint there
and exit with status 143 (128 + SIGTERM). ``hsdp train --resume`` continues exactly from that step.

Repeated SIGTERMs while stopping are ignored (the launcher and the scheduler often both send one); what
ends a stuck job is the scheduler's SIGKILL. SIGINT (Ctrl-C) is left alone: it still aborts at once.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

STOP_EXIT_STATUS = 128 + signal.SIGTERM


class StopSignals:
    """While active (main thread only), SIGTERM sets :attr:`requested` instead of ending the process."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.requested = False
        self._previous: Any = None
        self._installed = False

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.requested = True  # only a flag: the loop acts on it between steps

    def __enter__(self) -> StopSignals:
        # Python delivers signals to the main thread only; elsewhere there is nothing to install.
        if self.enabled and threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)
            self._installed = True
        return self

    def __exit__(self, *exc: object) -> None:
        if self._installed:
            signal.signal(signal.SIGTERM, self._previous)
            self._installed = False
