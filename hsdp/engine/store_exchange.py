"""Small values every rank of a process group tells the others while the mesh is built, on its rendezvous store.

Before a mesh (and so hsdp's ``Comm``, the one caller of collectives) exists, ``init_mesh`` needs a few facts from
every rank: each node's rank count (nodes of different sizes), an elastic replica's admission step. They go
through the default group's store (torchrun's), as the watchdog's heartbeats do: no collective, so nothing to
account or overlap. Each call is numbered per rank (every rank makes the same calls in the same order), so two
meshes built in one process never read each other's values.
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch.distributed as dist

_PREFIX = "hsdp/exchange"
# A store client serves one request at a time: a blocking ``Store.wait`` holds its connection until the keys
# come, and the watchdog's heartbeats on the same store queue behind it. A rank waiting here for longer than
# the fault policy's timeout (a replica's ranks waiting for its admission, a boundary minutes away under
# DiLoCo) was then declared dead by its own peers. So waits poll: each check holds the connection a moment.
_POLL_S = 0.05


def exchange(value: str, timeout: timedelta = timedelta(minutes=5)) -> list[str]:
    """Every rank's ``value``, in rank order, on every rank of the default group; ``TimeoutError`` naming the
    ranks that gave none within ``timeout`` (the caller says what they were doing and which setting bounds it)."""
    store = dist.distributed_c10d._get_default_store()
    rank, world = dist.get_rank(), dist.get_world_size()
    call = int(store.add(f"{_PREFIX}/calls/{rank}", 1))
    store.set(f"{_PREFIX}/{call}/{rank}", value)
    keys = [f"{_PREFIX}/{call}/{r}" for r in range(world)]
    try:
        came = wait_polling(store, keys, timeout)
    except (RuntimeError, TimeoutError):  # the store's host is gone: say which ranks had not answered
        came = False
    if not came:
        raise TimeoutError(f"rank(s) {_missing(store, keys)} gave no value within {timeout.total_seconds():g} s")
    return [store.get(k).decode() for k in keys]


def wait_polling(store: dist.Store, keys: list[str], timeout: timedelta) -> bool:
    """Whether every key of ``keys`` is set on ``store`` within ``timeout``, checked every few milliseconds, so
    other threads' requests on the same store client (the watchdog's heartbeats) go on meanwhile."""
    deadline = time.monotonic() + timeout.total_seconds()
    while not store.check(keys):
        if time.monotonic() >= deadline:
            return False
        time.sleep(_POLL_S)
    return True


def _missing(store: dist.Store, keys: list[str]) -> list[int] | str:
    try:
        return [r for r, k in enumerate(keys) if not store.check([k])]
    except (RuntimeError, TimeoutError):  # the store's host is gone too
        return "unknown (the store does not answer)"
