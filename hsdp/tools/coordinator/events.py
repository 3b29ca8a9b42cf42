"""What changed in an elastic job, for people: membership lines as they happen, and a summary at the end.

:class:`MembershipLog` watches a :class:`~hsdp.tools.coordinator.server.Coordinator`'s state from outside (it
reads ``coordinator.state`` after each poll and compares it with what it saw before), so the decision logic
knows nothing about it and a step that changes nothing prints nothing: one line per step would drown the
few that matter (a replica left, one joined, a step was discarded, the job stopped).

Reads only plain attributes of :class:`~hsdp.tools.coordinator.server.JobState`; imports nothing but the
standard library, so it is tested without a store or processes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol


class _Incarnation(Protocol):
    number: int
    degree: int


class _State(Protocol):
    """The parts of ``JobState`` read here."""

    step: int
    epoch: int
    members: Mapping[int, Any]
    pending: Mapping[int, Any]
    quorum: Any
    stopped: str
    completed: str
    finished: set[int]
    finishers: set[tuple[int, int]]
    gone: set[tuple[int, int]]
    history: list[tuple[int, str, tuple[int, ...]]]
    refusals: list[tuple[int, int, str]]


@dataclass
class Counts:
    """Tallies for the summary."""

    joined: int = 0  # replicas admitted after the first quorum (rejoins included)
    left: int = 0  # members dropped because their heartbeat went silent (or replaced by a restart)
    rejected: int = 0  # incarnations refused (an id in use, another rank count, the job stopped)


@dataclass
class MembershipLog:
    """Turns successive coordinator states into readable lines (:meth:`observe`) and a summary.

    ``heartbeat_timeout`` only words the reason a member left; ``clock`` stamps the lines."""

    heartbeat_timeout: float
    clock: Callable[[], float] = time.time
    counts: Counts = field(default_factory=Counts)
    _members: dict[int, int] = field(default_factory=dict)  # replica id -> incarnation, as last seen
    _pending: dict[int, int] = field(default_factory=dict)
    _epoch: int = -1
    _decided: int = 0  # history entries already reported
    _refused: int = 0  # refusals already reported
    _stopped: str = ""
    _completed: str = ""
    _started: bool = False
    _ever: set[int] = field(default_factory=set)  # ids that were members once: their next admission is a rejoin

    def observe(self, state: _State) -> list[str]:
        """The lines for what changed since the previous call (none when nothing did)."""
        lines = [*self._registrations(state), *self._discarded(state)]
        members = {r: inc.number for r, inc in state.members.items()}
        quorum = state.quorum
        if quorum is not None and (members != self._members or state.epoch != self._epoch):
            lines.append(self._membership(state, members, quorum))
            self._members, self._epoch = members, state.epoch
            self._ever |= set(members)
        lines += self._rejections(state)
        self._pending = {r: inc.number for r, inc in state.pending.items()}
        if state.stopped and not self._stopped:
            self._stopped = state.stopped
            lines.append(f"job stopped at step {state.step}: {state.stopped}")
        if state.completed and not self._completed:
            self._completed = state.completed
            lines.append(f"job completed after step {state.step - 1}: {_finishers(state)} finished training")
        stamp = time.strftime("%H:%M:%S", time.localtime(self.clock()))
        return [f"{stamp} {line}" for line in lines]

    def _registrations(self, state: _State) -> list[str]:
        return [f"replica {r} registered (incarnation {inc.number}, {inc.degree} rank{'s' if inc.degree > 1 else ''})"
                f", waiting to be admitted" for r, inc in sorted(state.pending.items())
                if self._pending.get(r) != inc.number]

    def _discarded(self, state: _State) -> list[str]:
        new = state.history[self._decided:]
        self._decided = len(state.history)
        return [f"step {step} discarded (a member failed or went silent during it); replicas {list(members)}"
                for step, decision, members in new if decision != "commit"]

    def _membership(self, state: _State, members: dict[int, int], quorum: Any) -> str:
        head = f"step {quorum.step}, epoch {quorum.epoch}:"
        ids = sorted(members)
        if not self._started:
            self._started = True
            healed = f" (healed from replica {quorum.source})" if quorum.joiners else ""
            return f"{head} started with replicas {ids}{healed}"
        parts = []
        for r in sorted(set(self._members) | set(members)):
            old, new = self._members.get(r), members.get(r)
            if old is not None and old != new and (r, old) in state.finishers:
                parts.append(f"replica {r} finished")  # its training is done: not a departure
            elif old is not None and old != new:
                # Only a dead or silent member is dropped (a restart's new incarnation waits until the old one is).
                self.counts.left += 1
                why = ("its process is gone: a probe of its liveness port was refused"
                       if (r, old) in state.gone else f"no heartbeat for {self.heartbeat_timeout:g} s")
                parts.append(f"replica {r} left ({why})")
            if new is not None and old != new:
                self.counts.joined += 1
                parts.append(f"replica {r} {'re' if r in self._ever else ''}joined "
                             f"(incarnation {new}, healed from replica {quorum.source})")
        if not parts:  # same members, new epoch: the groups of a discarded step are rebuilt
            parts.append("replicate groups rebuilt after the discarded step")
        return f"{head} {'; '.join(parts)}; replicas {ids}"

    def _rejections(self, state: _State) -> list[str]:
        """The coordinator's refusals since the last call, each with its reason (the replica's error has the fix)."""
        new = state.refusals[self._refused:]
        self._refused = len(state.refusals)
        self.counts.rejected += len(new)
        return [f"replica {r} incarnation {number} refused: {why.split(': ', 1)[0]}" for r, number, why in new]

    def summary(self, state: _State, job: str, uptime_s: float) -> str:
        """A few lines on the whole run: steps decided, committed and discarded, membership changes, the end."""
        committed = sum(1 for _, decision, _ in state.history if decision == "commit")
        discarded = len(state.history) - committed
        minutes, seconds = divmod(int(uptime_s), 60)
        lines = [f"summary of elastic job {job!r} after {minutes}m{seconds:02d}s:",
                 f"  steps decided: {len(state.history)} ({committed} committed, {discarded} discarded)",
                 f"  membership: {self.counts.joined} join(s), {self.counts.left} departure(s), "
                 f"{self.counts.rejected} refused; " + (f"last epoch {state.epoch}" if state.epoch >= 0 else
                                                        "never started (no replica was admitted)"),
                 f"  replicas at the end: {sorted(state.members)}"]
        if state.stopped:
            lines.append(f"  stopped at step {state.step}: {state.stopped}")
        if state.completed:
            lines.append(f"  completed after step {state.step - 1}: {_finishers(state)} finished training")
        return "\n".join(lines)


def _finishers(state: _State) -> str:
    """Who ended the job by finishing: the last members (one that died beside them left, said on its own line)."""
    ids = sorted(state.finished)
    return f"replica{'s' if len(ids) > 1 else ''} {', '.join(map(str, ids))}"
