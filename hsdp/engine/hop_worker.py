"""The host's hop stream on CPUs: one thread that issues each inter-node hop right behind its own
reduce-scatter.

On CUDA the hop stream waits for a unit's reduce-scatter on the device while the host runs on (see
``runtime/streams.py``). On CPUs (gloo) a wait blocks the thread that makes it, so the main thread could
start a unit's hop only when it next reached the runtime, at the next unit's post_backward: a whole block's
backward after the reduce-scatter had finished, and the last unit's hop only at the end of backward, exposed
in full on a slow link. The worker instead waits for each reduce-scatter on its own thread and issues the
hop the moment it completes, while the main thread goes on with the backward.

Ordering, the one rule that makes a second issuing thread safe: collectives of one process group must be
issued in the same order on every rank. The main thread hands reductions over in program order, the worker
runs them in that order, and any collective the main thread issues on the inter-node group first waits
until the worker has issued everything handed over before (:meth:`HopWorker.drain`; ``Comm`` does this).
So the inter-node group's collectives keep program order on every rank. The worker only *issues*; the main
thread still waits for the hops and consumes their results, at the end of backward.

One worker per mesh (``HSDPMesh.hop_worker``): two models on one mesh share it, so their hops keep one order.
"""

from __future__ import annotations

import queue
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future

_THREAD = threading.local()


def on_a_hop_worker() -> bool:
    """Whether the calling thread is some mesh's hop worker: its waits do not hold up the host's compute."""
    return getattr(_THREAD, "is_worker", False)


class HopWorker:
    """A daemon thread running submitted calls one at a time, in submission order (started on first use,
    ended when the worker is garbage collected)."""

    def __init__(self, name: str = "hsdp-hops") -> None:
        self._name = name
        self._queue: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._last: Future[None] | None = None  # the latest submission: done means every earlier one is
        self._stopper: weakref.finalize | None = None

    def submit(self, fn: Callable[[], None]) -> Future[None]:
        """Run ``fn`` on the worker after everything submitted before. ``Future.result()`` re-raises what
        it raised, where the caller waits (a dead peer's error reaches the training loop, not this thread)."""
        future: Future[None] = Future()
        if self._thread is None:
            # A daemon: a hop stuck on a stopped peer must not keep the interpreter from exiting (the fault
            # watchdog ends such a process; without one, the process group's timeout does). The thread holds
            # the queue, not this object, so a mesh that is dropped ends its thread (the None sentinel).
            self._thread = threading.Thread(target=_run, args=(self._queue,), name=self._name, daemon=True)
            self._thread.start()
            self._stopper = weakref.finalize(self, _stop, self._queue, self._thread)  # also runs at exit
        self._last = future
        self._queue.put((fn, future))
        return future

    def on_worker(self) -> bool:
        """Whether the calling thread is this worker."""
        return self._thread is not None and threading.current_thread() is self._thread

    def drain(self) -> None:
        """Return once everything submitted so far has run (at once from the worker itself). Errors are
        left to the submitter's own ``result()``."""
        last = self._last
        if last is None or self.on_worker():
            return
        last.exception()  # waits; never raises the call's error here
        if self._last is last:
            self._last = None


_Item = tuple[Callable[[], None], "Future[None]"]


# How long exit waits for a hop still in flight (a stopped peer) before leaving the thread to its fate.
_STOP_TIMEOUT_S = 5.0


def _stop(items: queue.SimpleQueue[_Item | None], thread: threading.Thread) -> None:
    """End the thread and wait for it: run when the worker is collected, and at interpreter exit (a daemon
    thread still waking up while the interpreter finalizes is ended by pthread_exit, which aborts the process
    with "terminate called without an active exception" after all the work is done)."""
    items.put(None)
    if thread is not threading.current_thread():
        thread.join(timeout=_STOP_TIMEOUT_S)


def _run(items: queue.SimpleQueue[_Item | None]) -> None:
    _THREAD.is_worker = True
    while (item := items.get()) is not None:
        fn, future = item
        try:
            fn()
        except BaseException as exc:  # handed to the thread that waits for it
            future.set_exception(exc)
        else:
            future.set_result(None)
