"""Handles of collectives in flight: waiting, booking the time, retiring them from the hang ledger.

``Comm`` (``collectives.py``) issues every collective and returns a :class:`Handle`; a call handed to the mesh's
hop worker returns a :class:`Chained`. A wait books its seconds to the collective's stats row, takes the
collective out of the hang ledger's pending set (also when it failed), then runs ``on_done``. On an elastic mesh a
wait in a gloo replicate group is *interruptible*: it gives up once the coordinator says a member is gone, because
gloo cannot abort a collective in flight. Never on NCCL, whose ``Work.wait(timeout)`` aborts the communicator once
the timeout has passed since the collective was enqueued (``Comm._interrupt``): there every wait is plain.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.profiler import record_function

from hsdp.engine.comm_stats import OpStats, recorded_event
from hsdp.engine.hop_worker import on_a_hop_worker

_INTERRUPT_SLICE = timedelta(seconds=0.25)  # how often an interruptible wait asks whether to give up


class Handle:
    """In-flight collectives. ``wait()`` is idempotent, books the elapsed time to the stats row, then runs
    ``on_done`` (e.g. decompress, cast back, or the post-division of an fp16 average). On CUDA with NCCL,
    waiting makes the current stream wait for the collective without blocking the host: with
    ``cuda_timed`` the time booked is then the span between a CUDA event recorded on the current stream
    at issue (the handle is built right after the collective is enqueued) and one recorded after the wait
    (see :class:`OpStats`); otherwise it is host time.
    """

    def __init__(self, work: dist.Work | None = None, stats: OpStats | None = None,
                 on_done: Callable[[], None] | None = None, after: list[Handle] | None = None,
                 region: str = "", retire: Callable[[Any], None] | None = None, cuda_timed: bool = False,
                 completion: Callable[[], Any] | None = None,
                 interrupt: Callable[[], str] | None = None, ready_when: Callable[[], bool] | None = None) -> None:
        self._work = work
        self._ready_when = ready_when  # what else :meth:`ready` needs (collectives issued elsewhere: a hop worker)
        self._interrupt = interrupt  # why to stop waiting ("" = keep waiting): elastic replicate groups
        # Takes the collective out of the ledger's pending set once waited: at once where the wait blocks until
        # it completed (gloo), or, given ``completion`` (CUDA: an event recorded on the waiting stream), when
        # that marker says so, so that a stuck NCCL collective stays pending for the hang watchdog.
        self._retire = retire
        self._completion = completion
        self._region = region  # the collective's profiler region; waiting shows as "<region> wait"
        self._stats = stats
        self._after = after or []
        # No clock under torch.compile (Dynamo would warn about, and break the graph at, perf_counter): the
        # runtime issues collectives only from hooks that run eagerly, so only user code tracing a Comm
        # call directly loses its seconds.
        self._start = None if torch.compiler.is_compiling() else time.perf_counter()
        self._start_event = recorded_event() if cuda_timed and stats is not None and self._start is not None \
            else None
        self._on_done = on_done
        self.done = work is None and on_done is None and not self._after

    def _wait_work(self) -> None:
        """``work.wait()``; with an interrupt (gloo only), in slices (a sliced gloo wait leaves the collective
        running), raising once the interrupt gives a reason while the collective is still incomplete."""
        work = self._work
        assert work is not None
        if self._interrupt is None:
            work.wait()
            return
        while True:
            try:
                work.wait(timeout=_INTERRUPT_SLICE)
                return
            except RuntimeError:
                if work.is_completed():
                    raise  # it ended in an error of its own (a closed connection)
                why = self._interrupt()
                if why:
                    raise RuntimeError(f"hsdp elastic: {why}") from None

    def _fail(self) -> None:
        """The collective raised (a peer left): it is no longer pending (the hang ledger must not report it) and
        its buffers are released; waiting again does nothing."""
        if self._retire is not None:
            self._retire(None)
        self.done = True
        self._work, self._after, self._on_done = None, [], None

    def book_blocked(self, since: float | None) -> None:
        """Book the host's time blocked since ``since`` (``perf_counter``; ``None``: nothing) as ``waited``
        on this collective: its own wait, or a wait for the hop worker to get past it (:class:`Chained`)."""
        if self._stats is not None and since is not None:
            self._stats.waited += time.perf_counter() - since

    def then(self, on_done: Callable[[], None]) -> Handle:
        """A handle that waits for this one, then runs ``on_done``."""
        return Handle(after=[self], on_done=on_done)

    @staticmethod
    def all(handles: list[Handle], on_done: Callable[[], None] | None = None) -> Handle:
        return Handle(after=handles, on_done=on_done)

    def ready(self) -> bool:
        """Whether :meth:`wait` would find every collective it waits for ended (completed or failed): a poll that
        never blocks, so the caller can act the moment a reduction is over instead of where it is waited. A
        handle whose ``on_done`` issues more collectives is ready only when given ``ready_when`` for those."""
        if self.done:
            return True
        if self._ready_when is not None and not self._ready_when():
            return False
        return all(h.ready() for h in self._after) and (self._work is None or self._work.is_completed())

    def wait(self) -> None:
        if self.done:
            return
        for h in self._after:
            h.wait()
        if self._work is not None:
            # A separate region: in a trace, the exposed (not overlapped) communication is the wait.
            with record_function(f"{self._region} wait" if self._region else "hsdp::wait"):
                # Exposed time is the host's compute blocked: a hop worker's waits are not (hop_worker.py).
                blocked = None if self._start is None or on_a_hop_worker() else time.perf_counter()
                try:
                    self._wait_work()
                except BaseException:
                    self._fail()
                    raise
                self.book_blocked(blocked)
        marker = None
        if self._stats is not None and self._start_event is not None:
            # After the wait: the current stream now waits for the collective, so this event completes
            # only once it has. No host synchronisation here: the pair is resolved when the stats are read.
            marker = recorded_event()
            self._stats.book_events(self._start_event, marker)
            self._start_event = None
        elif self._stats is not None and self._start is not None:
            self._stats.book(time.perf_counter() - self._start)
        if self._retire is not None:
            if marker is None and self._completion is not None and self._work is not None:
                marker = self._completion()
            self._retire(marker if self._completion is not None else None)
        self.done = True
        # A finished work still references its input and output buffers: drop it so they can be freed.
        self._work, self._after = None, []
        if self._on_done is not None:
            on_done, self._on_done = self._on_done, None
            on_done()


class Chained:
    """A call handed to the hop worker (:meth:`Comm.chain`). :meth:`wait` returns once it has run and
    re-raises its error; the host's time blocked there is booked as ``waited`` on ``blocked_on`` (the
    collective the call waits for), so exposed-communication figures stay those of the host."""

    def __init__(self, future: Future[None], blocked_on: Handle | None) -> None:
        self._future = future
        self._blocked_on = blocked_on

    def wait(self) -> None:
        since = None if self._future.done() else time.perf_counter()
        try:
            self._future.result()
        finally:
            if self._blocked_on is not None:
                self._blocked_on.book_blocked(since)
                self._blocked_on = None

    def settle(self) -> None:
        """Wait without raising (after an error elsewhere, whose report matters more)."""
        self._future.exception()

    def ready(self) -> bool:
        """Whether the call has run (never blocks)."""
        return self._future.done()


def completion_event() -> torch.cuda.Event:
    """An event on the current stream right after it was made to wait for a collective: it completes when the
    collective does (a wait on CUDA only enqueues; the host moves on)."""
    event = torch.cuda.Event()
    event.record()
    return event
