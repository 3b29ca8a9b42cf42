"""The optimizer of ``hsdp train``: sharded AdamW with decoupled weight decay on matrices, and its
learning-rate schedule (a pure function of the step, so resuming needs no scheduler state)."""

from __future__ import annotations

import math

import torch

import hsdp
from hsdp.apps.train.config import OptimConfig


def lr_at(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """Learning rate of 1-based ``step``: linear warm-up over ``warmup_steps`` (cut to the run), then a
    cosine from ``lr`` down to ``min_lr`` at ``total_steps``."""
    warmup = min(cfg.warmup_steps, total_steps)
    if step <= warmup:
        return cfg.lr * step / max(warmup, 1)
    progress = (step - warmup) / max(total_steps - warmup, 1)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * min(progress, 1.0)))


def build_optimizer(model: hsdp.ShardedModel, cfg: OptimConfig) -> hsdp.ShardedOptimizer:
    """AdamW over the model's shards. Matrices (embeddings, linear and Conv1D weights) decay; biases and
    norm scales do not (decaying them hurts and saves nothing). Shards keep their parameter's rank, so
    ``dim() >= 2`` tells the two apart on every rank alike. AdamW is element-wise, so it also steps the
    1/R slices of ``parallel.shard_optimizer_across_replicas`` (an optimizer that reduces across elements,
    such as Adafactor or Muon, would be refused there by ``ShardedOptimizer``)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    adamw = torch.optim.AdamW([g for g in groups if g["params"]], lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))
    return hsdp.ShardedOptimizer(model, adamw)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
