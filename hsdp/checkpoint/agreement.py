"""Agreeing on success or failure across ranks, so a checkpoint error never leaves a rank hanging.

Every step of saving and loading that can fail on some ranks only (a missing file, a full disk, a bad
argument) is followed by an agreement: one small all-gather in which each rank reports its error or
nothing. If any rank failed, every rank raises :class:`CheckpointError` with the same message and no
rank proceeds to a collective the failed rank would never join.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, TypeVar

from hsdp.engine.collectives import Comm

T = TypeVar("T")


class CheckpointError(ValueError):
    """Saving or loading a checkpoint failed; raised on every rank with the same message.

    A ``ValueError`` because most causes are inputs (a path, a checkpoint of another model); the message
    names the problem and, where there is one, the fix.
    """


def _describe(error: BaseException) -> str:
    if isinstance(error, ValueError):
        return str(error)
    return f"{type(error).__name__}: {error}"


def agree(comm: Comm, what: str, error: BaseException | None) -> None:
    """Collective over the world: raise ``CheckpointError`` everywhere if any rank passes an error."""
    messages = [m.decode() for m in comm.all_gather_bytes(b"" if error is None else _describe(error).encode())]
    failed = [(rank, m) for rank, m in enumerate(messages) if m]
    if not failed:
        return
    distinct = sorted({m for _, m in failed})
    if len(distinct) == 1 and len(failed) == len(messages):
        text = f"{what}: {distinct[0]}"
    else:
        ranks = ", ".join(str(r) for r, _ in failed)
        text = f"{what} failed on rank(s) {ranks}: " + " | ".join(distinct)
    raise CheckpointError(text) from error


def run_agreed(comm: Comm, what: str, fn: Callable[[], T]) -> T:
    """``fn()`` on every rank, then :func:`agree` on whether it raised anywhere."""
    result: Any = None
    error: BaseException | None = None
    try:
        result = fn()
    except Exception as e:  # reported to every rank, re-raised below as CheckpointError
        error = e
    agree(comm, what, error)
    return result


def on_rank0(comm: Comm, what: str, fn: Callable[[], Any]) -> Any:
    """``fn()`` on global rank 0 only; its JSON-able result (or error) is broadcast to every rank.

    For decisions that must be made once (which checkpoint to load, the name of a new one) and reads that
    one rank is enough for. One broadcast: cheaper than an agreement and it carries the result too.
    """
    payload: bytes | None = None
    if comm.mesh.rank == 0:
        try:
            payload = json.dumps({"ok": fn()}).encode()
        except Exception as e:  # sent to every rank, re-raised below
            payload = json.dumps({"error": _describe(e)}).encode()
    reply = json.loads(comm.broadcast_bytes(payload, 0, "world"))
    if "error" in reply:
        raise CheckpointError(f"{what}: {reply['error']}")
    return reply["ok"]
