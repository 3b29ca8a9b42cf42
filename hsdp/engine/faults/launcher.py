"""Ranks end with their launcher: no orphan keeps training and writing checkpoints on its own.

When the launcher of a rank, the process that started it (the torchrun agent, which ``hsdp launch`` and
``hsdp train`` run too; Slurm's step daemon under ``srun``), dies without stopping its workers -- SIGKILL,
an OOM kill of the agent, a crash -- the workers are re-parented and nothing tells them: their peers are
alive, so collectives keep working, and they would train and commit checkpoints next to the job that
replaces them. Two ways to notice:

* Linux: the kernel sends :data:`PARENT_DEATH_SIGNAL` when the parent exits (``prctl(PR_SET_PDEATHSIG)``).
  Its handler prints why and exits with :data:`EXIT_CODE` at once, between two Python instructions of the
  main thread: a save in progress commits nothing. Not SIGTERM: hsdp turns that into "checkpoint and stop"
  (``hsdp.engine.preemption``), and an orphan must not commit anything. Not SIGKILL: the rank would vanish
  without saying why. A real-time signal, which nothing else sends.
* Everywhere: a watchdog check compares ``os.getppid()`` with the parent recorded when hsdp was imported.
  It runs only while the watchdog's store answers: under torchrun the store lives in the agent and the
  watchdog thread stops with it, so there only the signal (Linux) ends an orphan.

The kernel also sends the signal when only the parent *thread* that started this process ends; the handler
then finds the same parent process and does nothing.
"""

from __future__ import annotations

import ctypes
import functools
import os
import signal
import sys
import threading
import weakref
from types import FrameType
from typing import TYPE_CHECKING

from hsdp.engine.faults.status import EXIT_CODE

if TYPE_CHECKING:
    from hsdp.engine.faults.watchdog import Watchdog

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
PARENT_DEATH_SIGNAL = signal.SIGRTMIN + 1 if hasattr(signal, "SIGRTMIN") else None
# Watchdogs already given the check: init_mesh may run several times in one process (one job after another).
_WATCHED: weakref.WeakSet[Watchdog] = weakref.WeakSet()


@functools.cache
def _parent_at_start(pid: int) -> int:
    return os.getppid()


def launcher_pid() -> int:
    """This process's parent when hsdp first looked (at import): its launcher. Keyed by pid, so a forked
    child records its own parent."""
    return _parent_at_start(os.getpid())


launcher_pid()  # record now, as close to the start of the process as hsdp gets


def orphan_message() -> str | None:
    """Why this rank must stop because its launcher is gone, or ``None`` while the launcher lives."""
    parent, now = launcher_pid(), os.getppid()
    if now == parent:
        return None
    return (f"its launcher (pid {parent}) is gone and this rank was left running under pid {now}: stopping "
            f"rather than training and writing checkpoints on its own; start the job again (--resume)")


def set_parent_death_signal(sig: int) -> bool:
    """Ask Linux to send ``sig`` to this process when its parent exits; ``False`` where there is no such
    request (other systems) or it failed."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _on_parent_death(rank: int, signum: int, frame: FrameType | None) -> None:
    message = orphan_message()
    if message is None:  # a parent thread ended, not the launcher (or someone sent the signal by hand)
        return
    print(f"[hsdp rank {rank}] aborting: {message}", file=sys.stderr, flush=True)
    os._exit(EXIT_CODE)  # no unwinding: nothing more may be written


def watch_launcher(watchdog: Watchdog | None) -> None:
    """End this rank when its launcher dies: the parent-death signal (Linux, main thread) and a check on
    ``watchdog``. Nothing when ``watchdog`` is ``None`` (fault handling is off) or its policy says
    ``watch_launcher=False``. Idempotent."""
    if watchdog is None or not watchdog.policy.watch_launcher:
        return
    if watchdog not in _WATCHED:
        _WATCHED.add(watchdog)
        watchdog.add_check(orphan_message)
    # A Python handler runs in the main thread only, and only the main thread may install one.
    if PARENT_DEATH_SIGNAL is None or threading.current_thread() is not threading.main_thread():
        return
    # For the rest of the process (a parent dies once), unlike the per-block handlers of faults.signals.
    signal.signal(PARENT_DEATH_SIGNAL, functools.partial(_on_parent_death, watchdog.rank))
    if set_parent_death_signal(PARENT_DEATH_SIGNAL):
        _on_parent_death(watchdog.rank, PARENT_DEATH_SIGNAL, None)  # the launcher may have died before the request
