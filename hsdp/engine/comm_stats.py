"""What :class:`~hsdp.engine.collectives.Comm` books per collective: calls, bytes, wire bytes, and time.

Time is host time on CPUs; on a CUDA mesh it comes from CUDA event pairs resolved lazily, because there the
host never blocks in a wait (see :class:`OpStats`).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch


@dataclass
class OpStats:
    """Totals for one (group, op) pair. ``wire_bytes`` is what one rank sends under a ring algorithm.

    ``seconds``: from issue to completed wait, overlapped with compute or not. On CPUs (gloo) it is host
    time. On a CUDA mesh the host does not block in a wait (the current stream waits instead), so host time
    would only measure issue-to-enqueue: there ``seconds`` spans a CUDA event recorded on the current stream
    at issue and one recorded after the wait, i.e. issue to completion on the stream timeline. The event
    pairs are resolved lazily, when ``seconds`` or :meth:`as_dict` is read (or :meth:`CommStats.as_dict`):
    that read blocks the host until the booked collectives are done, so read stats between steps, never
    inside forward or backward.
    ``waited``: the part the host spent blocked in the wait. Where a wait blocks the host (gloo, CPU tensors)
    that is the *exposed* communication, the time the rank could not compute; on CUDA with NCCL the host
    never blocks and it stays near zero: the profiler trace shows the GPU's side.
    """

    calls: int = 0
    bytes: int = 0
    wire_bytes: int = 0
    waited: float = 0.0
    _seconds: float = field(default=0.0, repr=False)
    _events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = field(default_factory=list, repr=False)

    @property
    def seconds(self) -> float:
        self.resolve()
        return self._seconds

    def book(self, seconds: float) -> None:
        """Add host-timed seconds (CPU meshes)."""
        self._seconds += seconds

    def book_events(self, start: torch.cuda.Event, end: torch.cuda.Event) -> None:
        """Add the span between two CUDA events, resolved when read. Pairs the device has already passed
        are resolved now without blocking (``query``), so stats that are never read hold a bounded list."""
        self._events.append((start, end))
        if len(self._events) > _MAX_PENDING_EVENTS:
            while self._events and self._events[0][0].query() and self._events[0][1].query():
                first, last = self._events.pop(0)
                self._seconds += first.elapsed_time(last) / 1000.0

    def resolve(self) -> None:
        """Turn pending CUDA event pairs into seconds: blocks the host until their collectives are done."""
        for start, end in self._events:
            end.synchronize()  # returns at once for pairs the device has already passed
            self._seconds += start.elapsed_time(end) / 1000.0  # milliseconds
        self._events.clear()

    def as_dict(self) -> dict[str, float]:
        return {"calls": self.calls, "bytes": self.bytes, "wire_bytes": self.wire_bytes,
                "seconds": round(self.seconds, 6), "waited": round(self.waited, 6)}


# Unread CUDA event pairs kept per stats row before the completed ones are folded into seconds.
_MAX_PENDING_EVENTS = 256


@dataclass
class CommStats:
    """Per ``(group, op)`` totals since the last :meth:`reset`."""

    ops: dict[tuple[str, str], OpStats] = field(default_factory=lambda: defaultdict(OpStats))

    def record(self, group: str, op: str, nbytes: int, wire: int) -> OpStats:
        s = self.ops[(group, op)]
        s.calls += 1
        s.bytes += nbytes
        s.wire_bytes += wire
        return s

    def calls(self, group: str, op: str) -> int:
        return self.ops[(group, op)].calls if (group, op) in self.ops else 0

    def as_dict(self) -> dict[str, dict[str, dict[str, float]]]:
        out: dict[str, dict[str, dict[str, float]]] = {}
        for (g, op), s in sorted(self.ops.items()):
            out.setdefault(g, {})[op] = s.as_dict()
        return out

    def reset(self) -> None:
        self.ops.clear()


def recorded_event() -> torch.cuda.Event:
    """A timing CUDA event recorded on the current stream (non-blocking)."""
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event
