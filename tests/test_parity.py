"""Parity: hsdp on every mesh shape trains to the same parameters as one plain process, and as DDP; with the
optimizer state sharded across replicas too (``shard_optimizer_across_replicas``) as well."""

from __future__ import annotations

import pytest
import torch
from harness import run_distributed
from models import ParityNet, batch, global_batch, loss_fn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

import hsdp

STEPS, LR, INIT_SEED = 5, 1e-2, 7


def _adamw(params) -> torch.optim.Optimizer:
    # Parameter groups as users write them: no weight decay on biases and norms.
    params = list(params)
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                             lr=LR)


def _reference(world: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(INIT_SEED)
    model = ParityNet()
    opt = _adamw(p for p in model.parameters() if p.requires_grad)
    for step in range(STEPS):
        x, y = global_batch(step, world)
        loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


def _train_hsdp(rank: int, sharding_degree: int, reshard: bool, nested: bool = False,
                sliced: bool = False) -> tuple[dict[str, torch.Tensor], list[float]]:
    torch.manual_seed(INIT_SEED + 100 * rank)  # different init per rank: wrapping must broadcast rank 0's
    if rank == 0:
        torch.manual_seed(INIT_SEED)
    model = ParityNet()
    mesh = hsdp.init_mesh(sharding_degree)
    if nested:  # FSDP2-style: wrap the blocks first, then the root absorbs them
        for block in model.blocks:
            hsdp.ShardedModel(block, mesh=mesh, reshard_after_forward=reshard)
    model = hsdp.ShardedModel(model, mesh=mesh, reshard_after_forward=reshard, shard_optimizer_across_replicas=sliced)
    opt = hsdp.ShardedOptimizer(model, _adamw(p for p in model.parameters() if p.requires_grad))
    losses = []
    for step in range(STEPS):
        x, y = batch(step, rank)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    names = {n for n, _ in model.named_parameters()}
    assert set(opt.state_dict()["state"]) <= names, "optimizer state must be keyed by original names"
    sharded_values = [v for k, v in model.state_dict().items() if k in names]
    assert all(isinstance(v, DTensor) for v in sharded_values), "parameters must be saved as DTensors"
    return hsdp.full_state_dict(model), losses


def _max_errors(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict[str, float]:
    assert list(got) == list(ref), "state_dict keys differ from the unwrapped model's"
    return {k: (got[k] - ref[k]).abs().max().item() for k in ref}


def _sweep(rank: int, world: int, degrees: list[int]) -> dict[str, float]:
    """Every (sharding degree, reshard_after_forward) configuration, and the replica-sharded optimizer on
    each mesh, inside one process spawn."""
    ref = _reference(world) if rank == 0 else None
    out = {}
    for degree in degrees:
        for reshard, sliced in ((True, False), (False, False), (True, True)):
            full, _ = _train_hsdp(rank, degree, reshard, sliced=sliced)
            if rank == 0:
                name = f"{world // degree}x{degree} reshard={reshard}" + (" sliced" if sliced else "")
                out[name] = max(_max_errors(full, ref).values())
    if world == 4:
        full, _ = _train_hsdp(rank, 2, True, nested=True)
        if rank == 0:
            out["2x2 nested"] = max(_max_errors(full, ref).values())
    return out


@pytest.mark.parametrize("world,degrees", [(1, [1]), (2, [1, 2]), (4, [2, 1, 4])])
def test_parity_against_single_process(world: int, degrees: list[int]) -> None:
    errors = run_distributed(_sweep, world, degrees)[0]
    assert len(errors) == 3 * len(degrees) + (world == 4)
    bad = {k: v for k, v in errors.items() if v > 1e-5}
    assert not bad, f"parameters differ from the single-process reference: {bad}"


def _versus_ddp(rank: int, world: int) -> float:
    full, hsdp_losses = _train_hsdp(rank, 2, True)
    torch.manual_seed(INIT_SEED)
    model = ParityNet()
    ddp = DistributedDataParallel(model, find_unused_parameters=True)
    opt = _adamw(p for p in ddp.parameters() if p.requires_grad)
    for step in range(STEPS):
        x, y = batch(step, rank)
        loss = loss_fn(ddp(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        assert abs(loss.item() - hsdp_losses[step]) < 1e-5, (step, loss.item(), hsdp_losses[step])
    if rank != 0:
        return 0.0
    return max(_max_errors(full, model.state_dict()).values())


def test_parity_against_ddp() -> None:
    assert run_distributed(_versus_ddp, 4)[0] < 1e-5
