"""Which part of the data each rank reads.

In HSDP every rank (not every node) consumes a distinct batch: sharding splits the parameters, not the
data. The data-parallel rank of a process is its global rank; the data-parallel size is the world size.
With tensor parallelism the T ranks of one tensor-parallel group read the same batch: R x S readers.
Uneven batches (``weights=``) are in ``weighted_sampler.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, overload

import torch.distributed as dist
from torch.utils.data import Dataset, DistributedSampler

from hsdp.data.weighted_sampler import WeightedBatchSampler, checked_split_sizes, rank_weights
from hsdp.engine.mesh import HSDPMesh


class WeightedModel(Protocol):
    """What ``model=`` needs: a ``hsdp.ShardedModel``'s ``set_batch_weight``."""

    def set_batch_weight(self, weight: float | None) -> None: ...


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


@overload
def distributed_sampler(dataset: Dataset, mesh: HSDPMesh | None = None, *, shuffle: bool = True, seed: int = 0,
                        drop_last: bool = False, weights: None = None, batch_size: None = None,
                        model: None = None) -> DistributedSampler: ...


@overload
def distributed_sampler(dataset: Dataset, mesh: HSDPMesh | None = None, *, shuffle: bool = True, seed: int = 0,
                        drop_last: bool = False, weights: Sequence[float], batch_size: int,
                        model: WeightedModel | None = None) -> WeightedBatchSampler: ...


def distributed_sampler(dataset: Dataset, mesh: HSDPMesh | None = None, *, shuffle: bool = True, seed: int = 0,
                        drop_last: bool = False, weights: Sequence[float] | None = None,
                        batch_size: int | None = None,
                        model: WeightedModel | None = None) -> DistributedSampler | WeightedBatchSampler:
    """Give every data-parallel rank its own part of ``dataset``.

    Without ``weights``: a ``DistributedSampler`` (equal shares; pass the per-rank batch to the DataLoader).

    With ``weights`` (one positive number per data-parallel rank, or one per replica, split evenly over its
    ``sharding_degree`` ranks) and ``batch_size`` (the *global* batch in samples per step, i.e. per backward of
    every rank): a :class:`WeightedBatchSampler`, for ``DataLoader(dataset, batch_sampler=sampler)``, that
    yields this rank's indices per step. The rule: each epoch a permutation of the dataset seeded by
    ``seed + epoch`` (identical on every rank, no communication) is cut into global batches of ``batch_size``,
    and each is split into contiguous per-rank pieces of fixed sizes ``b_r`` proportional to the weights
    (largest-remainder rounding, ties to the lower rank; ``sampler.batch_sizes``, ``sampler.rank_batch_size``).
    ``drop_last=True`` drops the last incomplete global batch; ``drop_last=False`` completes it from the start
    of the permutation, so every sample is seen at least once per epoch, and exactly once when
    ``len(dataset)`` is a multiple of ``batch_size``. With ``model`` (a ``hsdp.ShardedModel``, whose mesh is
    then the default ``mesh``) the sampler calls ``model.set_batch_weight(b_r)`` once, now: the gradient is
    then one process's mean-loss gradient over the concatenated global batch, with no call in the loop.
    Because ``b_r`` is the same every step, setting it once is right even though a DataLoader (workers,
    prefetching) iterates its sampler ahead of the training loop; a per-batch weight would be set too early.

    Trade-offs: the split is fixed for the run (no rebalancing from measured speed); backward each batch's
    *mean* loss over samples (with a per-token mean and sequences of unequal length, set token counts with
    ``model.set_batch_weight`` yourself instead of ``model=``). ``ValueError`` names the fix for bad weights
    (wrong count, zero, negative, non-finite), a missing or too small ``batch_size`` (every ``b_r`` >= 1), or
    an unsized dataset, before anything collective.
    """
    if weights is None:
        if batch_size is not None or model is not None:
            raise ValueError("batch_size= and model= go with weights= (uneven batches): without weights pass the "
                             "per-rank batch_size to the DataLoader and leave the model's batch weight unset")
        return DistributedSampler(dataset, num_replicas=data_parallel_size(mesh), rank=data_parallel_rank(mesh),
                                  shuffle=shuffle, seed=seed, drop_last=drop_last)
    mesh = mesh if mesh is not None else getattr(model, "mesh", None)
    sizes = _weighted_sizes(weights, batch_size, mesh)
    sampler = WeightedBatchSampler(_length(dataset, sizes, drop_last), sizes, data_parallel_rank(mesh),
                                   shuffle=shuffle, seed=seed, drop_last=drop_last)
    if model is not None:
        if not callable(getattr(model, "set_batch_weight", None)):
            raise ValueError(f"model= takes a hsdp.ShardedModel (it calls model.set_batch_weight), got "
                             f"{type(model).__name__}")
        model.set_batch_weight(sampler.rank_batch_size)
    return sampler


def _weighted_sizes(weights: Sequence[float], batch_size: int | None, mesh: HSDPMesh | None) -> list[int]:
    if batch_size is None:
        raise ValueError("weights= needs batch_size=, the global batch in samples per step, which the weights "
                         "split over the ranks")
    replicas = mesh.replicas.data_parallel_degrees if mesh is not None else None
    return checked_split_sizes(rank_weights(weights, data_parallel_size(mesh), replicas), batch_size)


def _length(dataset: Dataset, sizes: Sequence[int], drop_last: bool) -> int:
    try:
        length = len(dataset)  # type: ignore[arg-type]
    except TypeError:
        raise ValueError("weights= needs a map-style dataset with __len__ (the epoch's permutation is cut into "
                         "global batches); split an iterable dataset yourself") from None
    if length == 0 or (drop_last and length < sum(sizes)):
        raise ValueError(f"the dataset has {length} samples, fewer than one global batch of {sum(sizes)}: no "
                         f"step would run; lower batch_size, or pass drop_last=False to pad")
    return length
