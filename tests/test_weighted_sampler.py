"""Uneven batches (``hsdp.distributed_sampler(..., weights=, batch_size=, model=)``): every global batch and
every epoch split over the ranks in the weights' proportions, the same split on every rank, the model told its
weight.

Pure Python with a fake mesh: sizes by largest remainder (1:2:3 of 12 -> 2, 4, 6), per-replica weights, every
index exactly once per epoch across the ranks' samplers when the dataset divides into global batches (padding
or dropping the last one otherwise), a new order but the same sizes per epoch, ``model.set_batch_weight`` called
once with the rank's size, and ``ValueError``s naming the fix. One spawn on a 2 x 2 gloo mesh: ParityNet trained
2 steps (AdamW) on weighted-sampler batches of 2, 4, 6 and 8 samples, ``model=`` given and no weight call in the
loop, equals one plain process on each step's whole global batch (1e-5).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from harness import run_distributed
from models import VOCAB, ParityNet, loss_fn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import hsdp
from hsdp.data.weighted_sampler import WeightedBatchSampler, split_sizes


def _mesh(rank: int, replicas: int, shards: int = 1) -> SimpleNamespace:
    return SimpleNamespace(data_parallel_rank=rank, data_parallel_size=replicas * shards,
                           replicate_degree=replicas, sharding_degree=shards,
                           replicas=SimpleNamespace(data_parallel_degrees=(shards,) * replicas))


def _samplers(length: int, weights: list[float], batch_size: int, replicas: int, shards: int = 1,
              **kwargs: object) -> list[WeightedBatchSampler]:
    """One sampler per data-parallel rank, each built as that rank would build its own."""
    return [hsdp.distributed_sampler(list(range(length)), _mesh(r, replicas, shards), weights=weights,
                                     batch_size=batch_size, **kwargs)
            for r in range(replicas * shards)]


def _steps(samplers: list[WeightedBatchSampler]) -> list[list[list[int]]]:
    """``[step][rank]`` -> the rank's indices."""
    return [list(step) for step in zip(*(list(s) for s in samplers), strict=True)]


def _flat(pieces: list[list[int]]) -> list[int]:
    return [i for piece in pieces for i in piece]


class _Recorder:
    def __init__(self) -> None:
        self.calls: list[object] = []

    def set_batch_weight(self, weight: object) -> None:
        self.calls.append(weight)


def test_sizes_follow_the_weights_by_largest_remainder() -> None:
    samplers = _samplers(36, [1, 2, 3], 12, replicas=3)
    assert [s.batch_sizes for s in samplers] == [[2, 4, 6]] * 3
    assert [s.rank_batch_size for s in samplers] == [2, 4, 6]
    assert all(len(s) == 3 and [len(b) for b in s] == [s.rank_batch_size] * 3 for s in samplers)
    assert split_sizes([1, 1, 1], 10) == [4, 3, 3]  # ties go to the lower rank
    assert split_sizes([1.5, 1, 1], 10) == [4, 3, 3] and split_sizes([1, 1, 2.5], 10) == [2, 2, 6]
    assert split_sizes([0.1, 0.2, 0.7], 10) == [1, 2, 7]  # exact, though 0.1 + 0.2 != 0.3 in floats
    assert split_sizes([0.1, 0.1, 0.1], 4) == [2, 1, 1] and split_sizes([1, 10, 10], 7) == [1, 3, 3]


def test_every_index_once_per_epoch_with_the_same_split_on_every_rank() -> None:
    samplers = _samplers(36, [1, 2, 3], 12, replicas=3)
    for epoch in range(2):
        for s in samplers:
            s.set_epoch(epoch)
        steps = _steps(samplers)
        seen = [i for step in steps for piece in step for i in piece]
        assert sorted(seen) == list(range(36)), epoch  # disjoint and covering
        # each step's pieces are one contiguous global batch of the epoch's (seed + epoch) permutation
        order = torch.randperm(36, generator=torch.Generator().manual_seed(epoch)).tolist()
        assert [_flat(step) for step in steps] == [order[i:i + 12] for i in range(0, 36, 12)]


def test_set_epoch_reorders_but_keeps_the_sizes() -> None:
    sampler = _samplers(36, [1, 2, 3], 12, replicas=3)[2]
    first = list(sampler)
    sampler.set_epoch(1)
    second = list(sampler)
    assert first != second and sorted(_flat(first)) != sorted(_flat(second))
    assert [len(b) for b in first] == [len(b) for b in second] == [6] * 3
    assert next(iter(_samplers(36, [1, 2, 3], 12, replicas=3, shuffle=False)[0])) == [0, 1]


def test_last_global_batch_padded_from_the_start_or_dropped() -> None:
    padded = _samplers(30, [1, 2, 3], 12, replicas=3, drop_last=False)
    steps = _steps(padded)
    assert len(padded[0]) == len(steps) == 3 and all(len(p) == s.rank_batch_size for st in steps
                                                     for p, s in zip(st, padded, strict=True))
    seen = [i for step in steps for piece in step for i in piece]
    order = torch.randperm(30, generator=torch.Generator().manual_seed(0)).tolist()
    assert seen == order + order[:6]  # every sample at least once; the first 6 again
    dropped = _samplers(30, [1, 2, 3], 12, replicas=3, drop_last=True)
    seen = [i for step in _steps(dropped) for piece in step for i in piece]
    assert len(dropped[0]) == 2 and seen == order[:24]
    tiny = _samplers(5, [1, 2, 3], 12, replicas=3)  # shorter than one batch: the permutation repeats
    order = torch.randperm(5, generator=torch.Generator().manual_seed(0)).tolist()
    tiled = order * 3
    assert _steps(tiny) == [[tiled[:2], tiled[2:6], tiled[6:12]]]


def test_per_replica_weights_split_evenly_over_the_replica() -> None:
    samplers = _samplers(48, [1, 3], 16, replicas=2, shards=2)  # 2 replicas of 2 ranks each
    assert samplers[0].batch_sizes == [2, 2, 6, 6]
    assert sorted(i for step in _steps(samplers) for piece in step for i in piece) == list(range(48))
    assert _samplers(48, [1, 1, 3, 3], 16, replicas=2, shards=2)[0].batch_sizes == [2, 2, 6, 6]
    assert _samplers(48, [1, 2], 9, replicas=2, shards=2)[0].batch_sizes == [2, 1, 3, 3]  # 0.75: rank 0


def test_model_gets_the_rank_size_once() -> None:
    models = [_Recorder() for _ in range(3)]
    samplers = [hsdp.distributed_sampler(list(range(36)), _mesh(r, 3), weights=[1, 2, 3], batch_size=12,
                                         model=models[r]) for r in range(3)]
    for s in samplers:
        list(s)
        s.set_epoch(1)
        list(s)
    assert [m.calls for m in models] == [[2], [4], [6]]


def test_without_weights_it_is_a_distributed_sampler() -> None:
    sampler = hsdp.distributed_sampler(list(range(10)), _mesh(1, 2), seed=3)
    assert type(sampler) is DistributedSampler and (sampler.num_replicas, sampler.rank, sampler.seed) == (2, 1, 3)


@pytest.mark.parametrize(("kwargs", "fix"), [
    ({"weights": [1, 2], "batch_size": 12}, "give one per data-parallel rank (3)"),
    ({"weights": [1, 0, 3], "batch_size": 12}, "weights[1] = 0: every weight must be a finite positive"),
    ({"weights": [1, -2, 3], "batch_size": 12}, "weights[1] = -2"),
    ({"weights": [1, 2, math.nan], "batch_size": 12}, "weights[2] = nan"),
    ({"weights": [1, 2, math.inf], "batch_size": 12}, "weights[2] = inf"),
    ({"weights": [True, 2, 3], "batch_size": 12}, "weights[0] = True"),
    ({"weights": [], "batch_size": 12}, "non-empty list"),
    ({"weights": [1, 2, 3]}, "weights= needs batch_size="),
    ({"weights": [1, 2, 3], "batch_size": 0}, "a positive int"),
    ({"weights": [1, 2, 3], "batch_size": 12.0}, "a positive int"),
    ({"weights": [1, 10, 10], "batch_size": 12}, "gives rank 0 no sample under weights proportional to"),
    ({"batch_size": 12}, "batch_size= and model= go with weights="),
    ({"model": _Recorder()}, "batch_size= and model= go with weights="),
    ({"weights": [1, 2, 3], "batch_size": 12, "model": object()}, "model= takes a hsdp.ShardedModel"),
    ({"weights": [1, 2, 3], "batch_size": 12, "drop_last": True, "length": 11}, "fewer than one global batch"),
    ({"weights": [1, 2, 3], "batch_size": 12, "length": 0}, "the dataset has 0 samples"),
])
def test_bad_arguments_name_the_fix(kwargs: dict, fix: str) -> None:
    length = kwargs.pop("length", 36)
    with pytest.raises(ValueError, match=fix.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")
                       .replace(")", r"\)")):
        hsdp.distributed_sampler(list(range(length)), _mesh(0, 3), **kwargs)


def test_too_small_batch_names_the_smallest_that_works() -> None:
    with pytest.raises(ValueError, match=r"use batch_size >= (\d+)") as info:
        hsdp.distributed_sampler(list(range(99)), _mesh(0, 3), weights=[1, 10, 10], batch_size=12)
    smallest = int(info.value.args[0].split("batch_size >= ")[1].split(",")[0])
    assert min(split_sizes([1, 10, 10], smallest)) == 1 and min(split_sizes([1, 10, 10], smallest - 1)) == 0
    hsdp.distributed_sampler(list(range(99)), _mesh(0, 3), weights=[1, 10, 10], batch_size=smallest)
    with pytest.raises(ValueError, match="one per replica"):
        hsdp.distributed_sampler(list(range(9)), _mesh(0, 2, 2), weights=[1, 2, 3], batch_size=8)
    with pytest.raises(ValueError, match="map-style dataset"):
        hsdp.distributed_sampler(iter(range(9)), _mesh(0, 3), weights=[1, 2, 3], batch_size=12)


# The distributed parity case.
WORLD, WEIGHTS, GLOBAL, STEPS, SEQ = 4, [1, 2, 3, 4], 20, 2, 6


def _dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    return TensorDataset(torch.randint(0, VOCAB, (GLOBAL * STEPS, SEQ + 1), generator=g))


def _train_weighted(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = hsdp.ShardedModel(ParityNet(), mesh=hsdp.init_mesh(2))
    opt = hsdp.ShardedOptimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    sampler = hsdp.distributed_sampler(_dataset(), weights=WEIGHTS, batch_size=GLOBAL, model=model)  # model's mesh
    sizes = []
    for (rows,) in DataLoader(_dataset(), batch_sampler=sampler):
        sizes.append(len(rows))
        loss_fn(model(rows[:, :-1]), rows[:, 1:]).backward()  # the rank's mean loss; no set_batch_weight here
        opt.step()
        opt.zero_grad()
    return {"sizes": sizes, "params": {n: p.detach().full_tensor() for n, p in model.named_parameters()}}


def _train_plain(weighted: bool = True) -> dict[str, torch.Tensor]:
    """One process on each step's global batch (the seed-0 permutation's consecutive 20 rows): the mean over
    every token, or (``weighted=False``) the plain average of the four ranks' mean losses."""
    torch.manual_seed(0)
    model = ParityNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rows = _dataset().tensors[0][torch.randperm(GLOBAL * STEPS, generator=torch.Generator().manual_seed(0))]
    for step in range(STEPS):
        batch = rows[step * GLOBAL:(step + 1) * GLOBAL]
        if weighted:
            loss = loss_fn(model(batch[:, :-1]), batch[:, 1:])
        else:
            pieces = batch.split([2, 4, 6, 8])
            loss = sum(loss_fn(model(p[:, :-1]), p[:, 1:]) for p in pieces) / WORLD
        loss.backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_weighted_sampler_training_equals_one_process_on_the_global_batch() -> None:
    results = run_distributed(_train_weighted, WORLD)
    expected, unweighted = _train_plain(), _train_plain(weighted=False)
    assert max((unweighted[n] - v).abs().max().item() for n, v in expected.items()) > 1e-4  # able to fail
    for rank, r in enumerate(results):
        assert r["sizes"] == [2 * (rank + 1)] * STEPS
        errors = {n: (r["params"][n] - v).abs().max().item() for n, v in expected.items()}
        worst = max(errors, key=errors.__getitem__)
        assert errors[worst] <= 1e-5, (rank, worst, errors[worst])
