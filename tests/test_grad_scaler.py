"""fp16 loss scaling on a sharded model: an overflow in one rank's gradient chunk makes every rank skip the
step (``hsdp.ShardedGradScaler``); torch's own scaler, which checks only the chunk a rank holds, lets the
replicas diverge. In the same processes: fp16 averages split their division around the sum
(``divide_factors``), so gradients near fp16's top neither overflow nor tiny ones vanish."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from harness import run_distributed
from models import ParityNet, batch, loss_fn

import hsdp
from hsdp.engine.averaging import divide_factors, split_average
from hsdp.engine.collectives import Comm

TINY = 2.0**-23  # twice fp16's smallest subnormal: divided by 4 it rounds to 0


def _train(rank: int, scaler_cls: type, half: bool = False) -> dict:
    """fp16 compute on fp32 shards (AMP's setting), or fp16 shards (``half``)."""
    torch.manual_seed(0)
    fp16 = hsdp.MixedPrecision(param_dtype=torch.float16, buffer_dtype=torch.float16)
    model = hsdp.ShardedModel(ParityNet(), mesh=hsdp.init_mesh(1), mixed_precision=None if half else fp16)
    if half:  # 2 replicas of one shard
        model.half()
    opt = hsdp.ShardedOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1))
    scaler = scaler_cls(model, init_scale=1024.0) if scaler_cls is hsdp.ShardedGradScaler \
        else torch.amp.GradScaler("cpu", init_scale=1024.0)
    before = {n: p.detach().full_tensor().clone() for n, p in model.named_parameters()}
    x, y = batch(0, rank)
    scaler.scale(loss_fn(model(x), y).float()).backward()
    if rank == 1:  # an overflow in this rank's gradient only
        model.blocks[0].up.weight.grad.to_local()[0, 0] = float("inf")
    scaler.step(opt)
    scaler.update()
    stepped = any(not torch.equal(p.detach().full_tensor(), before[n]) for n, p in model.named_parameters())
    try:
        model.check_replicas()
        diverged = False
    except hsdp.ReplicaDivergence:
        diverged = True
    return {"stepped": stepped, "diverged": diverged, "scale": scaler.get_scale()}


def _half(value: float, n: int = 8) -> torch.Tensor:
    return torch.full((n,), value, dtype=torch.float16)


def _fp16_averages(rank: int) -> dict:
    """fp16 averages of values two of which overflow fp16, through ``Comm`` in the shard group (mesh 1x2) and
    the replicate group (mesh 2x1), and through an fp16 model's backward."""
    mine = 40000.0 + 64 * rank  # halves are multiples of 32: their sums are exact in fp16
    out: dict = {}
    shard, replicate = Comm(hsdp.init_mesh(2)), Comm(hsdp.init_mesh(1))
    rs_out = torch.empty(4, dtype=torch.float16)
    shard.reduce_scatter(rs_out, _half(mine), "shard")
    out["shard_rs"] = rs_out.tolist()
    replicate.reduce_scatter(rs_out, _half(mine), "replicate")  # gloo: all-to-all and a local sum
    out["replicate_rs"] = rs_out.tolist()
    for group, comm in (("shard", shard), ("replicate", replicate)):
        t = _half(mine)
        comm.all_reduce(t, group)
        out[f"{group}_ar"] = t.tolist()
    t = _half(mine)
    replicate.all_reduce(t, "replicate", op=dist.ReduceOp.SUM)  # what an average summed first would hold
    out["sum"] = t.tolist()
    # A real backward: d(sum(W x))/dW = x, so every weight's gradient is this rank's input.
    linear = torch.nn.Linear(4, 4, bias=False)
    torch.nn.init.constant_(linear.weight, 1e-4)  # a small output: only the gradient is large
    model = hsdp.ShardedModel(linear, mesh=hsdp.init_mesh(2)).half()
    model(torch.full((1, 4), mine, dtype=torch.float16)).sum().backward()
    out["grad"] = model.weight.grad.full_tensor().flatten().tolist()
    return out


def _both(rank: int, world: int) -> dict:
    return {"sharded": _train(rank, hsdp.ShardedGradScaler), "half": _train(rank, hsdp.ShardedGradScaler, half=True),
            "torch": _train(rank, torch.amp.GradScaler), "fp16": _fp16_averages(rank)}


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_distributed(_both, 2)


def test_every_rank_skips_an_overflow_on_one_rank(results: list[dict]) -> None:
    sharded = [r["sharded"] for r in results] + [r["half"] for r in results]
    assert not any(r["stepped"] for r in sharded) and not any(r["diverged"] for r in sharded), sharded
    assert all(r["scale"] == 512.0 for r in sharded)  # every rank backed off alike
    plain = [r["torch"] for r in results]  # what the wrapper prevents
    assert [r["stepped"] for r in plain] == [True, False] and all(r["diverged"] for r in plain), plain


def test_fp16_averages_do_not_overflow(results: list[dict]) -> None:
    mean = (40000.0 + 40064.0) / 2
    for r in (x["fp16"] for x in results):
        assert r["shard_rs"] == [mean] * 4 and r["replicate_rs"] == [mean] * 4, r
        assert r["shard_ar"] == [mean] * 8 and r["replicate_ar"] == [mean] * 8, r
        assert r["grad"] == [mean] * 16, r  # the shard reduce-scatter of a real backward
        assert all(math.isinf(v) for v in r["sum"]), r  # summed first, every one would have overflowed


def test_fp16_average_keeps_what_dividing_first_flushes_to_zero() -> None:
    # Comm's arithmetic around the collective for 4 ranks (2 ranks cannot show it: there pre == n), the sum
    # standing in for the collective's.
    received = _half(TINY, 4)
    op, post = split_average(received, dist.ReduceOp.AVG, 4)
    assert op == dist.ReduceOp.SUM and post == 2.0
    assert (received.sum() / post).item() == TINY
    assert (_half(TINY, 4) / 4).sum().item() == 0.0  # divided by n first, it vanishes
    bf16 = torch.full((4,), TINY, dtype=torch.bfloat16)  # bf16 has fp32's range: the backend's average
    assert split_average(bf16, dist.ReduceOp.AVG, 4) == (dist.ReduceOp.AVG, 1.0) and bf16[0].item() == TINY


@pytest.mark.parametrize("n,pre,post", [(1, 1, 1), (2, 2, 1), (3, 2, 1.5), (4, 2, 2), (8, 4, 2), (16, 4, 4),
                                        (6, 4, 1.5)])
def test_divide_factors_split_the_average_about_its_square_root(n: int, pre: float, post: float) -> None:
    assert divide_factors(n) == (pre, post)


def test_divide_factors_are_a_power_of_two_then_the_rest() -> None:
    for n in range(1, 257):
        pre, post = divide_factors(n)
        assert pre * post == n and math.log2(pre).is_integer(), n
        assert (pre * pre >= n and (pre / 2) ** 2 < n) or n == 1, n  # the smallest power of two >= sqrt(n)
        assert post <= math.sqrt(n), n
    with pytest.raises(ValueError, match="at least one rank"):
        divide_factors(0)
