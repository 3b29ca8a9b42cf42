"""Where the main thread is: sampled by the watchdog thread once per beat, from its Python stack.

hsdp's ledger sees only the collectives hsdp issues. A collective of another library (DTensor's
``full_tensor()``, a user's ``dist.all_reduce``, accelerate's ``wait_for_everyone`` barrier) shows only in
the stack of the thread that waits in it. Once per beat :class:`MainThreadSampler` walks the main thread's
frames (``sys._current_frames()``; the main thread blocked in C++ has released the GIL, so it can be read)
and keeps one :class:`Where`:

* ``entry``: the torch.distributed API the thread is inside, its outermost frame there that is not a
  decorator's wrapper (``DTensor.full_tensor``, ``dist.barrier``, ``save`` of distributed checkpointing,
  ``DTensor operator`` for an operator on a DTensor that redistributes it);
  ``""`` when it is in none. Two ranks with the same entry are in the same operation.
* ``blocked``: whether it waits on a collective of torch.distributed right now: the innermost run of
  frames inside torch reaches c10d's API (``distributed_c10d.py``) or the functional collectives'
  ``wait_tensor``, with no frame of another package (hsdp, user code) in between.
* ``still``: since when neither the stack (every frame's code and instruction) nor any process group's
  collective sequence number changed. A rank blocked in one collective stays still; a loop of many
  short collectives does not, even when every sample lands in the same line, because each one issued
  bumps its group's sequence number. Without those numbers (a backend that keeps none) a fast loop that
  is always sampled at the same line looks still: only the stack then tells.

What the stack cannot show. With NCCL a collective is asynchronous: ``dist.all_reduce`` and
``full_tensor()`` return once enqueued and the host blocks later, in a ``.item()``, ``.cpu()`` or
``torch.cuda.synchronize()`` outside torch.distributed, so the rank is not ``blocked`` (it shows as in no
collective, with that line on its stack). What NCCL's host does block in is seen: ``dist.barrier()``,
object collectives (``broadcast_object_list``, ``all_gather_object``), ``new_group`` and ``DeviceMesh``
creation, store-based barriers, and any ``Work.wait()`` under ``TORCH_NCCL_BLOCKING_WAIT``. A
``work.wait()`` called by user code on a handle it holds (``async_op=True``) is a C++ call from the user's
line, also not ``blocked``. A training loop run outside the main thread is not sampled.

Cost: one walk of the main thread's frames per beat on the watchdog thread, nothing on the main thread
(measured, torch 2.13 CPU: 12-24 us per sample 20-60 frames deep, 37-59 us at 150, of which under 1 us
reads the sequence numbers; at the default 1 s beat the GIL is held for < 1e-4 of the time). No frame or
local is kept between beats: only strings, and a hash of the stack.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from types import CodeType, FrameType, TracebackType
from typing import Any

import torch
import torch.distributed as dist

_TORCH = os.path.dirname(torch.__file__) + os.sep
_DIST = os.path.join(_TORCH, "distributed") + os.sep
# The modules whose functions wait for a collective to complete: c10d's API (every collective, barrier,
# object collective, new_group) and the functional collectives (DTensor's redistribute ends in wait_tensor).
_BLOCKING = (os.path.join(_DIST, "distributed_c10d.py"), os.path.join(_DIST, "_functional_collectives.py"))
_DISPATCH = os.path.join(_DIST, "tensor", "_dispatch.py")  # DTensor's operator dispatcher
OTHER, TORCH, DIST, BLOCKING = range(4)  # what a source file is, innermost knowledge first


@dataclass(frozen=True)
class Where:
    """One sample of the main thread (see the module docstring)."""

    entry: str  # outermost torch.distributed API on the stack, "" if none
    op: str  # innermost function of c10d / functional collectives when blocked, else ""
    site: str  # where the innermost run of torch frames was called from: "pkg/file.py:12 in f"
    blocked: bool
    still_since: float  # time.monotonic()
    moves: int  # samples so far at which the stack or a sequence number had changed

    def record(self, now: float) -> list[Any]:
        """JSON-ready: ``[entry, op, site, blocked, seconds still]``."""
        return [self.entry, self.op, self.site, self.blocked, round(now - self.still_since, 1)]


def describe_record(record: list[Any]) -> str:
    """``DTensor.full_tensor (waiting in wait_tensor), called from train.py:40 in save``."""
    entry, op, site = record[:3]
    waiting = f" (waiting in {op})" if op and op != entry.rpartition(".")[2] else ""
    called = f", called from {site}" if site else ""
    return f"{entry or 'no torch.distributed call'}{waiting}{called}"


class MainThreadSampler:
    """Samples the main thread (or ``thread``) on the watchdog thread; :meth:`sample` once per beat."""

    def __init__(self, thread: threading.Thread | None = None) -> None:
        self._thread = thread or threading.main_thread()
        self._kinds: dict[str, int] = {}  # source file -> kind: bounded by the files ever seen
        self._signature: int | None = None
        self.where: Where | None = None

    def sample(self) -> Where | None:
        """The thread now (``None`` if it is gone); also kept in :attr:`where`."""
        frame = sys._current_frames().get(self._thread.ident or -1)
        if frame is None:
            self.where = None
            return None
        entry, op, site, frames = locate(frame, self._kind)
        signature = hash((frames, issued_collectives()))
        now = time.monotonic()
        last = self.where
        if last is not None and signature == self._signature:
            still, moves = last.still_since, last.moves
        else:
            still, moves = now, (last.moves + 1 if last else 0)
        self._signature = signature
        self.where = Where(entry or op, op, site, bool(op), still, moves)
        return self.where

    def _kind(self, filename: str) -> int:
        kind = self._kinds.get(filename)
        if kind is None:
            kind = self._kinds[filename] = _kind_of(filename)
        return kind


def locate(frame: FrameType | None, kind_of: Callable[[str], int]) -> tuple[str, str, str, tuple]:
    """Walk outward from the innermost ``frame``: the entry, the blocking op, the call site (see :class:`Where`)
    and the frames' (code, instruction) pairs."""
    entry = op = site = ""
    inner = True  # still in the innermost run of frames inside torch
    frames = []
    while frame is not None:
        code = frame.f_code
        frames.append((id(code), frame.f_lasti))
        kind = kind_of(code.co_filename)
        if inner and kind == OTHER:
            inner, site = False, f"{_short(code.co_filename)}:{frame.f_lineno} in {code.co_name}"
        elif inner and kind == BLOCKING and not op:
            op = code.co_name
        if kind >= DIST and "<locals>" not in code.co_qualname:  # a decorator's wrapper is not the API
            entry = _api_name(code)
        frame = frame.f_back
    return entry, op, site, tuple(frames)


def _api_name(code: CodeType) -> str:
    """How users call it: ``dist.barrier``, ``DTensor.full_tensor``; an operator on a DTensor (``t[-1]``, which
    may redistribute) enters through DTensor's dispatcher, named ``DTensor operator``."""
    if code.co_filename.startswith(_BLOCKING[0]):
        return f"dist.{code.co_qualname}"
    if code.co_filename.startswith(_DISPATCH):
        return "DTensor operator"
    return code.co_qualname


def raised_in_collective(tb: TracebackType | None) -> str:
    """:func:`describe_record` of the torch.distributed collective an exception was raised from (the innermost
    frames of its traceback), ``""`` if none: a peer that exited makes gloo raise there before a beat sees it."""
    if tb is None:
        return ""
    while tb.tb_next is not None:
        tb = tb.tb_next
    entry, op, site, _ = locate(tb.tb_frame, _kind_of)
    return describe_record([entry or op, op, site]) if op else ""


def issued_collectives() -> int:
    """The sum of every process group's collective sequence number: grows with each collective issued (on
    this rank, by any thread). 0 where torch keeps none; private c10d API, so any failure reads as 0."""
    try:
        groups = list(dist.distributed_c10d._world.pg_map)
    except Exception:
        return 0
    total = 0
    for group in groups:
        try:
            total += group._get_sequence_number_for_group()
        except Exception:  # a backend without sequence numbers, or a group being torn down
            continue
    return total


def main_thread_stack(limit: int = 12, thread: threading.Thread | None = None) -> str:
    """The main thread's (or ``thread``'s) Python stack, innermost last (what a stuck rank is doing), at most
    ``limit`` entries.

    Inside torch only the frame that entered it and its innermost torch.distributed frame are shown (what was
    called, what waits); the frames between are counted, so the caller's lines stay in view."""
    frame = sys._current_frames().get((thread or threading.main_thread()).ident or -1)
    if frame is None:
        return "(no main thread)"
    summary = traceback.extract_stack(frame)
    kinds = [_kind_of(f.filename) for f in summary]
    keep = [k == OTHER or i == 0 or kinds[i - 1] == OTHER or _innermost_dist(kinds, i)
            for i, k in enumerate(kinds)]
    lines: list[str] = []
    hidden = 0
    for frame_summary, shown in zip(summary, keep, strict=True):
        if not shown:
            hidden += 1
            continue
        if hidden:
            lines.append(f"  ... {hidden} frame(s) inside torch\n")
            hidden = 0
        lines.extend(traceback.format_list([frame_summary]))
    if hidden:
        lines.append(f"  ... {hidden} frame(s) inside torch\n")
    return "".join(lines[-limit:]).rstrip()


def _innermost_dist(kinds: list[int], i: int) -> bool:
    """Frame ``i`` is in torch.distributed and the last such frame of its run of torch frames."""
    if kinds[i] < DIST:
        return False
    for k in kinds[i + 1:]:
        if k == OTHER:
            return True
        if k >= DIST:
            return False
    return True


def _kind_of(filename: str) -> int:
    return (BLOCKING if filename.startswith(_BLOCKING) else DIST if filename.startswith(_DIST)
            else TORCH if filename.startswith(_TORCH) else OTHER)


def _short(filename: str) -> str:
    """The last two components of a path: enough to find the file, short enough for one line."""
    head, tail = os.path.split(filename)
    return os.path.join(os.path.basename(head), tail) if head else tail
