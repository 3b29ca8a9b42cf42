"""Stop a training job cleanly when the cluster asks: SIGTERM means "save and go", not "die now".

Schedulers preempt with SIGTERM and a grace period before SIGKILL (Slurm, Kubernetes; torchrun forwards
its own SIGTERM to the workers and waits ``--shutdown-timeout``, 30 s by default). :class:`StopSignals`
turns SIGTERM into a flag on the rank that received it; the ranks must then agree, because a scheduler may
signal only some of them and every rank has to stop after the same step to save a checkpoint together:

* :class:`PreemptionGuard` is for hand-written loops: ``guard.should_stop()`` is one tiny all-reduce over
  the world, true on every rank when any rank was signalled.
* ``hsdp train`` shares the flag inside the all-reduce it already does for the step's loss (no extra
  collective), saves a checkpoint after that step and exits with status 143 (128 + SIGTERM);
  ``hsdp train --resume`` continues exactly from there.

Repeated SIGTERMs while stopping are ignored (the launcher and the scheduler often both send one); what
ends a stuck job is the scheduler's SIGKILL. SIGINT (Ctrl-C) is left alone: it still aborts at once.
"""

from __future__ import annotations

import signal
from contextlib import ExitStack
from types import FrameType

import torch
import torch.distributed as dist

from hsdp.engine.collectives import Comm
from hsdp.engine.faults.signals import handle_signals
from hsdp.engine.mesh import HSDPMesh

STOP_EXIT_STATUS = 128 + signal.SIGTERM


class StopSignals:
    """While active (main thread only), SIGTERM sets :attr:`requested` instead of ending the process."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.requested = False
        self._handlers = ExitStack()  # holds the installed handler until __exit__

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.requested = True  # only a flag: the loop acts on it between steps

    def __enter__(self) -> StopSignals:
        if self.enabled:
            self._handlers.enter_context(handle_signals([signal.SIGTERM], self._handle))
        return self

    def __exit__(self, *exc: object) -> None:
        self._handlers.close()


class PreemptionGuard:
    """SIGTERM handling for a hand-written training loop on ``mesh``::

        with hsdp.PreemptionGuard(mesh) as guard:
            for step in range(start, steps):
                train_step()
                if guard.should_stop():             # a collective: every rank, same place
                    hsdp.save_checkpoint(run_dir, model, opt, extra={"step": step})
                    break
        if guard.stopped:
            sys.exit(hsdp.engine.preemption.STOP_EXIT_STATUS)

    ``should_stop`` costs one all-reduce of one element over the world (and, on a GPU, a host sync): call it
    every step, or every N steps when steps are very short; the grace period has to cover the steps in
    between plus the save. Without a signal it returns ``False`` everywhere and changes nothing.
    """

    def __init__(self, mesh: HSDPMesh) -> None:
        self.mesh = mesh
        self._comm = Comm(mesh)
        self._signals = StopSignals()
        self.stopped = False  # set once should_stop() has returned True

    @property
    def requested(self) -> bool:
        """Whether this rank received SIGTERM (the other ranks may not know yet)."""
        return self._signals.requested

    def should_stop(self) -> bool:
        """``True`` on every rank when any rank received SIGTERM. All ranks must call it together."""
        flag = torch.tensor([float(self.requested)], device=self.mesh.device)
        # MAX, not AVG: one signalled rank is enough; SUM-free so no overflow question.
        self._comm.all_reduce(flag, "world", op=dist.ReduceOp.MAX, label="preemption")
        self.stopped = self.stopped or bool(flag.item() > 0)
        return self.stopped

    def __enter__(self) -> PreemptionGuard:
        self._signals.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._signals.__exit__(*exc)
