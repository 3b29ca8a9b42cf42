"""Dead-rank detection: no rank waits forever on a peer that died.

A killed peer makes gloo raise in about a second, but only on the ranks in a collective with it; a peer
that is stuck (or stopped) blocks its partners until the process group timeout (30 minutes by default),
and the errors name addresses, never ranks. The watchdog closes both gaps with the rendezvous store:

* every rank bumps a heartbeat counter ``hsdp/hb/<rank>`` every ``interval`` seconds;
* every rank watches one neighbour (``rank + 1`` on a ring) and the shared key ``hsdp/failed``;
* a neighbour whose counter has not moved for ``timeout`` seconds, or an uncaught exception in this
  rank, is published in ``hsdp/failed`` (the job's verdict, ``verdict.py``); every rank that sees it prints
  the message, naming the failed rank, and exits with :data:`EXIT_CODE`, even from inside a blocked
  collective, once every rank has read it.

So a failure anywhere ends every rank within about ``timeout + interval`` seconds (and the hold while the
others read the verdict, a few beats at most), with O(1) store traffic per rank. A rank that finishes
normally marks ``hsdp/done/<rank>`` and is no longer watched.

The store work runs on a thread of its own: a store call whose host is stopped rather than dead (rank 0
under SIGSTOP or hung: its sockets stay open, nothing answers) never returns, so the watchdog thread times
each beat's store work and ends the rank when the store has not answered for about ``timeout``.

Hangs without a death (``detect_hangs``): every rank also publishes its collective ledger once per beat
(``hsdp/prog/<rank>``, see ``ledger.py``). A rank whose oldest unfinished collective has waited longer than
``timeout`` reads every rank's ledger, asks the late ranks for their Python stack (``hsdp/stackreq/<rank>``,
answered by their watchdog thread, so a rank stuck in Python, I/O or another library's collective still
answers), and publishes a report naming the late, mismatched or exited ranks, the collective, and the likely
cause (``hang.py``); every rank then exits as above.

Hangs in collectives hsdp does not issue (DTensor's ``full_tensor()``, a user's ``dist.all_reduce``, a
barrier): the watchdog also samples where the main thread is once per beat (``stacks.py``) and publishes it
with the ledger. A rank blocked in one such collective for ``timeout`` judges the others (``foreign.py``):
when every live rank has sat as long in a collective, not all in the same one, or has exited, the job
ends with a report as above; ranks all in the same call, or any rank working outside a collective, do not.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import sys
import threading
import time
from collections.abc import Callable
from types import TracebackType

import torch.distributed as dist

from hsdp.engine.faults.foreign import foreign_report, judge_foreign, working_notice
from hsdp.engine.faults.hang import judge, report, stuck_transport
from hsdp.engine.faults.ledger import CollectiveLedger, Entry
from hsdp.engine.faults.policy import FaultPolicy
from hsdp.engine.faults.stacks import MainThreadSampler, describe_record, main_thread_stack, raised_in_collective
from hsdp.engine.faults.verdict import FAILED_KEY, Verdict, chain_excepthook

# One watchdog per rendezvous store and process: a heartbeat thread is process-wide by nature, so this
# registry is the one module-level state in hsdp (keyed by the store, never read for ranks or groups).
_BY_STORE: dict[int, Watchdog] = {}


class Watchdog:
    """Heartbeat and failure propagation for one rank (one per process; see :func:`start_watchdog`)."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, policy: FaultPolicy) -> None:
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.policy = policy
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hsdp-watchdog", daemon=True)
        self._store_thread = threading.Thread(target=self._beat_store, name="hsdp-watchdog-store", daemon=True)
        self._in_store_since: float | None = None  # when the store thread's current beat began (None: between)
        self._checks: list[Callable[[], str | None]] = []
        self.ledger = CollectiveLedger()  # filled by every Comm on a mesh carrying this watchdog
        self._published: tuple | None = None
        self._stack_requests = 0  # requests for this rank's stack answered so far
        self._next_hang_check = 0.0
        self.sampler = MainThreadSampler()  # where the main thread is, once per beat (foreign collectives)
        self._next_foreign_check = 0.0
        self._noticed = -1  # Where.moves of the foreign wait already given a "presumed working" notice
        self.verdict = Verdict(store, rank, world_size, policy.interval)  # how this rank ends on a fault
        self._arrivals: dict[str, int] = {}  # calls of each collective helper so far (see arrive)

    def add_check(self, check: Callable[[], str | None]) -> None:
        """Run ``check`` on the watchdog thread every ``interval`` (after the heartbeat): a returned message is
        a fatal failure of this rank, published to every rank, which all exit with :data:`EXIT_CODE`. For
        conditions the main thread cannot see while blocked (its launcher died, its run-directory lease was
        taken over). Must be quick and must not issue collectives."""
        self._checks.append(check)

    def start(self) -> None:
        self.store.add(f"hsdp/hb/{self.rank}", 1)
        self._publish()
        self._thread.start()
        chain_excepthook(self.verdict, self.peer_cause, self._stop.set)
        atexit.register(self.mark_done)

    def mark_done(self) -> None:
        """This rank ends normally: stop beating and tell the watcher not to treat silence as death."""
        if self._stop.is_set():
            return
        self._stop.set()
        # Wait for the thread to leave any store call: a daemon thread still inside C++ when the interpreter
        # finalizes is ended by pthread_exit, which aborts the process ("terminate called without an active
        # exception") after all the work is done. A loaded machine can hold a beat's store work for seconds;
        # bounded all the same, since a store whose host is stopped never answers and must not stall exit long.
        deadline = time.monotonic() + max(2 * self.policy.interval, self.policy.timeout / 4)
        for thread in (self._thread, self._store_thread):
            while thread.is_alive() and thread is not threading.current_thread() and time.monotonic() < deadline:
                thread.join(timeout=self.policy.interval)
        with contextlib.suppress(Exception):  # the store's host may be gone already at shutdown
            self.store.add(f"hsdp/done/{self.rank}", 1)
        self.verdict.settle(self.rank)  # a failure published later is none of this rank's: nobody waits for it

    def silent_ranks(self) -> list[int]:
        """Ranks (not done) whose heartbeat does not move over two intervals: the likely dead ones, settled for
        (they will not read the verdict, see ``verdict.py``). Reads every rank's counter, so it is only called
        once a failure has happened."""
        keys = [r for r in range(self.world_size) if r != self.rank]
        try:
            first = [self.store.add(f"hsdp/hb/{r}", 0) for r in keys]
            self._pause(2 * self.policy.interval)
            second = [self.store.add(f"hsdp/hb/{r}", 0) for r in keys]
            silent = [r for r, a, b in zip(keys, first, second, strict=True)
                      if a == b and not self.store.add(f"hsdp/done/{r}", 0)]
        except Exception:
            return []
        for r in silent:
            self.verdict.settle(r)
        return silent

    def _pause(self, seconds: float) -> None:
        """Sleep while beating: a rank busy judging the others (this thread holds up its beats) must not look
        dead to them."""
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            time.sleep(min(left, self.policy.interval / 2))
            self.store.add(f"hsdp/hb/{self.rank}", 1)

    def peer_cause(self, tb: TracebackType | None = None) -> str:
        """Why a collective of this rank failed, when a peer is to blame: dead ranks (silent heartbeat) or
        ranks that already exited normally, and the collective this rank was in; ``""`` otherwise."""
        dead, gone = self.silent_ranks(), []
        with contextlib.suppress(Exception):
            gone = [r for r in range(self.world_size) if r != self.rank and self.store.add(f"hsdp/done/{r}", 0)]
        where = self._where_failed(tb)
        parts = []
        if dead:
            parts.append(f"rank(s) {dead} died (no heartbeat)")
        if gone:
            parts.append(f"rank(s) {gone} exited normally{where}: every rank must run the same steps and "
                         f"collectives")
        elif dead and where:
            parts[-1] += where
        return "; ".join(parts)

    def _where_failed(self, tb: TracebackType | None) -> str:
        """`` while rank R was in <collective>``: hsdp's pending one, else the foreign one the error came from
        (``tb``) or the last beat saw, else hsdp's last; ``""`` if none."""
        main = self.sampler.where
        foreign = raised_in_collective(tb) or (describe_record(main.record(0.0)) if main and main.blocked else "")
        entry = self.ledger.oldest_pending()
        if entry is None and not foreign and self.ledger.recent:
            entry = self.ledger.recent[-1]
        what = entry.describe() if entry is not None else foreign
        return f" while rank {self.rank} was in {what}" if what else ""

    # -- the thread ---------------------------------------------------------------------------------
    def _run(self) -> None:
        """The local checks and the store's answers, every beat; the store work on a thread of its own, since a
        store call whose host is stopped (not dead: its sockets stay open) never returns."""
        self._store_thread.start()
        while not self._stop.wait(self.policy.interval):
            self._run_checks()  # without the store: they matter most when its host is gone
            self._check_store_answers()

    def _check_store_answers(self) -> None:
        since = self._in_store_since
        waited = time.monotonic() - since if since is not None else 0.0
        # Above the longest store work of a beat: a hang diagnosis reads every rank and waits for stacks.
        if waited > self.policy.timeout + 6 * self.policy.interval:
            self._exit(f"the job's store has not answered for {waited:.0f} s: the process hosting it (rank 0, or "
                       f"the launcher's agent) is stopped or hung, so no rank can go on", store=False)

    def _beat_store(self) -> None:
        peer = (self.rank + 1) % self.world_size
        last_value, last_change = -1, time.monotonic()
        while not self._stop.wait(self.policy.interval):
            self._in_store_since = time.monotonic()
            try:
                value = self._store_beat(peer)
            except Exception:
                return  # its host exited: collectives report the failure; the local checks go on
            finally:
                self._in_store_since = None
            if value is None:
                continue
            now = time.monotonic()
            if value != last_value:
                last_value, last_change = value, now
            elif now - last_change > self.policy.timeout:
                message = f"rank {peer} stopped responding (no heartbeat for {now - last_change:.0f} s)"
                self.verdict.settle(peer)
                self.verdict.publish(message)
                self._exit(self.verdict.read() or message)

    def _store_beat(self, peer: int) -> int | None:
        """One beat's store work: this rank's heartbeat, the job's failure, hang detection; the watched peer's
        heartbeat counter (``None`` when there is no peer to watch)."""
        self.store.add(f"hsdp/hb/{self.rank}", 1)
        if self.store.check([FAILED_KEY]):
            self._exit(self.store.get(FAILED_KEY).decode())
        if self.policy.detect_hangs:
            self._publish()
            self._answer_stack_request()
            self._check_hang()
            self._check_foreign()
        if peer == self.rank or self.store.add(f"hsdp/done/{peer}", 0):
            return None
        return self.store.add(f"hsdp/hb/{peer}", 0)

    # -- hang detection --------------------------------------------------------------------------------
    def _publish(self) -> None:
        """This rank's ledger snapshot to the store: one set per beat, and only when it changed."""
        self.sampler.sample()
        snap = self._my_snapshot()
        main = self.sampler.where
        # Where the main thread is matters to the others only as its API and whether (since when) it is blocked.
        key = (snap["seq"], snap["waiting"] and snap["waiting"][0], snap["busy"] and snap["busy"][0],
               main and (main.entry, main.blocked and main.still_since))
        if key != self._published:
            self.store.set(f"hsdp/prog/{self.rank}", json.dumps(snap))
            self._published = key

    def _my_snapshot(self) -> dict:
        """The ledger's snapshot, where the main thread was at the last beat, and the wall time."""
        main = self.sampler.where
        return {**self.ledger.snapshot(), "main": main and main.record(time.monotonic()), "t": time.time()}

    def _answer_stack_request(self) -> None:
        asked = self.store.add(f"hsdp/stackreq/{self.rank}", 0)
        if asked > self._stack_requests:
            self._stack_requests = asked
            self.store.set(f"hsdp/stack/{self.rank}/{asked}", main_thread_stack())

    def _check_hang(self) -> None:
        oldest = self.ledger.oldest_pending()
        now = time.monotonic()
        if oldest is None or now < self._next_hang_check or now - oldest.entered < self.policy.timeout:
            return
        self._next_hang_check = now + self.policy.timeout / 2  # not again every beat while it lasts
        self._end_with(self.diagnose(oldest.as_record(now)))

    def _end_with(self, message: str | None) -> None:
        """Publish a hang report (``None``: none yet) and exit, printing the first one published."""
        if message:
            self.verdict.reporter = self.verdict.publish(message)
            self._exit(message if self.verdict.reporter else self.verdict.read() or message)

    def _check_foreign(self) -> None:
        """The main thread blocked in a collective hsdp does not issue, unchanged for ``timeout``: judge it."""
        main, now = self.sampler.where, time.monotonic()
        if (main is None or not main.blocked or self.ledger.busy_with is not None or now < self._next_foreign_check
                or now - main.still_since < self.policy.timeout):
            return
        self._next_foreign_check = now + self.policy.timeout / 2
        self._end_with(self.diagnose_foreign(main.moves))

    def diagnose_foreign(self, moves: int) -> str | None:
        """Read every rank's snapshot and name a hang in this rank's foreign collective (``None``: not one,
        see ``foreign.py``); the first time the others are only working, the lowest waiting rank says so."""
        now, (snapshots, gone) = time.time(), self._all_snapshots()
        verdict = judge_foreign(self.rank, snapshots, gone, self.policy.timeout, now)
        if verdict.deadlocked:
            stacks = self._stacks_of([*verdict.elsewhere, *verdict.in_hsdp][:4])
            stacks[self.rank] = main_thread_stack()
            return foreign_report(self.rank, verdict, snapshots, stacks, now)
        if (verdict.working and not verdict.pending and self._noticed != moves
                and self.rank == min(verdict.waiting)):
            self._noticed = moves  # once per wait
            mine = snapshots[self.rank]["main"]
            notice = working_notice(verdict, mine, self._stacks_of(verdict.working[:4]))
            print(f"[hsdp rank {self.rank}] {notice}", file=sys.stderr, flush=True)
        return None

    def diagnose(self, waited: list) -> str | None:
        """Read every rank's ledger and name the hang (``None``: nobody is late; keep waiting).

        Judged against the earliest collective any rank waits in, not this rank's: ranks that ran ahead
        (other shard groups, until the inter-node hop) wait downstream of the real culprit."""
        now, (snapshots, gone) = time.time(), self._all_snapshots()
        waits = {r: s["waiting"] for r, s in snapshots.items() if s and s.get("waiting") and r not in gone}
        anchor = min(waits, key=lambda r: (waits[r][0], r), default=self.rank)
        if anchor != self.rank:
            seq, region, phase, age = waits[anchor]
            waited = [seq, region, phase, age + max(0.0, now - snapshots[anchor]["t"])]
        verdict = judge(anchor, waited, snapshots, gone)
        if not verdict.offenders:
            if waited[3] >= 2 * self.policy.timeout and not verdict.busy:
                return stuck_transport(anchor, waited, verdict)
            return None
        dead = [r for r in self.silent_ranks() if r in verdict.late] if verdict.late else []
        if dead:  # a stopped or dead process is not "busy elsewhere": say what the heartbeat says
            return (f"rank(s) {dead} stopped responding (no heartbeat) while rank(s) "
                    f"{', '.join(map(str, sorted(verdict.waiting)))} waited {waited[3]:.0f} s in "
                    f"{Entry.describe_record(waited)}: the process died or was stopped")
        stacks = self._stacks_of(verdict.late[:4])
        return report(anchor, waited, verdict, snapshots, stacks, now)

    def _all_snapshots(self) -> tuple[dict[int, dict | None], set[int]]:
        """Every rank's published snapshot (this rank's fresh), and the ranks that exited normally."""
        snapshots = {r: self._snapshot_of(r) for r in range(self.world_size) if r != self.rank}
        snapshots[self.rank] = self._my_snapshot()
        return snapshots, {r for r in snapshots if r != self.rank and self.store.add(f"hsdp/done/{r}", 0)}

    def _snapshot_of(self, rank: int) -> dict | None:
        key = f"hsdp/prog/{rank}"
        return json.loads(self.store.get(key)) if self.store.check([key]) else None

    def _stacks_of(self, ranks: list[int]) -> dict[int, str]:
        """Ask ``ranks``' watchdog threads for their main thread's stack; wait up to three beats."""
        asked = {r: self.store.add(f"hsdp/stackreq/{r}", 1) for r in ranks}
        stacks: dict[int, str] = {}
        deadline = time.monotonic() + 3 * self.policy.interval
        while len(stacks) < len(asked) and time.monotonic() < deadline:
            for r, n in asked.items():
                key = f"hsdp/stack/{r}/{n}"
                if r not in stacks and self.store.check([key]):
                    stacks[r] = self.store.get(key).decode()
            self._pause(self.policy.interval / 4)
        return stacks

    def arrive(self, helper: str) -> None:
        """Wait (at most half the ``timeout``) until every rank has called collective helper ``helper`` as often as
        this one; raise ``ValueError`` naming the ranks that did not. Called before the helper's first
        collective, so a helper called on some ranks only (``if rank == 0: hsdp.full_state_dict(model)``)
        fails with its name instead of pairing with another collective or hanging. A store counter per
        call: meant for rare helpers (state dicts, checkpoints, init), not for every step."""
        n = self._arrivals[helper] = self._arrivals.get(helper, 0) + 1
        base = f"hsdp/arrive/{helper}/{n}"
        self.store.set(f"{base}/{self.rank}", "1")
        count, pause = self.store.add(base, 1), 0.002
        # Half the hang bound: the ranks that did not arrive are waiting in another collective, and this
        # rank's precise message must come before the generic hang report about it.
        deadline = time.monotonic() + self.policy.timeout / 2
        while count < self.world_size and time.monotonic() < deadline:
            time.sleep(pause)
            pause = min(2 * pause, self.policy.interval / 4)
            count = self.store.add(base, 0)
        if count < self.world_size:
            missing = [r for r in range(self.world_size) if not self.store.check([f"{base}/{r}"])]
            called = sorted(set(range(self.world_size)) - set(missing))
            dead = [r for r in self.silent_ranks() if r in missing]
            if dead:  # not a misuse: a peer died on its way here
                raise RuntimeError(f"rank(s) {dead} died (no heartbeat) before calling {helper}")
            raise ValueError(f"{helper} is a collective and must be called on every rank: rank(s) "
                             f"{', '.join(map(str, called))} called it, rank(s) {', '.join(map(str, missing))} "
                             f"did not within {self.policy.timeout / 2:.0f} s (call #{n} on this rank)")

    def _run_checks(self) -> None:
        for check in self._checks:
            try:
                message = check()
            except Exception as e:  # a broken check must not end the watchdog: say so once, drop it
                print(f"[hsdp rank {self.rank}] watchdog check {check!r} failed and is disabled: {e!r}",
                      file=sys.stderr, flush=True)
                self._checks.remove(check)
                return
            if message:
                message = f"rank {self.rank}: {message}"
                self.verdict.publish(message)
                self._exit(self.verdict.read() or message)

    def _exit(self, message: str, store: bool = True) -> None:
        """End this rank with ``message`` (the job's verdict), unless it is finishing normally or another of its
        threads is ending it already (see ``verdict.py``)."""
        if not self._stop.is_set() and self.verdict.claim():
            self.verdict.end(message, store=store)


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
