"""Bytes of model state per rank: parameters, gradients and optimizer state."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn

from hsdp.engine.model import ShardedModel
from hsdp.engine.runtime.dtensor import local_of


@dataclass(frozen=True)
class StateBytes:
    """Bytes held by one rank. For a ShardedModel, parameters count each unit's flat buffer (padding
    included); gradients and optimizer state count the tensors actually allocated."""

    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        """Parameters + gradients + optimizer state, in bytes."""
        return self.params + self.grads + self.optimizer

    def as_dict(self) -> dict[str, int]:
        """The three counts and their total, by name."""
        return {**asdict(self), "total": self.total}


def _nbytes(t: torch.Tensor) -> int:
    """Bytes this rank holds: a DTensor's local chunk, not its global size."""
    t = local_of(t)
    return t.numel() * t.element_size()


def _optimizer_bytes(optimizer: torch.optim.Optimizer | None) -> int:
    if optimizer is None:
        return 0
    return sum(_nbytes(v) for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor))


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> StateBytes:
    """This rank's model-state bytes, for a ShardedModel or a plain module."""
    if isinstance(model, ShardedModel):
        params = sum(_nbytes(u.sharded_flat) for u in model.units)
        # Replicas of different degrees with the optimizer sharded across them: each slice's own value buffer.
        params += sum(_nbytes(p.slice_values) for p in model.sharded_params() if p.slice_values is not None)
        grads = sum(_nbytes(g) for g in (p.grad_local for p in model.sharded_params()) if g is not None)
    else:
        params = sum(_nbytes(p) for p in model.parameters())
        grads = sum(_nbytes(p.grad) for p in model.parameters() if p.grad is not None)
    return StateBytes(params, grads, _optimizer_bytes(optimizer))
