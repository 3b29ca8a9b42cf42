"""Hangs in collectives hsdp does not issue: DTensor's ``full_tensor()``, a user's ``dist.all_reduce``, a barrier.

Each rank's watchdog samples where its main thread is (``stacks.py``) and publishes it with its ledger. A
rank whose main thread has been blocked in one torch.distributed collective for ``timeout`` (its stack and
every group's sequence number unchanged) judges every other rank from their published samples:

* **with it**: inside the same torch.distributed API (``barrier``, ``DTensor.full_tensor``, a
  distributed-checkpoint ``save``), blocked or not;
* **elsewhere**: blocked for ``timeout`` too, in a different collective (another torch.distributed API,
  or one of hsdp's);
* **gone**: it exited normally;
* **pending**: in a different collective for less than ``timeout`` so far;
* **working**: in no collective;
* **busy**: inside hsdp's declared single-rank work (``Comm.busy``).

The job is ended only when the wait can never end: some rank is elsewhere or gone, and none is pending,
working or busy. Every live rank then sits still in a collective, and not all in the same one.

* All ranks in one API is a legitimate long wait (a big gather; rank 0 writing files inside ``dcp.save``
  while the others wait in its barrier) and is never reported, however long: a stuck transport there is
  left to the process group's own timeout.
* A working rank may be what the blocked ones wait for, directly (rank 0 writing a checkpoint while the
  others sit in ``accelerator.wait_for_everyone()``) or through a subgroup (ranks 2, 3 in a world
  ``all_reduce`` wait for ranks 0, 1, whose shard-group gather waits for rank 1, still computing): while
  one works nothing is reported. Once per wait the lowest waiting rank prints a notice naming the working
  ranks and their stacks. Should one stop for good (a deadlocked data loader), hsdp does not end the job:
  the heartbeat does if the process dies or is stopped, the process group's timeout otherwise. This
  differs from hsdp's own collectives on purpose: those run in the training step, where no rank has a
  reason to be away for ``timeout``.
* Without the groups a collective runs on (a stack does not say), a gather on a subgroup that legitimately
  takes longer than ``timeout`` while every other rank already waits in a different collective is
  reported as a hang. Keep ``timeout`` well above the longest single collective.

The report names every group of ranks and where it is, the stacks of this rank and of (up to a few)
ranks elsewhere, and the likely cause; every rank then exits as for hsdp's own hangs. The functions here
are pure (snapshots in, text out), tested without processes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hsdp.engine.faults.hang import Snapshot, _collective, _indent, _ranks
from hsdp.engine.faults.stacks import describe_record

FOREIGN = "a collective hsdp does not issue"


@dataclass
class ForeignVerdict:
    """How each rank stands relative to this rank's foreign wait (see the module docstring)."""

    waiting: list[int] = field(default_factory=list)  # in the same torch.distributed API (this rank first)
    elsewhere: dict[int, list[Any]] = field(default_factory=dict)  # rank -> its "main" record
    in_hsdp: dict[int, list[Any]] = field(default_factory=dict)  # rank -> its ledger "waiting" record
    gone: list[int] = field(default_factory=list)
    working: list[int] = field(default_factory=list)
    pending: dict[int, list[Any]] = field(default_factory=dict)  # in another collective, not yet for timeout
    busy: dict[int, list[Any]] = field(default_factory=dict)

    @property
    def deadlocked(self) -> bool:
        """Some rank can never join, and no rank is still on its way (see the module docstring)."""
        return bool(self.elsewhere or self.in_hsdp or self.gone) and not (self.working or self.pending or self.busy)


def aged(record: list[Any] | None, snap: Snapshot, now: float) -> list[Any] | None:
    """``record`` (its last field: seconds) as of wall time ``now``, from a snapshot published at ``snap["t"]``."""
    if record is None:
        return None
    return [*record[:-1], record[-1] + max(0.0, now - snap.get("t", now))]


def judge_foreign(me: int, snapshots: Mapping[int, Snapshot | None], gone: set[int], timeout: float,
                  now: float) -> ForeignVerdict:
    """Classify every rank but ``me`` against ``me``'s blocked ``"main"`` record (``stacks.Where.record``)."""
    mine = snapshots[me]["main"]
    v = ForeignVerdict(waiting=[me])
    for rank in sorted(snapshots):
        snap = snapshots[rank]
        if rank == me:
            continue
        if rank in gone:
            v.gone.append(rank)
            continue
        if snap is None:
            v.working.append(rank)  # no watchdog there: nothing known, so nothing to blame
            continue
        main, hsdp_wait = aged(snap.get("main"), snap, now), aged(snap.get("waiting"), snap, now)
        if snap.get("busy"):
            v.busy[rank] = snap["busy"]
        elif main is not None and main[0] == mine[0]:  # the same API: one operation, maybe long
            v.waiting.append(rank)
        elif main is not None and main[3]:
            (v.elsewhere if main[4] >= timeout else v.pending)[rank] = main
        elif hsdp_wait is not None:
            (v.in_hsdp if hsdp_wait[3] >= timeout else v.pending)[rank] = hsdp_wait
        else:
            v.working.append(rank)
    return v


def foreign_report(me: int, v: ForeignVerdict, snapshots: Mapping[int, Snapshot | None],
                   stacks: Mapping[int, str], now: float) -> str:
    """The message every rank prints: a summary line, where each group of ranks is, stacks, likely cause."""
    mine = aged(snapshots[me]["main"], snapshots[me], now)
    lines = [f"hang: rank(s) {_ranks(v.waiting)} waited {mine[4]:.0f} s in {mine[0]}, {FOREIGN}; "
             + _culprits(v)]
    lines.append(f"  rank(s) {_ranks(v.waiting)} are in {describe_record(mine)}")
    for text, ranks in _grouped({r: describe_record(m) for r, m in v.elsewhere.items()}):
        seconds = max(v.elsewhere[r][4] for r in ranks)
        lines.append(f"  rank(s) {_ranks(ranks)} are in a different collective: {text}, for {seconds:.0f} s")
    for text, ranks in _grouped({r: _collective(*w[:3]) for r, w in v.in_hsdp.items()}):
        lines.append(f"  rank(s) {_ranks(ranks)} are in hsdp's {text}")
    if v.gone:
        lines.append(f"  rank(s) {_ranks(v.gone)} exited normally without entering it")
    for text, ranks in _grouped(dict(stacks)):
        lines.append(f"  rank(s) {_ranks(ranks)} now at:\n" + _indent(text))
    lines.append("likely cause: " + foreign_cause(mine, v))
    return "\n".join(lines)


def foreign_cause(mine: list[Any], v: ForeignVerdict) -> str:
    entries = [mine[0], *(m[0] for m in v.elsewhere.values())]
    gathers = any(e.startswith("DTensor") for e in entries) or mine[1] == "wait_tensor"
    hint = (" A sharded model's parameters are DTensors: saving them (save_pretrained, full_tensor(), a state "
            "dict) gathers every parameter, so call it on every rank (or hsdp.full_state_dict on every rank) "
            "and write on rank 0 only") if gathers else ""
    if v.elsewhere or v.in_hsdp:
        calls = [f"{mine[0]} on rank(s) {_ranks(v.waiting)}"]
        calls += [f"{m[0]} on rank(s) {_ranks(r)}" for m, r in _by_entry(v.elsewhere)]
        if v.in_hsdp:
            calls.append(f"hsdp's collectives on rank(s) {_ranks(sorted(v.in_hsdp))}")
        return (f"ranks called different collectives ({'; '.join(calls)}): a collective inside a branch that "
                f"only some ranks take (e.g. `if rank == 0:`); every rank must make the same collective calls "
                f"in order.{hint}")
    return (f"{mine[0]} is a collective: every rank must call it (rank(s) {_ranks(v.waiting)} did, rank(s) "
            f"{_ranks(v.gone)} exited without calling it).{hint}")


def working_notice(v: ForeignVerdict, mine: list[Any], stacks: Mapping[int, str]) -> str:
    """One notice, not an error: ranks wait in a foreign collective for ranks that are in no collective."""
    text = (f"note: rank(s) {_ranks(v.waiting)} have waited {mine[4]:.0f} s in {describe_record(mine)}; they "
            f"wait for rank(s) {_ranks(v.working)}, which are in no collective: presumed to be working alone "
            f"(e.g. writing a checkpoint), so not ended as a hang")
    for stack, ranks in _grouped(dict(stacks)):
        text += f"\n  rank(s) {_ranks(ranks)} now at:\n" + _indent(stack)
    return text


def _culprits(v: ForeignVerdict) -> str:
    parts = []
    if v.elsewhere or v.in_hsdp:
        parts.append(f"in a different collective: rank(s) {_ranks(sorted([*v.elsewhere, *v.in_hsdp]))}")
    if v.gone:
        parts.append(f"exited: rank(s) {_ranks(v.gone)}")
    return "; ".join(parts)


def _grouped(texts: Mapping[int, str]) -> list[tuple[str, list[int]]]:
    """Ranks grouped by identical text, groups in order of their lowest rank."""
    groups: dict[str, list[int]] = {}
    for rank in sorted(texts):
        groups.setdefault(texts[rank], []).append(rank)
    return list(groups.items())


def _by_entry(records: Mapping[int, list[Any]]) -> list[tuple[list[Any], list[int]]]:
    groups: dict[str, tuple[list[Any], list[int]]] = {}
    for rank in sorted(records):
        groups.setdefault(records[rank][0], (records[rank], []))[1].append(rank)
    return list(groups.values())
