"""Small messages between the ranks of a training job: metric averages, JSON records, rank 0's decisions
(agreeing on errors is :mod:`hsdp.engine.agreement`, over the same ``comm``).

They go through their own :class:`hsdp.engine.collectives.Comm`, so the job's bookkeeping never shows up in
``model.comm_stats()`` (the per-step intra- and inter-node bytes are the model's alone). Every method is a
collective: all ranks call it, in the same order.
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist

from hsdp.engine.collectives import Comm
from hsdp.engine.mesh import HSDPMesh


class RankChannel:
    """Collectives over the whole world for metrics and coordination."""

    def __init__(self, mesh: HSDPMesh) -> None:
        self.mesh = mesh
        self.comm = Comm(mesh)

    @property
    def is_root(self) -> bool:
        return self.mesh.rank == 0

    def mean(self, values: list[float] | torch.Tensor) -> list[float]:
        """Element-wise average over the ranks of a few scalars (one all-reduce for all of them)."""
        t = torch.as_tensor(values, dtype=torch.float64).detach().reshape(-1).to(self.mesh.device)
        # SUM then divide: every backend supports SUM (gloo has no AVG); float64 keeps the sum exact enough.
        self.comm.all_reduce(t, "world", op=dist.ReduceOp.SUM, label="metrics")
        return (t / self.mesh.world_size).cpu().tolist()

    def gather(self, record: Any) -> list[Any]:
        """Every rank's JSON-serialisable ``record``, in rank order, on every rank."""
        return [json.loads(b) for b in self.comm.all_gather_bytes(json.dumps(record).encode())]

    def broadcast(self, record: Any) -> Any:
        """Rank 0's JSON-serialisable ``record`` on every rank (the others pass anything, e.g. ``None``)."""
        data = json.dumps(record).encode() if self.is_root else None
        return json.loads(self.comm.broadcast_bytes(data))
