"""Models for meta-device construction: init lives in the modules' ``reset_parameters``, a non-persistent
buffer is computed in ``__init__`` (empty on meta), the embedding is tied to the head."""

from __future__ import annotations

import torch
from models import DIM, VOCAB, Block, batch, global_batch, loss_fn
from torch import nn
from torch.distributed.tensor import DTensor

import hsdp


class Rotary(nn.Module):
    """A rotary-style table built in ``__init__`` as a non-persistent buffer; ``reset_parameters`` rebuilds it."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dim = dim
        self.register_buffer("inv_freq", torch.empty(0), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        self.inv_freq = 1.0 / (10000 ** (torch.arange(0, self.dim, 2, dtype=torch.float32) / self.dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = torch.arange(x.shape[1], dtype=torch.float32, device=x.device)
        angles = torch.outer(t, self.inv_freq)
        return x * (1 + 0.1 * torch.cat([angles.cos(), angles.sin()], dim=-1))


class MetaNet(nn.Module):
    """Tied embedding/head (or not), uneven blocks (17 and 3 rows), a rotary buffer, a LayerNorm."""

    def __init__(self, tie: bool = True) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([Block() for _ in range(3)])
        self.rotary = Rotary(DIM)
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        if tie:
            self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.rotary(self.embed(ids))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def train_diff(model: nn.Module, ref: nn.Module, rank: int, world: int, steps: int) -> float:
    """Max parameter difference after ``steps`` AdamW steps on hsdp (per-rank batches) and on one plain
    process (the global batch); checks the replicas agree."""
    opt = hsdp.ShardedOptimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(steps):
        loss_fn(ref(global_batch(step, world)[0]), global_batch(step, world)[1]).backward()
        x, y = batch(step, rank)
        loss_fn(model(x), y).backward()
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    model.check_replicas()
    full = {n: p.full_tensor() if isinstance(p, DTensor) else p for n, p in model.named_parameters()}
    return max((full[n].detach() - ref.get_parameter(n).detach()).abs().max().item() for n in full)
