"""Dead-rank detection: no rank waits forever on a peer that died.

A killed peer makes gloo raise in about a second, but only on the ranks in a collective with it; a peer
that is stuck (or stopped) blocks its partners until the process group timeout (30 minutes by default),
and the errors name addresses, never ranks. The watchdog closes both gaps with the rendezvous store:

* every rank bumps a heartbeat counter ``hsdp/hb/<rank>`` every ``interval`` seconds;
* every rank watches one neighbour (``rank + 1`` on a ring) and the shared key ``hsdp/failed``;
* a neighbour whose counter has not moved for ``timeout`` seconds, or an uncaught exception in this
  rank, is published in ``hsdp/failed``; every rank that sees it prints the message, naming the failed
  rank, and exits with :data:`EXIT_CODE` at once, even from inside a blocked collective.

So a failure anywhere ends every rank within about ``timeout + interval`` seconds, with O(1) store traffic
per rank. A rank that finishes normally marks ``hsdp/done/<rank>`` and is no longer watched.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType

import torch.distributed as dist

EXIT_CODE = 75
FAILED_KEY = "hsdp/failed"
# One watchdog per rendezvous store and process: a heartbeat thread is process-wide by nature, so this
# registry is the one module-level state in hsdp (keyed by the store, never read for ranks or groups).
_BY_STORE: dict[int, Watchdog] = {}


@dataclass(frozen=True)
class FaultPolicy:
    """``timeout``: seconds without a heartbeat before a rank is declared dead; ``interval``: beat period."""

    timeout: float = 45.0
    interval: float = 1.0

    def __post_init__(self) -> None:
        if not 0 < self.interval < self.timeout:
            raise ValueError(f"need 0 < interval < timeout, got interval={self.interval}, timeout={self.timeout}")


class Watchdog:
    """Heartbeat and failure propagation for one rank (one per process; see :func:`start_watchdog`)."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, policy: FaultPolicy) -> None:
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.policy = policy
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hsdp-watchdog", daemon=True)
        self._checks: list[Callable[[], str | None]] = []

    def add_check(self, check: Callable[[], str | None]) -> None:
        """Run ``check`` on the watchdog thread every ``interval`` (after the heartbeat): a returned message is
        a fatal failure of this rank, published to every rank, which all exit with :data:`EXIT_CODE`. For
        conditions the main thread cannot see while blocked (its launcher died, its run-directory lease was
        taken over). Must be quick and must not issue collectives."""
        self._checks.append(check)

    def start(self) -> None:
        self.store.add(f"hsdp/hb/{self.rank}", 1)
        self._thread.start()
        _chain_excepthook(self)
        atexit.register(self.mark_done)

    def mark_done(self) -> None:
        """This rank ends normally: stop beating and tell the watcher not to treat silence as death."""
        if self._stop.is_set():
            return
        self._stop.set()
        # Wait for the thread to leave any store call: a daemon thread still inside C++ when the interpreter
        # finalizes is ended by pthread_exit, which aborts the process ("terminate called without an active
        # exception") after all the work is done. Bounded: a store whose host is gone must not stall exit.
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * self.policy.interval)
        with contextlib.suppress(Exception):  # the store's host may be gone already at shutdown
            self.store.add(f"hsdp/done/{self.rank}", 1)

    def silent_ranks(self) -> list[int]:
        """Ranks (not done) whose heartbeat does not move over two intervals: the likely dead ones.
        Reads every rank's counter, so it is only called once a failure has happened."""
        keys = [r for r in range(self.world_size) if r != self.rank]
        try:
            first = [self.store.add(f"hsdp/hb/{r}", 0) for r in keys]
            time.sleep(2 * self.policy.interval)
            second = [self.store.add(f"hsdp/hb/{r}", 0) for r in keys]
            return [r for r, a, b in zip(keys, first, second, strict=True)
                    if a == b and not self.store.add(f"hsdp/done/{r}", 0)]
        except Exception:
            return []

    def linger(self) -> None:
        """Stay two beats after a failure: this process may host the store (rank 0 without torchrun),
        and the other ranks must still read ``hsdp/failed`` from it."""
        time.sleep(2 * self.policy.interval)

    def publish_failure(self, message: str) -> None:
        with contextlib.suppress(Exception):
            if not self.store.check([FAILED_KEY]):
                self.store.set(FAILED_KEY, message)

    # -- the thread ---------------------------------------------------------------------------------
    def _run(self) -> None:
        peer = (self.rank + 1) % self.world_size
        last_value, last_change = -1, time.monotonic()
        while not self._stop.wait(self.policy.interval):
            try:
                self.store.add(f"hsdp/hb/{self.rank}", 1)
                if self.store.check([FAILED_KEY]):
                    self._exit(self.store.get(FAILED_KEY).decode())
                self._run_checks()
                if peer == self.rank or self.store.add(f"hsdp/done/{peer}", 0):
                    continue
                value = self.store.add(f"hsdp/hb/{peer}", 0)
            except Exception:
                return  # the store is gone (its host exited): collectives will report the failure
            now = time.monotonic()
            if value != last_value:
                last_value, last_change = value, now
            elif now - last_change > self.policy.timeout:
                message = f"rank {peer} stopped responding (no heartbeat for {now - last_change:.0f} s)"
                self.publish_failure(message)
                self._exit(message)

    def _run_checks(self) -> None:
        for check in self._checks:
            message = check()
            if message:
                message = f"rank {self.rank}: {message}"
                self.publish_failure(message)
                self._exit(message)

    def _exit(self, message: str) -> None:
        if self._stop.is_set():
            return
        print(f"[hsdp rank {self.rank}] aborting: {message}", file=sys.stderr, flush=True)
        self.linger()
        os._exit(EXIT_CODE)  # the main thread may be blocked inside a collective: no clean unwinding


def _chain_excepthook(watchdog: Watchdog) -> None:
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        last = traceback.extract_tb(tb)[-1] if tb else None
        where = f" at {last.filename}:{last.lineno}" if last else ""
        raised = f"rank {watchdog.rank} raised {kind.__name__}: {str(value)[:300]}{where}"
        # A collective that fails because a peer died names an address, not the peer: name the rank.
        dead = watchdog.silent_ranks() if isinstance(value, RuntimeError) else []
        if dead:
            raised = f"rank(s) {dead} died (no heartbeat); {raised}"
        watchdog.publish_failure(raised)
        if dead:
            print(f"[hsdp rank {watchdog.rank}] aborting: {raised}", file=sys.stderr, flush=True)
        watchdog._stop.set()
        watchdog.linger()
        previous(kind, value, tb)

    sys.excepthook = hook


def start_watchdog(policy: FaultPolicy) -> Watchdog | None:
    """Start this process's watchdog on the default group's store (once); ``None`` if there is no store."""
    try:
        store = dist.distributed_c10d._get_default_store()
    except (RuntimeError, AttributeError, ValueError):
        return None
    if id(store) not in _BY_STORE:
        dog = Watchdog(store, dist.get_rank(), dist.get_world_size(), policy)
        dog.start()
        _BY_STORE[id(store)] = dog
    return _BY_STORE[id(store)]
