"""Small values every rank of a process group tells the others while the mesh is built, on its rendezvous store.

Before a mesh (and so hsdp's ``Comm``, the one caller of collectives) exists, ``init_mesh`` needs a few facts from
every rank: each node's rank count (nodes of different sizes), an elastic replica's admission step. They go
through the default group's store (torchrun's), as the watchdog's heartbeats do: no collective, so nothing to
account or overlap. Each call is numbered per rank (every rank makes the same calls in the same order), so two
meshes built in one process never read each other's values.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

_PREFIX = "hsdp/exchange"


def exchange(value: str, timeout: timedelta = timedelta(minutes=5)) -> list[str]:
    """Every rank's ``value``, in rank order, on every rank of the default group."""
    store = dist.distributed_c10d._get_default_store()
    rank, world = dist.get_rank(), dist.get_world_size()
    call = int(store.add(f"{_PREFIX}/calls/{rank}", 1))
    store.set(f"{_PREFIX}/{call}/{rank}", value)
    keys = [f"{_PREFIX}/{call}/{r}" for r in range(world)]
    store.wait(keys, timeout)
    return [store.get(k).decode() for k in keys]
