"""Small models that exercise every awkward case of sharding."""

from __future__ import annotations

import torch
from torch import nn

VOCAB, DIM, ODD = 17, 16, 3


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, VOCAB)      # 17 rows: uneven chunks
        self.down = nn.Linear(VOCAB, DIM)
        self.gate = nn.Linear(DIM, ODD)      # 3 rows: empty chunks on 4 ranks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(x))) * self.gate(x).sigmoid().mean(-1, keepdim=True)


class ParityNet(nn.Module):
    """Tied embedding/head, a frozen layer, a buffer, a module used twice and a never-used parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([Block() for _ in range(3)])
        self.frozen = nn.Linear(DIM, DIM)
        self.frozen.requires_grad_(False)
        self.twice = nn.Linear(DIM, DIM)
        self.unused = nn.Linear(DIM, ODD)
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.linspace(0.5, 1.5, DIM))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        x = self.twice(self.frozen(x))
        x = self.twice(torch.tanh(x))
        return self.head(self.norm(x) * self.scale)


class BNNet(nn.Module):
    """BatchNorm between two linear layers: running statistics that each rank's batches move differently."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.bn = nn.BatchNorm1d(8)
        self.out = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.bn(self.inp(x))))


def tiny_gpt() -> nn.Module:
    """hsdp's GPT over :data:`VOCAB` tokens, small enough for a CPU test and splittable by ``hsdp.tp_plans.gpt_plan``
    over 2 tp ranks (sequences of an even length under its sequence parallelism); call it through :func:`logits`."""
    from hsdp.models.gpt import GPT, GPTConfig

    return GPT(GPTConfig(vocab_size=VOCAB, block_size=8, n_layer=2, n_head=2, n_embd=DIM))


def logits(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The logits of ``model`` on ``x``: what it returns, or the first item of GPT's ``(logits, loss)``."""
    out = model(x)
    return out[0] if isinstance(out, tuple) else out


def batch(step: int, rank: int, per_rank: int = 4, seq: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.randint(0, VOCAB, (per_rank, seq + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def global_batch(step: int, world: int, per_rank: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    xs, ys = zip(*(batch(step, r, per_rank) for r in range(world)))
    return torch.cat(xs), torch.cat(ys)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def train_steps(model: nn.Module, opt: torch.optim.Optimizer, rank: int, steps: range) -> list[float]:
    """Train ``model`` on this rank's :func:`batch` of each step in ``steps``; the losses."""
    losses = []
    for step in steps:
        x, y = batch(step, rank)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses
