"""fp16 loss scaling on a sharded model: an overflow in one rank's gradient chunk makes every rank skip the
step (``hsdp.ShardedGradScaler``); torch's own scaler, which checks only the chunk a rank holds, lets the
replicas diverge."""

from __future__ import annotations

import torch
from harness import run_distributed
from models import ParityNet, batch, loss_fn

import hsdp


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


def _both(rank: int, world: int) -> dict:
    return {"sharded": _train(rank, hsdp.ShardedGradScaler), "half": _train(rank, hsdp.ShardedGradScaler, half=True),
            "torch": _train(rank, torch.amp.GradScaler)}


def test_every_rank_skips_an_overflow_on_one_rank() -> None:
    results = run_distributed(_both, 2)
    sharded = [r["sharded"] for r in results] + [r["half"] for r in results]
    assert not any(r["stepped"] for r in sharded) and not any(r["diverged"] for r in sharded), sharded
    assert all(r["scale"] == 512.0 for r in sharded)  # every rank backed off alike
    plain = [r["torch"] for r in results]  # what the wrapper prevents
    assert [r["stepped"] for r in plain] == [True, False] and all(r["diverged"] for r in plain), plain
