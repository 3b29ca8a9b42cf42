"""The collective ledger: what this rank last entered, and what it is still waiting for.

Every collective hsdp issues goes through ``Comm``, which enters it here: a sequence number (the
program is the same on every rank, so collective ``#k`` is the same call everywhere), its profiler
region (``hsdp::all_gather[shard] blocks.3``), the public helper it belongs to (``hsdp.full_state_dict``)
and when it was issued. Entries leave the pending set when their handle is waited or their work is
seen completed. The watchdog thread publishes a small snapshot of the ledger to the rendezvous store
once per beat (never per collective) and reads it back on every rank only when some collective has
waited past the bound: then a rank that never entered ``#k`` (stuck elsewhere), one that entered a
different collective there (a mismatch), or one that left (finished early) is named.

[Note: busy regions] Some waits are legitimate: every rank waits in an agreement while rank 0 alone
writes a manifest or hashes a large checkpoint. Such single-rank work runs inside :meth:`busy`, and a
rank that is busy is reported as such, never as hung; the heartbeat still catches it if it dies.

The hot path costs one counter increment, one small tuple and two dict operations per collective. The
main thread writes and the watchdog thread reads; every structure used is safe under the GIL for that
(append/pop on a deque, get/pop on a dict, attribute reads).
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

RECENT = 16  # entries kept for comparing sequence numbers across ranks


@dataclass
class Entry:
    """One collective as this rank issued it."""

    seq: int
    region: str  # "hsdp::<op>[<group>] <label>"
    phase: str  # the public helper it runs in ("hsdp.save_checkpoint"), "" in the training step
    entered: float  # time.monotonic() when issued
    work: Any = None  # while pending: the Work, or once waited on CUDA its completion event (see done_when)

    def describe(self) -> str:
        return Entry.describe_record([self.seq, self.region, self.phase])

    @staticmethod
    def describe_record(record: list[Any]) -> str:
        """:meth:`describe` of a published record ``[seq, region, phase, age]``."""
        seq, region, phase = record[:3]
        where = f" in {phase}" if phase else ""
        return f"collective #{seq} {region.removeprefix('hsdp::')}{where}"

    def as_record(self, now: float) -> list[Any]:
        return [self.seq, self.region, self.phase, round(now - self.entered, 1)]


class CollectiveLedger:
    """This process's record of its collectives (one per watchdog; see ``Comm``)."""

    def __init__(self) -> None:
        self.seq = 0
        self.recent: deque[Entry] = deque(maxlen=RECENT)
        self.pending: dict[int, Entry] = {}
        self._phases: list[str] = []
        self.busy_with: tuple[str, float] | None = None  # (what, since): single-rank work, see [Note]

    # -- the main thread ------------------------------------------------------------------------------
    def enter(self, region: str, work: Any) -> Entry:
        self.seq += 1
        entry = Entry(self.seq, region, self._phases[-1] if self._phases else "", time.monotonic(), work)
        self.recent.append(entry)
        self.pending[entry.seq] = entry
        return entry

    def done(self, entry: Entry) -> None:
        entry.work = None
        self.pending.pop(entry.seq, None)

    def done_when(self, entry: Entry, marker: Any = None) -> None:
        """The entry's collective was waited. Without ``marker`` that wait returned once it completed: retire it.
        With one (on CUDA, an event the waiting stream records: the wait only ordered the stream, NCCL may still
        be running) it stays pending, holding the marker instead of the work and its buffers, until the
        watchdog sees the marker complete (:meth:`oldest_pending`): a stuck NCCL collective is reported."""
        if marker is None:
            self.done(entry)
        else:
            entry.work = marker

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Collectives entered inside belong to the public helper ``name`` (named in hang reports)."""
        self._phases.append(name)
        try:
            yield
        finally:
            self._phases.pop()

    @contextlib.contextmanager
    def busy(self, what: str) -> Iterator[None]:
        """Single-rank work the other ranks legitimately wait for (see [Note: busy regions])."""
        previous, self.busy_with = self.busy_with, (what, time.monotonic())
        try:
            yield
        finally:
            self.busy_with = previous

    # -- the watchdog thread --------------------------------------------------------------------------
    def oldest_pending(self) -> Entry | None:
        """The longest-waiting collective that is really unfinished (completed works are retired here)."""
        for seq in sorted(self.pending):
            entry = self.pending.get(seq)
            if entry is None:
                continue
            work = entry.work
            if work is not None and _completed(work):
                self.done(entry)
                continue
            return entry
        return None

    def snapshot(self) -> dict[str, Any]:
        """What the other ranks need to judge this one: JSON-ready, ages in seconds."""
        now = time.monotonic()
        oldest = self.oldest_pending()
        busy = self.busy_with
        return {"seq": self.seq,
                "recent": [e.as_record(now) for e in list(self.recent)],
                "waiting": None if oldest is None else oldest.as_record(now),
                "busy": None if busy is None else [busy[0], round(now - busy[1], 1)]}


def _completed(work: Any) -> bool:
    """Whether a pending entry's work (a ``torch.distributed`` Work) or completion marker (a CUDA event) is done."""
    try:
        poll = getattr(work, "is_completed", None) or work.query
        return bool(poll())
    except Exception:  # a backend without completion polling: only the waiting side retires it
        return False
