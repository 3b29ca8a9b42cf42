"""``parallel.batch_weights``: the training batches of ``hsdp train`` cut by ``hsdp.distributed_sampler(weights=)``.

The corpus is read as non-overlapping windows of ``block_size + 1`` tokens (a sequence and its target shifted by
one), a map-style dataset. Every step's global batch (``train.batch_size`` x the data-parallel ranks, the even
split's) is the next slice of a seeded permutation of the windows, the same on every rank; the sampler cuts it
into contiguous per-rank pieces proportional to the weights and sets ``model.set_batch_weight(b_r)``, so the
gradient is the mean over the global batch whatever the weights: they change how long each rank takes, not the
training. A step's batch is a function of the step (resume and re-weighting mid-run need no state).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch.utils.data import Dataset

import hsdp
from hsdp.data.weighted_sampler import WeightedBatchSampler, smallest_batch_size, split_sizes
from hsdp.engine.mesh import HSDPMesh


def per_rank_weights(weights: Sequence[float], replica_sizes: Sequence[int]) -> list[float]:
    """One weight per data-parallel rank: ``weights`` as given when there is one per rank, or one per replica
    spread evenly over its ``replica_sizes[i]`` ranks (rank order). ``ValueError`` naming both counts."""
    ranks = sum(replica_sizes)
    if len(weights) == ranks:
        return [float(w) for w in weights]
    if len(weights) == len(replica_sizes):
        return [w / n for w, n in zip(weights, replica_sizes, strict=True) for _ in range(n)]
    raise ValueError(f"parallel.batch_weights has {len(weights)} entries: give one per data-parallel rank ({ranks}) "
                     f"or one per replica ({len(replica_sizes)}), in rank order")


def batch_size_problem(weights: Sequence[float], batch_size: int) -> str | None:
    """Why ``train.batch_size`` x the ranks cannot give every rank (per-rank ``weights``) a sequence."""
    if min(split_sizes(weights, batch_size * len(weights))) >= 1:
        return None
    need = math.ceil(smallest_batch_size(weights) / len(weights))
    return (f"train.batch_size = {batch_size} leaves some rank without a sequence of the global batch under "
            f"per-rank weights {list(weights)}: raise train.batch_size to {need} or more, or use less uneven "
            f"parallel.batch_weights")


class Windows(Dataset):
    """Window ``i``: tokens ``[i * block_size, (i + 1) * block_size]`` (``block_size + 1`` of them)."""

    def __init__(self, tokens: torch.Tensor, block_size: int) -> None:
        self.tokens, self.block_size = tokens, block_size

    def __len__(self) -> int:
        return max(0, (len(self.tokens) - 1) // self.block_size)

    def __getitem__(self, i: int) -> torch.Tensor:
        start = i * self.block_size
        return self.tokens[start:start + self.block_size + 1]


class WeightedTokenStream:
    """This rank's ``(x, y)`` batches of each step, its piece of the global batch under ``weights`` (one per
    data-parallel rank: :func:`per_rank_weights`). :meth:`reweight`
    changes the split from the next batch on (``parallel.batch_weights = "auto"`` after its calibration)."""

    def __init__(self, tokens: torch.Tensor, block_size: int, batch_size: int, weights: Sequence[float], *,
                 seed: int, mesh: HSDPMesh, model: hsdp.ShardedModel) -> None:
        self.dataset = Windows(tokens, block_size)
        self.block_size, self.seed, self.mesh, self.model = block_size, seed, mesh, model
        self.world_size = mesh.data_parallel_size
        self.global_batch = batch_size * self.world_size  # the even split's sequences per micro-batch
        self._cache: tuple[int, list[list[int]]] | None = None  # (epoch, its batches of this rank)
        self.sampler = self._sampler(weights)
        self.weights = tuple(weights)

    def _sampler(self, weights: Sequence[float]) -> WeightedBatchSampler:
        problem = batch_size_problem(weights, self.global_batch // self.world_size)
        if problem:
            raise ValueError(problem)
        return hsdp.distributed_sampler(self.dataset, self.mesh, weights=list(weights), batch_size=self.global_batch,
                                        seed=self.seed, model=self.model)

    def reweight(self, weights: Sequence[float]) -> None:
        """Split by ``weights`` from now on (and set this rank's batch weight to its new share)."""
        self.sampler = self._sampler(weights)
        self.weights = tuple(weights)
        self._cache = None

    @property
    def batch_sizes(self) -> list[int]:
        """Sequences per micro-batch of every data-parallel rank, in rank order."""
        return list(self.sampler.batch_sizes)

    @property
    def batch_size(self) -> int:
        """This rank's sequences per micro-batch."""
        return self.sampler.rank_batch_size

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's batch of (0-based) micro-step ``step``: int64 ``(x, y)``, ``(batch_size, block_size)``."""
        epoch, i = divmod(step, len(self.sampler))
        if self._cache is None or self._cache[0] != epoch:
            self.sampler.set_epoch(epoch)
            self._cache = (epoch, list(self.sampler))
        windows = torch.stack([self.dataset[j] for j in self._cache[1][i]]).long()
        return windows[:, :-1], windows[:, 1:]
