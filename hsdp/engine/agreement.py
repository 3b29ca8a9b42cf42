"""Agreeing across ranks on whether a step succeeded, so an error on some ranks never leaves others hanging.

A step that can fail on some ranks only (a missing file, a full disk, a bad argument) is followed by an
agreement: one small collective in which each rank reports its error or nothing. If any rank failed,
every rank raises the same exception with the same message, and no rank goes on to a collective that a
failed rank would never join (which would block until the process group's timeout). The caller picks
the exception class: checkpoints raise ``CheckpointError``, ``hsdp train`` a plain ``ValueError``.

Every function here is a collective over the world of ``comm``: all ranks call it, in the same order.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, TypeVar

from hsdp.engine.collectives import Comm

T = TypeVar("T")


def describe(error: BaseException) -> str:
    """The message every rank sees for ``error``: a ``ValueError``'s text alone (it already names the
    problem and the fix), otherwise prefixed with the exception's type."""
    if isinstance(error, ValueError):
        return str(error)
    return f"{type(error).__name__}: {error}"


def _prefixed(what: str, message: str) -> str:
    return f"{what}: {message}" if what else message


def agree(comm: Comm, what: str, error: BaseException | None,
          error_type: type[Exception] = ValueError) -> None:
    """Raise ``error_type`` on every rank if any rank passes an ``error`` (``None``: this rank succeeded).

    The message is ``"{what}: {message}"`` when every rank failed the same way, else ``"{what} failed on
    rank(s) 1, 3: {message} | {message}"`` with the distinct messages; an empty ``what`` leaves the
    prefix out. One all-gather of the messages.
    """
    messages = [m.decode() for m in comm.all_gather_bytes(b"" if error is None else describe(error).encode())]
    failed = [(rank, m) for rank, m in enumerate(messages) if m]
    if not failed:
        return
    distinct = sorted({m for _, m in failed})
    if len(distinct) == 1 and len(failed) == len(messages):
        text = _prefixed(what, distinct[0])
    else:
        ranks = ", ".join(str(r) for r, _ in failed)
        text = f"{what} failed" if what else "failed"
        text += f" on rank(s) {ranks}: " + " | ".join(distinct)
    raise error_type(text) from error


def run_agreed(comm: Comm, what: str, fn: Callable[[], T], error_type: type[Exception] = ValueError) -> T:
    """``fn()`` on every rank, then :func:`agree` on whether it raised anywhere; its result when not."""
    result: Any = None
    error: BaseException | None = None
    try:
        result = fn()
    except Exception as e:  # reported to every rank, re-raised below as error_type
        error = e
    agree(comm, what, error, error_type)
    return result


def on_rank0(comm: Comm, what: str, fn: Callable[[], Any], error_type: type[Exception] = ValueError) -> Any:
    """``fn()`` on global rank 0 only; its JSON-serialisable result, or ``error_type("{what}: {message}")``
    if it raised, on every rank (an empty ``what`` leaves the prefix out).

    For decisions that must be made once (which checkpoint to load, whether a run directory may be used)
    and reads that one rank is enough for. One broadcast: cheaper than an agreement and it carries the
    result too.
    """
    payload: bytes | None = None
    if comm.mesh.rank == 0:
        try:
            with comm.busy(what or "rank 0's part of a collective step"):  # the others wait: not a hang
                payload = json.dumps({"ok": fn()}).encode()
        except Exception as e:  # sent to every rank, re-raised below
            payload = json.dumps({"error": describe(e)}).encode()
    reply = json.loads(comm.broadcast_bytes(payload, 0, "world"))
    if "error" in reply:
        raise error_type(_prefixed(what, reply["error"]))
    return reply["ok"]
