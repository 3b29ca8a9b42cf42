"""Bad input fails with a ValueError that names the fix, on every rank, before any collective."""

from __future__ import annotations

import os

import pytest
import torch
from harness import run_distributed
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import hsdp


def test_no_process_group_and_no_torchrun_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(ValueError, match="launch with `torchrun"):
        hsdp.init_mesh()


def test_degree_checked_against_torchrun_env_before_init(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "6")
    with pytest.raises(ValueError, match="not divisible"):
        hsdp.init_mesh(4)


class TwoDtypes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4).double()


def _expect(fn, fix: str) -> str:
    try:
        fn()
    except ValueError as e:
        assert fix in str(e), (fix, str(e))
        return "ok"
    return "no error"


def _bad_inputs(rank: int, world: int) -> dict[str, str]:
    mesh = hsdp.init_mesh(2)
    wrapped = hsdp.ShardedModel(nn.Linear(4, 4), mesh=mesh)
    flat_mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    bad_names = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    checks = {
        "degree too big": lambda: hsdp.init_mesh(4),
        "degree < 1": lambda: hsdp.ShardedModel(nn.Linear(2, 2), sharding_degree=0),
        "wrap typo": lambda: hsdp.ShardedModel(TwoDtypes(), mesh=mesh, wrap=["Linaer"]),
        "wrap type": lambda: hsdp.ShardedModel(TwoDtypes(), mesh=mesh, wrap=3),
        "1-D mesh": lambda: hsdp.init_mesh(device_mesh=flat_mesh),
        "wrong dim names": lambda: hsdp.init_mesh(device_mesh=bad_names),
        "wrapped twice": lambda: hsdp.ShardedModel(wrapped, mesh=mesh),
        "degree vs mesh": lambda: hsdp.ShardedModel(nn.Linear(2, 2), sharding_degree=1, mesh=mesh),
        "not elementwise": lambda: hsdp.ShardedOptimizer(wrapped, torch.optim.LBFGS(wrapped.parameters())),
        "foreign optimizer": lambda: hsdp.ShardedOptimizer(wrapped, torch.optim.SGD(nn.Linear(2, 2).parameters())),
        "plain model": lambda: hsdp.ShardedOptimizer(nn.Linear(2, 2), torch.optim.SGD(nn.Linear(2, 2).parameters())),
        "string hop": lambda: hsdp.ShardedModel(nn.Linear(2, 2), mesh=mesh, replica_hop="int8"),
        "dtype as precision": lambda: hsdp.ShardedModel(nn.Linear(2, 2), mesh=mesh, mixed_precision=torch.bfloat16),
    }
    fixes = {
        "degree too big": "use at most 2", "degree < 1": "below 1",
        "wrap typo": "not in the model", "wrap type": "wrap must be",
        "1-D mesh": "mesh_dim_names=('replicate', 'shard')",
        "wrong dim names": "mesh_dim_names=('replicate', 'shard')", "wrapped twice": "wrap each model once",
        "degree vs mesh": "pass only one", "not elementwise": "element-wise",
        "foreign optimizer": "model.parameters() after wrapping", "plain model": "wrap the model with ShardedModel",
        "string hop": "replica_hop=hsdp.Int8ErrorFeedbackHop()", "dtype as precision": "hsdp.MixedPrecision(",
    }
    out = {name: _expect(fn, fixes[name]) for name, fn in checks.items()}
    # After all those errors, the ranks still agree on the next collective: nothing was left half-issued.
    torch.distributed.barrier()
    return out


def test_bad_inputs_raise_on_every_rank_without_hanging() -> None:
    os.environ.pop("LOCAL_WORLD_SIZE", None)
    for result in run_distributed(_bad_inputs, 2, timeout=120):
        assert set(result.values()) == {"ok"}, result
