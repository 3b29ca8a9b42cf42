"""The syncs one DiLoCo call runs, in order, and where a replica joining on an elastic mesh enters them.

After an inner step (``OuterState.after_inner_step``) DiLoCo first lands the syncs in flight that are due, then
starts the fragments whose offset the phase reached; ``sync_now`` lands every sync in flight, then syncs every
fragment at once and restarts the phase at 0. Each of those syncs is a transaction of the replicate layer
(``outer_transaction.py``), so one call may run several. :class:`SyncPlan` is that call as data: its steps, each
``(kind, fragment)``:

- ``"land"``: close a sync in flight and land its outer update (redone synchronously among the survivors when the
  layer discarded it: ``delay > 0``);
- ``"start"``: open a sync's transaction and start its all-reduce, to land ``delay`` inner steps later;
- ``"transact"``: open and close a sync at once, landing it (``delay=0``, and every fragment of ``sync_now``);

then the phase it leaves (``sync_now``'s 0). ``at`` is the step under way.

[Note: a joiner enters mid-plan] A replica joining an elastic job is healed in the await of one of the members'
transactions: the plan step under way on the member it is healed from, which sends it its plan from that step on
(``outer_heal.py``). The joiner runs those steps as the members do, so its collectives match theirs, weighing 0
in the sync it enters: a ``"land"`` it has no sync in flight for is the members' redo of that landing, which it
takes part in as a ``"transact"``. At most one sync is ever in flight at an admission: the layer has one
transaction open at a time, so on an elastic mesh ``check_replica_sync`` refuses ``delay * fragments > every``
(the next fragment's sync would start before the previous one landed); at a fragment's start the previous
fragment's landed, at the latest in the same call just before. A member healing outside any plan (at an elastic
job's start, every replica is in its optimizer's construction) sends none: the joiner then syncs the fragment due
at the phase, as every replica there does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

LAND, START, TRANSACT = "land", "start", "transact"


@dataclass
class SyncPlan:
    """One call's syncs, in the order every member runs them (module docstring)."""

    steps: tuple[tuple[str, int], ...]
    phase: int | None = None  # the phase once the steps are done (``sync_now``: 0); None: unchanged
    at: int = 0  # the step under way

    @classmethod
    def after_step(cls, lands: list[int], starts: list[int], delay: int) -> SyncPlan:
        """After an inner step: ``lands`` (syncs in flight now due, in the order started), then ``starts``."""
        return cls(tuple((LAND, f) for f in lands) + tuple((START if delay else TRANSACT, f) for f in starts))

    @classmethod
    def sync_all(cls, lands: list[int], fragments: int) -> SyncPlan:
        """``sync_now``: every sync in flight lands, then every fragment syncs at once; the phase restarts."""
        return cls(tuple((LAND, f) for f in lands) + tuple((TRANSACT, f) for f in range(fragments)), phase=0)

    @property
    def lands_global(self) -> bool:
        """The step under way is one of ``sync_now``'s syncs of every fragment (a plan that restarts the phase):
        its landing leaves every replica the global copy, whatever ``mix`` (its landings of syncs in flight mix as
        any other, so their ``delay`` steps' progress reaches the final pseudo-gradient). Read from the plan's
        steps, not from how this replica runs them: a joiner taking part in a landing's redo as a sync mixes as
        the members do."""
        return self.phase is not None and self.at < len(self.steps) and self.steps[self.at][0] == TRANSACT

    def rest(self) -> list[Any]:
        """The steps from the one under way and the phase they leave, as the heal sends them to a joiner."""
        return [[list(s) for s in self.steps[self.at:]], self.phase]

    @classmethod
    def joined(cls, sent: list[Any] | None, due: int) -> SyncPlan:
        """The plan a joiner runs: the healing member's :meth:`rest`, or with none (every replica at an elastic
        job's start) a sync of fragment ``due``, the one due at the phase."""
        if sent is None:
            return cls(((TRANSACT, due),))
        steps, phase = sent
        return cls(tuple((str(kind), int(f)) for kind, f in steps), phase)
