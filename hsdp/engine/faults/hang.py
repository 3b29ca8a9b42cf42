"""Naming a hang: from every rank's published ledger snapshot, who is late, mismatched or gone, and why.

A pure function of the snapshots (see ``ledger.py``), so every case is testable without processes. The
rank that diagnoses has waited past the bound in collective ``#k``. Each other rank is then one of:

* **late**: its last collective is before ``#k`` (it is stuck in Python, I/O, a data loader, or a
  collective hsdp does not issue, such as DTensor's inside a save on one rank only);
* **mismatched**: its ``#k`` is a different collective (a branch taken on some ranks only);
* **gone**: it finished (exited normally) without entering ``#k``;
* **busy**: inside declared single-rank work (rank 0 writing a manifest): not a hang;
* in ``#k`` too, or past it and blocked further on (another shard group runs ahead until the
  inter-node hop).

If some rank is late, mismatched or gone, the report names them, what they last did, the stack of
(up to a few) late ranks, and the likely cause. If every rank is in ``#k`` the collective itself is
stuck (network, a GPU kernel that never ends), reported once it has waited twice the bound.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hsdp.engine.faults.stacks import describe_record

# CollectiveLedger.snapshot() plus "main" (stacks.Where.record: where the main thread was) and "t" (wall time
# of publishing).
Snapshot = Mapping[str, Any]


@dataclass
class Verdict:
    """How each other rank stands relative to the waited-for collective ``#k``."""

    waiting: list[int] = field(default_factory=list)  # in #k as well
    downstream: list[int] = field(default_factory=list)  # past #k, blocked further on (the same cause)
    late: list[int] = field(default_factory=list)
    mismatched: dict[int, list[Any]] = field(default_factory=dict)  # rank -> its record of #k
    gone: list[int] = field(default_factory=list)
    busy: dict[int, list[Any]] = field(default_factory=dict)  # rank -> [what, seconds]

    @property
    def offenders(self) -> bool:
        return bool(self.late or self.mismatched or self.gone)


def judge(me: int, waited: list[Any], snapshots: Mapping[int, Snapshot | None], gone: set[int]) -> Verdict:
    """Classify every rank but ``me`` against ``waited`` (``[seq, region, phase, age]``)."""
    seq, region = waited[0], waited[1]
    v = Verdict(waiting=[me])
    for rank in sorted(snapshots):
        if rank == me:
            continue
        snap = snapshots[rank]
        if rank in gone:
            v.gone.append(rank)
        elif snap is None or snap["seq"] < seq:
            if snap is not None and snap.get("busy"):
                v.busy[rank] = snap["busy"]
            else:
                v.late.append(rank)
        else:
            record = next((r for r in snap["recent"] if r[0] == seq), None)
            if record is not None and (record[1], record[2]) != (region, waited[2]):
                v.mismatched[rank] = record
            elif snap.get("waiting") and snap["waiting"][0] == seq:
                v.waiting.append(rank)
            else:
                v.downstream.append(rank)
    return v


def report(me: int, waited: list[Any], v: Verdict, snapshots: Mapping[int, Snapshot | None],
           stacks: Mapping[int, str], now: float) -> str:
    """The message every rank prints: first line a summary, then the evidence and the likely cause."""
    seq, region, phase, age = waited
    what = _collective(seq, region, phase)
    lines = [f"hang: rank(s) {_ranks(sorted(v.waiting))} waited {age:.0f} s in {what}; " + _culprits(v)]
    if v.downstream:
        lines.append(f"  rank(s) {_ranks(v.downstream)} went on and are blocked in later collectives")
    if v.late:
        last = [_last(snapshots.get(r), now) for r in v.late]
        for text in sorted(set(last)):
            lines.append(f"  rank(s) {_ranks([r for r, t in zip(v.late, last, strict=True) if t == text])} "
                         f"never entered it; {text}")
    for rank, rec in v.mismatched.items():
        lines.append(f"  rank {rank} is in a different {_collective(rec[0], rec[1], rec[2])}")
    if v.gone:
        lines.append(f"  rank(s) {_ranks(v.gone)} exited normally before entering it")
    for text in sorted(set(stacks.values())):
        holders = [r for r, s in stacks.items() if s == text]
        lines.append(f"  rank(s) {_ranks(holders)} now at:\n" + _indent(text))
    lines.append("likely cause: " + likely_cause(phase, v, snapshots))
    return "\n".join(lines)


def stuck_transport(me: int, waited: list[Any], v: Verdict) -> str:
    seq, region, phase, age = waited
    return (f"hang: every rank ({_ranks(sorted(v.waiting))}) has been in {_collective(seq, region, phase)} "
            f"for {age:.0f} s without it completing: the transport is stuck (a network link, a peer's NIC, "
            f"or a GPU kernel that never finishes), not the program")


def likely_cause(phase: str, v: Verdict, snapshots: Mapping[int, Snapshot | None]) -> str:
    if v.mismatched:
        theirs = {rec[2] for rec in v.mismatched.values() if rec[2]}
        helpers = sorted({phase, *theirs} - {""})
        named = f" ({', '.join(helpers)})" if helpers else ""
        return (f"ranks issued different collectives{named}: a collective inside a branch that only some "
                f"ranks take (e.g. `if rank == 0:`); every rank must make the same collective calls in order")
    if phase and (v.late or v.gone):
        return (f"{phase} is a collective: every rank must call it (rank(s) {_ranks(v.waiting)} did, "
                f"rank(s) {_ranks(sorted(v.late + v.gone))} did not)")
    if v.gone:
        return (f"rank(s) {_ranks(v.gone)} finished early: every rank must run the same steps and "
                f"collectives (same number of batches per rank)")
    return ("the late rank(s) are busy outside hsdp's collectives (see their stack): a slow or deadlocked data "
            "loader, I/O, a sleep, or a collective of another library (e.g. DTensor's, inside a save or "
            "full_tensor()) called on some ranks only")


def _culprits(v: Verdict) -> str:
    parts = []
    if v.late:
        parts.append(f"late: rank(s) {_ranks(v.late)}")
    if v.mismatched:
        parts.append(f"in a different collective: rank(s) {_ranks(sorted(v.mismatched))}")
    if v.gone:
        parts.append(f"exited: rank(s) {_ranks(v.gone)}")
    return "; ".join(parts)


def _collective(seq: int, region: str, phase: str) -> str:
    where = f" (in {phase})" if phase else ""
    return f"collective #{seq} {region.removeprefix('hsdp::')}{where}"


def _last(snap: Snapshot | None, now: float) -> str:
    main = snap.get("main") if snap else None
    if main and main[3]:  # blocked at its last beat in a collective hsdp does not issue (see stacks.py)
        return f"it is in a collective hsdp does not issue: {describe_record(main)}"
    if snap is None or not snap.get("recent"):
        return "it has issued no collective yet"
    seq, region, phase, age = snap["recent"][-1]
    age += max(0.0, now - snap.get("t", now))
    return f"its last was {_collective(seq, region, phase)}, {age:.0f} s ago"


def _ranks(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks)


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.rstrip().splitlines())
