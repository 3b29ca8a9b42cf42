"""Which part of the data each rank reads.

In HSDP every rank (not every node) consumes a distinct batch: sharding splits the parameters, not the
data. The data-parallel rank of a process is its global rank; the data-parallel size is the world size.
With tensor parallelism the T ranks of one tensor-parallel group read the same batch: R x S readers.
"""

from __future__ import annotations

import torch.distributed as dist
from torch.utils.data import Dataset, DistributedSampler

from hsdp.engine.mesh import HSDPMesh


def data_parallel_rank(mesh: HSDPMesh | None = None) -> int:
    """This rank's index among all data-parallel readers (``0`` without a process group)."""
    if mesh is not None:
        return mesh.data_parallel_rank
    return dist.get_rank() if dist.is_initialized() else 0


def data_parallel_size(mesh: HSDPMesh | None = None) -> int:
    """How many ranks read distinct data: the world size, R x S under tensor parallelism (``1`` without a
    process group)."""
    if mesh is not None:
        return mesh.data_parallel_size
    return dist.get_world_size() if dist.is_initialized() else 1


def distributed_sampler(dataset: Dataset, mesh: HSDPMesh | None = None, *, shuffle: bool = True,
                        seed: int = 0, drop_last: bool = False) -> DistributedSampler:
    """A ``DistributedSampler`` that gives every rank its own part of ``dataset``."""
    return DistributedSampler(dataset, num_replicas=data_parallel_size(mesh), rank=data_parallel_rank(mesh),
                              shuffle=shuffle, seed=seed, drop_last=drop_last)
