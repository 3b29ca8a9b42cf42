"""The job's verdict on a fault: published once, read by every rank before any rank exits.

The first failure a rank publishes (``hsdp/failed``: a dead or stopped peer, a hang report, an uncaught
exception, a failed local check) is the job's verdict; later ones are dropped (``compare_set``), so every rank
prints the same cause. A rank ends for it one way, whichever thread learns it first (the watchdog's beat or a
local check, the main thread's uncaught exception): it prints the verdict, *settles* (``hsdp/failed/settled``
counts the ranks that have it), stays until every rank has settled, then exits with ``EXIT_CODE``.

[Note: no rank leaves before every rank has the verdict]
A rank's exit closes its sockets: a peer blocked with it in a gloo collective raises "Connection closed by
peer" at once, an error that names an address. Were the verdict still unread there (its watchdog thread busy
with a diagnosis of its own, or starved of the CPU), that peer ended on the transport's error without naming
the culprit; and where the exiting rank hosts the store (rank 0 without torchrun's agent), nobody could read
the verdict any more. So a rank settles only once it has printed the verdict, and leaves only once every rank
has settled. Ranks that will never read it are settled for them: a rank finishing normally settles at exit, a
rank found silent (no heartbeat: dead or stopped) is settled by whoever found it; one that is neither costs
at most ``SETTLE_BEATS`` beats. And an uncaught exception reads the verdict before anything else: an error
raised after the verdict was published (a collective broken by a rank that left when the bound passed, or
by a death) follows from it, and the rank ends with the verdict.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from types import TracebackType
from typing import NoReturn

import torch.distributed as dist

from hsdp.engine.faults.status import EXIT_CODE

FAILED_KEY = "hsdp/failed"
SETTLED_KEY = "hsdp/failed/settled"
# How long a rank waits for the others to settle: above the longest a live rank's watchdog goes without
# reading the store (one beat plus a hang diagnosis: two beats of heartbeat reads, three for stacks).
SETTLE_BEATS = 10

ExceptHook = Callable[[type[BaseException], BaseException, TracebackType | None], object]


class Verdict:
    """One rank's side of the job's verdict (see the module docstring)."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, interval: float) -> None:
        self.store, self.rank, self.world_size, self.interval = store, rank, world_size, interval
        self._lock = threading.Lock()
        self._claimed = False  # a thread of this rank is ending it (see claim)
        self.reporter = False  # this rank diagnosed the failure and prints the full report

    def publish(self, message: str) -> bool:
        """Publish ``message`` as the job's verdict unless one is published already; whether it was."""
        with contextlib.suppress(Exception):
            # compare_set: only the first failure is kept, even when several ranks publish at once.
            return self.store.compare_set(FAILED_KEY, "", message).decode() == message
        return False

    def read(self) -> str:
        """The published verdict; ``""`` when there is none, or no store to ask."""
        with contextlib.suppress(Exception):
            if self.store.check([FAILED_KEY]):
                return self.store.get(FAILED_KEY).decode()
        return ""

    def settle(self, rank: int) -> None:
        """``rank`` has the verdict, or never will read it (it finished, it is dead): nobody waits for it."""
        with contextlib.suppress(Exception):
            if self.store.add(f"{SETTLED_KEY}/{rank}", 1) == 1:  # counted once, whoever settles it
                self.store.add(SETTLED_KEY, 1)

    def claim(self) -> bool:
        """Whether the calling thread is the one to end this rank (the first to ask): the others leave it be."""
        with self._lock:
            claimed, self._claimed = self._claimed, True
        return not claimed

    def say(self, message: str) -> None:
        """Print ``message`` as this rank's reason to abort (a report's first line unless this rank made it)."""
        if "\n" in message and not self.reporter:  # one full report per job, from the rank that made it
            message = message.splitlines()[0] + " (full report in the output of the rank that detected it)"
        print(f"[hsdp rank {self.rank}] aborting: {message}", file=sys.stderr, flush=True)

    def hold(self) -> None:
        """Settle, then stay until every rank has settled (at most ``SETTLE_BEATS`` beats, and never on a store
        that stopped answering): see [Note: no rank leaves before every rank has the verdict]."""
        self.settle(self.rank)
        deadline = time.monotonic() + SETTLE_BEATS * self.interval
        try:
            while self.store.add(SETTLED_KEY, 0) < self.world_size and time.monotonic() < deadline:
                time.sleep(self.interval / 4)
        except Exception:
            # The store's host is gone (the launcher's agent died): nobody can read the verdict any more. Two beats
            # still, so that the main thread's own ending (the launcher's parent-death signal) is not cut short.
            time.sleep(min(2 * self.interval, max(0.0, deadline - time.monotonic())))

    def end(self, message: str, *, store: bool = True) -> NoReturn:
        """Print ``message``, hold (``store=False``: the store does not answer), and exit with ``EXIT_CODE``
        at once: the main thread may be blocked inside a collective, so no clean unwinding."""
        self.say(message)
        if store:
            self.hold()
        os._exit(EXIT_CODE)

    def await_end(self) -> None:
        """Block while another thread of this rank ends it (it exits the process); bounded, for safety."""
        time.sleep((SETTLE_BEATS + 4) * self.interval)


def chain_excepthook(verdict: Verdict, peer_cause: Callable[[TracebackType | None], str],
                     stop: Callable[[], None]) -> None:
    """Make an uncaught exception of this rank end it through the verdict: the published verdict first (the
    error follows from it); else the error is published as the job's verdict, completed by ``peer_cause``
    (a collective that failed because a peer died or left names an address, not the peer), every rank is
    held to read it, then ``stop`` ends the watchdog and the previous hook prints the traceback."""
    previous: ExceptHook = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        if not verdict.claim():  # this rank's watchdog is ending it already: the verdict is printed there
            verdict.await_end()
        elif published := verdict.read():
            _end_after(verdict, published, kind, value)
        else:
            last = traceback.extract_tb(tb)[-1] if tb else None
            where = f" at {last.filename}:{last.lineno}" if last else ""
            raised = f"rank {verdict.rank} raised {kind.__name__}: {str(value)[:300]}{where}"
            cause = peer_cause(tb) if isinstance(value, RuntimeError) else ""
            if cause:
                raised = f"{cause}; {raised}"
            if not verdict.publish(raised) and (published := verdict.read()):
                _end_after(verdict, published, kind, value)  # another rank's verdict came first
            if cause:
                verdict.say(raised)
            verdict.hold()
            stop()
        previous(kind, value, tb)

    sys.excepthook = hook


def _end_after(verdict: Verdict, published: str, kind: type[BaseException], value: BaseException) -> NoReturn:
    """End with the job's verdict, naming this rank's own error as what followed from it."""
    first = str(value).splitlines()[0][:200] if str(value) else ""
    print(f"[hsdp rank {verdict.rank}] {kind.__name__} after the job's failure was published (it follows from "
          f"it): {first}", file=sys.stderr, flush=True)
    verdict.end(published)
