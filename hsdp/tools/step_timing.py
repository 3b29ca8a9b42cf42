"""Timing distributed training steps one way for every tool (``hsdp tune``'s metrics files, ``hsdp bench``).

A step runs between barriers on every rank and counts as the slowest rank's wall time: the step is not over
until every rank is done. Around the measured steps, each node's inter-node link counters and each rank's
peak memory are gathered in rank order. Every rank must time the same steps (barriers and reductions).

The timing collectives go through a :class:`~hsdp.engine.collectives.Comm` of their own, so they never show
in a model's communication statistics.
"""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

from hsdp.engine.collectives import Comm


def link_counters() -> tuple[int, int]:
    """(sent, received) bytes of this node's inter-node link; (0, 0) off an emulated cluster."""
    iface = os.environ.get("GLOO_SOCKET_IFNAME", "")
    base = f"/sys/class/net/{iface}/statistics"
    if not iface or iface == "lo" or not os.path.isdir(base):
        return 0, 0
    with open(f"{base}/tx_bytes") as tx, open(f"{base}/rx_bytes") as rx:
        return int(tx.read()), int(rx.read())


def peak_rss_bytes() -> float:
    """This process's peak resident set so far (allocator, interpreter and libraries included)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0  # Linux reports KiB


class StepTimer:
    """Times steps on every rank of ``comm``'s world; a step's time is the slowest rank's.

    The first ``warmup`` steps are timed but not :attr:`measured` (allocator and backend warm-up). When the
    first measured step starts, the link counters are read, for :meth:`link_bytes_per_node`.
    """

    def __init__(self, comm: Comm, warmup: int) -> None:
        self.comm = comm
        self.warmup = warmup
        self.times: list[float] = []  # every step's, warm-up included
        self._link_start = (0, 0)

    @property
    def next_is_first_measured(self) -> bool:
        """Whether the next :meth:`step` starts the measurement (reset other counters before it)."""
        return len(self.times) == self.warmup

    @property
    def measured(self) -> list[float]:
        """Seconds of each step after the warm-up."""
        return self.times[self.warmup:]

    @contextmanager
    def step(self) -> Iterator[None]:
        """Time the block as one step: a barrier, the block, the maximum over the ranks."""
        if self.next_is_first_measured:
            self.comm.barrier()  # every rank's warm-up traffic is over before the counters are read
            self._link_start = link_counters()
        self.comm.barrier()
        t0 = time.perf_counter()
        yield
        elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=self.comm.mesh.device)
        self.comm.all_reduce(elapsed, "world", op=dist.ReduceOp.MAX, label="step time")
        self.times.append(elapsed.item())

    def link_bytes_per_node(self) -> list[list[float]]:
        """Per node, ``[sent, received]`` bytes its inter-node link carried since the measurement started
        (zeros off an emulated cluster). A collective: every rank calls it."""
        after = link_counters()
        mine = [float(after[0] - self._link_start[0]), float(after[1] - self._link_start[1])]
        if int(os.environ.get("LOCAL_RANK", "0")) != 0:  # one reader per node: its other ranks share the link
            mine = [0.0, 0.0]
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        return self.comm.all_gather_floats(mine)[::local]
