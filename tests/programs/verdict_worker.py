"""A rank of four bare ranks (replicas of one rank each, a tiny model) where rank 2 sleeps in Python at step 3.

Usage (one process per rank, env:// rendezvous: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; without
TORCHELASTIC_USE_AGENT_STORE rank 0 hosts the store): ``python verdict_worker.py TIMEOUT INTERVAL LATE SECONDS``.
The others wait for rank 2 in the replica all-reduce; the first to judge the hang publishes the job's verdict.
The ranks listed in LATE (``1,3``; ``-`` for none) read it late: their watchdog threads are starved for SECONDS
from the moment the verdict is published (as a thread busy with a diagnosis of its own, or denied the CPU, is),
while a rank that has the verdict exits and closes its sockets under their collectives.
"""

from __future__ import annotations

import sys
import threading
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

import hsdp

FAILED_KEY = "hsdp/failed"  # the key hsdp's watchdog publishes a failure under


class StarvedStore:
    """The job's store as a starved watchdog thread sees it: the first call a thread other than the main one
    makes once a failure is published returns ``seconds`` late (every other call is the store's own)."""

    def __init__(self, store: dist.Store, seconds: float) -> None:
        self._store, self._seconds, self._starved = store, seconds, False

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._store, name)

        def call(*args: Any) -> Any:
            if (not self._starved and threading.current_thread() is not threading.main_thread()
                    and self._store.check([FAILED_KEY])):
                self._starved = True
                time.sleep(self._seconds)
            return method(*args)

        return call


def starve_the_watchdog(seconds: float) -> None:
    """Start hsdp's watchdog on a :class:`StarvedStore` (torch's own groups keep the real store)."""
    real, starved = c10d._get_default_store, StarvedStore(c10d._get_default_store(), seconds)

    def default_store() -> dist.Store:
        return starved if sys._getframe(1).f_globals.get("__name__", "").startswith("hsdp.engine.faults") else real()

    c10d._get_default_store = default_store


def main() -> None:
    timeout, interval, late, seconds = float(sys.argv[1]), float(sys.argv[2]), sys.argv[3], float(sys.argv[4])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(minutes=2))  # hsdp's watchdog must act long before
    rank = dist.get_rank()
    if late != "-" and str(rank) in late.split(","):
        starve_the_watchdog(seconds)
    # Every rank at the start line together: a loaded machine starts ranks seconds apart, which the short bound
    # here would report as a hang of its own at the first collective.
    hsdp.ShardedModel  # noqa: B018 (hsdp imports it on first use)
    dist.barrier()
    mesh = hsdp.init_mesh(1, fault_policy=hsdp.FaultPolicy(timeout=timeout, interval=interval))
    model = hsdp.ShardedModel(torch.nn.Linear(8, 8), mesh=mesh)
    dist.barrier()
    for step in range(1000):
        if step == 3 and rank == 2:
            print(f"rank 2: misbehaving (sleep) at {time.time():.3f}", flush=True)
            time.sleep(3600)
        model(torch.ones(2, 8)).sum().backward()
    print(f"rank {rank}: finished without noticing the hang", flush=True)


if __name__ == "__main__":
    main()
