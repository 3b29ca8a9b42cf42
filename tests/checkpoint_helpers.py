"""Model, data, training steps and state snapshots shared by the checkpoint tests."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
from models import DIM, ODD, VOCAB, Block, ParityNet, global_batch, loss_fn
from torch import nn
from torch.distributed.tensor import DTensor

import hsdp

LR, WD = 1e-2, 0.01


class CkptNet(ParityNet):
    """ParityNet with dropout (so resuming must restore torch's RNG), every trainable parameter used (so
    FSDP2's optimizer-state templates and hsdp's agree), and variants for bad-input tests."""

    def __init__(self, n_blocks: int = 3, unused_rows: int = ODD) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(n_blocks)])
        self.unused = nn.Linear(DIM, unused_rows)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = nn.functional.dropout(self.embed(ids), 0.2, self.training)
        for block in self.blocks:
            x = block(x)
        x = self.twice(self.frozen(x))
        x = self.twice(torch.tanh(x))
        return self.head(self.norm(x) * self.scale) + 0.0 * self.unused(x).sum()


def build(mesh: hsdp.HSDPMesh, seed: int = 0, sliced: bool = False,
          **net: Any) -> tuple[hsdp.ShardedModel, hsdp.ShardedOptimizer]:
    """``sliced``: optimizer state sharded across replicas too (``shard_optimizer_across_replicas``)."""
    torch.manual_seed(seed)
    model = hsdp.ShardedModel(CkptNet(**net), mesh=mesh, shard_optimizer_across_replicas=sliced)
    opt = hsdp.ShardedOptimizer(model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD))
    return model, opt


def seed_rank(rank: int) -> None:
    torch.manual_seed(100 + rank)
    random.seed(rank)
    np.random.seed(rank)


def sample() -> tuple[torch.Tensor, torch.Tensor]:
    """A batch drawn from numpy's and Python's global RNGs (resuming must restore both)."""
    ids = torch.from_numpy(np.random.randint(0, VOCAB, (4, 6)))
    ids = (ids + random.randrange(VOCAB)) % VOCAB
    return ids[:, :-1], ids[:, 1:]


def train_step(model: nn.Module, opt: torch.optim.Optimizer) -> float:
    model.train()
    x, y = sample()
    loss = loss_fn(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def eval_step(model: nn.Module, opt: torch.optim.Optimizer, rank: int, world: int) -> float:
    """One deterministic step on a fixed global batch split over the ranks (any mesh, same update)."""
    model.eval()
    x, y = global_batch(99, 4)
    rows = x.shape[0] // world
    sl = slice(rank * rows, (rank + 1) * rows)
    loss = loss_fn(model(x[sl]), y[sl])
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def full(value: Any) -> Any:
    if isinstance(value, DTensor):
        return value.full_tensor().clone()
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: full(v) for k, v in value.items()}
    return value


def model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: full(v) for k, v in model.state_dict().items()}


def optim_state(opt_sd: dict[str, Any]) -> dict[str, Any]:
    """Full tensors of an FQN-keyed optimizer state dict (hsdp's or FSDP2's get_state_dict)."""
    groups = [{k: v for k, v in g.items() if k != "params"} | {"params": sorted(g["params"])}
              for g in opt_sd["param_groups"]]
    return {"state": full(opt_sd["state"]), "param_groups": groups}


def same(a: Any, b: Any) -> bool:
    """Bitwise equality of nested dicts/lists of tensors and plain values."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    return a == b


def close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], tol: float = 1e-5) -> bool:
    return a.keys() == b.keys() and all(torch.allclose(a[k], b[k], rtol=tol, atol=tol) for k in a)


def local_snapshot(model: nn.Module, opt: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    """This rank's live parameter shards, buffers and optimizer state (to check that nothing changed)."""
    out = [t.detach().clone() for t in [*model.parameters(), *model.buffers()]]
    if opt is not None:
        out += [v.clone() for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return out
