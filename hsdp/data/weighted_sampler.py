"""Uneven batches: a batch sampler that splits every global batch over the data-parallel ranks in fixed
proportions (a faster GPU reads more samples), with the same split on every rank and no communication.

The rule, per epoch: a permutation of ``range(len(dataset))`` seeded by ``seed + epoch`` (as torch's
``DistributedSampler``), cut into consecutive global batches of ``batch_size``; each global batch is split into
contiguous pieces of sizes ``b_0, ..., b_{N-1}`` (rank order) proportional to the weights, rounded by largest
remainder. The sizes are the same every step, so a rank's gradient weight (``model.set_batch_weight(b_r)``) is
set once. :func:`hsdp.distributed_sampler` builds it and validates the user's arguments.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterator, Sequence
from fractions import Fraction

import torch
from torch.utils.data import Sampler


def rank_weights(weights: Sequence[float], data_parallel_size: int,
                 replica_sizes: Sequence[int] | None = None) -> list[Fraction]:
    """One exact weight per data-parallel rank: ``weights`` as given when there is one per rank, or, with one per
    replica (``replica_sizes``: each replica's rank count, in rank order, the same on a grid), each replica's
    weight split evenly over its ranks. Fractions, so the rounding is exact and the same on every rank."""
    values = _checked_values(weights)
    if len(values) == data_parallel_size:
        return values
    if replica_sizes is not None and len(values) == len(replica_sizes):
        return [w / n for w, n in zip(values, replica_sizes, strict=True) for _ in range(n)]
    count = None if replica_sizes is None else len(replica_sizes)
    per_replica = f" or one per replica ({count})" if count is not None and count != data_parallel_size else ""
    raise ValueError(f"weights has {len(values)} entries: give one per data-parallel rank "
                     f"({data_parallel_size}){per_replica}, in data-parallel rank order")


def _checked_values(weights: Sequence[float]) -> list[Fraction]:
    if isinstance(weights, str | bytes) or not isinstance(weights, Sequence) or not weights:
        raise ValueError(f"weights must be a non-empty list of positive numbers (one per rank or replica), "
                         f"got {weights!r}")
    for i, w in enumerate(weights):
        if isinstance(w, bool) or not isinstance(w, numbers.Real) or not math.isfinite(w) or w <= 0:
            raise ValueError(f"weights[{i}] = {w!r}: every weight must be a finite positive number (a rank's "
                             f"relative speed or share of the batch); drop a rank that should read nothing")
    return [exact(w) for w in weights]


def exact(weight: float | Fraction) -> Fraction:
    """``weight`` as the decimal it prints as (``0.1`` is 1/10), so ties the user wrote are exact ties."""
    if isinstance(weight, numbers.Rational):
        return Fraction(weight)
    return Fraction(str(float(weight)))


def split_sizes(weights: Sequence[float | Fraction], batch_size: int) -> list[int]:
    """``batch_size`` split proportionally to ``weights`` by largest remainder: each rank gets the floor of its
    exact quota, and the samples left go one each to the largest fractional parts (ties: the lower rank).
    Deterministic; the sizes sum to ``batch_size``. Sizes may be 0 (see :func:`checked_split_sizes`)."""
    weights = [exact(w) for w in weights]
    total = sum(weights)
    quotas = [batch_size * w / total for w in weights]
    sizes = [math.floor(q) for q in quotas]
    by_remainder = sorted(range(len(weights)), key=lambda r: (-(quotas[r] - sizes[r]), r))
    for r in by_remainder[:batch_size - sum(sizes)]:
        sizes[r] += 1
    return sizes


def smallest_batch_size(weights: Sequence[float | Fraction]) -> int:
    """The smallest global batch that gives every rank at least one sample under :func:`split_sizes`. At
    ``ceil(sum / min)`` the lightest rank's quota is >= 1, so the search ends there at the latest."""
    weights = [exact(w) for w in weights]
    bound = math.ceil(sum(weights) / min(weights))
    return next(b for b in range(len(weights), bound + 1) if min(split_sizes(weights, b)) >= 1)


def checked_split_sizes(weights: Sequence[Fraction], batch_size: object) -> list[int]:
    """:func:`split_sizes`, refusing a ``batch_size`` that is not a positive int or leaves a rank empty."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be the global batch per step in samples (a positive int), "
                         f"got {batch_size!r}")
    sizes = split_sizes(weights, batch_size)
    if min(sizes) < 1:
        raise ValueError(f"batch_size={batch_size} gives rank {sizes.index(0)} no sample under weights "
                         f"proportional to {[float(w) for w in weights]}: use batch_size >= "
                         f"{smallest_batch_size(weights)}, or less uneven weights")
    return sizes


class WeightedBatchSampler(Sampler[list[int]]):
    """Yields this rank's indices for each step: its contiguous piece of every global batch.

    Use as ``DataLoader(dataset, batch_sampler=sampler)``; call :meth:`set_epoch` before each epoch. Every rank
    builds the same permutation and sizes, so the pieces of one step are disjoint and cover the global batch.
    ``drop_last=True`` drops the epoch's last incomplete global batch (its ``len % batch_size`` samples go
    unseen that epoch); ``drop_last=False`` completes it with samples from the start of the epoch's
    permutation, as ``DistributedSampler`` pads, so those are seen twice. Every sample is seen exactly once per
    epoch when the dataset's length is a multiple of ``batch_size``.
    """

    def __init__(self, dataset_length: int, batch_sizes: Sequence[int], rank: int, *, shuffle: bool = True,
                 seed: int = 0, drop_last: bool = False) -> None:
        super().__init__()
        assert 0 <= rank < len(batch_sizes) and min(batch_sizes) >= 1, (rank, batch_sizes)
        self.dataset_length = dataset_length
        self.batch_sizes = list(batch_sizes)
        self.rank = rank
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.epoch = 0
        self._offset = sum(self.batch_sizes[:rank])  # where this rank's piece starts in each global batch

    @property
    def batch_size(self) -> int:
        """The global batch, in samples per step: the sum of :attr:`batch_sizes`."""
        return sum(self.batch_sizes)

    @property
    def rank_batch_size(self) -> int:
        """This rank's samples per step, ``batch_sizes[rank]``: the weight its backward counts for."""
        return self.batch_sizes[self.rank]

    def set_epoch(self, epoch: int) -> None:
        """Reshuffle for ``epoch`` (same value on every rank); the sizes do not change."""
        self.epoch = epoch

    def __len__(self) -> int:
        steps, rest = divmod(self.dataset_length, self.batch_size)
        return steps + (1 if rest and not self.drop_last else 0)

    def __iter__(self) -> Iterator[list[int]]:
        order = self._order()
        for step in range(len(self)):
            start = step * self.batch_size + self._offset
            yield order[start:start + self.rank_batch_size].tolist()

    def _order(self) -> torch.Tensor:
        """The epoch's permutation, repeated from its start to fill the last global batch when padding."""
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.dataset_length, generator=g)
        else:
            order = torch.arange(self.dataset_length)
        needed = len(self) * self.batch_size
        return order.repeat(math.ceil(needed / self.dataset_length))[:needed] if needed > len(order) else order
