"""The torch optimizers that are not element-wise, and the guard that refuses them on sharded parameters.

An optimizer that reduces across a parameter's elements (a norm, a factored moment, a matrix function)
computes wrong updates on dim-0 shards. hsdp knows torch's: it replaces the step of Adafactor and Muon by
an exact sharded one (``hsdp.ShardedOptimizer``) and refuses LBFGS and SparseAdam. Wrapping a model
installs one global optimizer pre-step hook (:func:`install_unwrapped_step_guard`) so that these
optimizers, stepping hsdp's parameters without ``ShardedOptimizer``, fail loudly instead of mis-stepping.
The guard lives below the model (which installs it) and knows a ``ShardedOptimizer`` by the model it
carries, so it needs neither class.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

# torch.optim classes (by name) that are not element-wise: ``None`` when ShardedOptimizer steps them exactly,
# else why it cannot and the fix, for the ValueError.
NOT_ELEMENTWISE: dict[str, str | None] = {
    "Adafactor": None,
    "Muon": None,
    "LBFGS": "it builds one flat vector of all gradients and line-searches on it; use Adam, AdamW or SGD",
    "SparseAdam": "it needs sparse gradients and hsdp's are dense; use Adam or AdamW",
}


def not_elementwise(optimizer: torch.optim.Optimizer) -> list[str]:
    """Names of the torch.optim classes in ``optimizer``'s MRO that are not element-wise, nearest first."""
    return [c.__name__ for c in type(optimizer).__mro__
            if c.__module__.startswith("torch.optim") and c.__name__ in NOT_ELEMENTWISE]


def refusal(optimizer: torch.optim.Optimizer) -> str | None:
    """Why ``optimizer`` cannot step dim-0 shards even through ShardedOptimizer (``None``: it can)."""
    return next((NOT_ELEMENTWISE[n] for n in not_elementwise(optimizer) if NOT_ELEMENTWISE[n]), None)


def install_unwrapped_step_guard() -> None:
    """Refuse, at their first step, torch optimizers that would silently mis-step hsdp's parameters because
    they were not wrapped in ``ShardedOptimizer``: Muon (whole-matrix updates; through DTensor it is off
    by 1e-3 and also all-reduces across nodes) and the rejected ones. Element-wise optimizers are exact
    unwrapped (through DTensor dispatch) and pass; Adafactor unwrapped would crash inside torch, so it is
    refused here with the fix instead. One global optimizer pre-step hook, installed once."""
    global _GUARD_INSTALLED
    if not _GUARD_INSTALLED:
        register_optimizer_step_pre_hook(_refuse_unwrapped)
        _GUARD_INSTALLED = True


_GUARD_INSTALLED = False


def _refuse_unwrapped(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if getattr(optimizer, "_hsdp_model", None) is not None:
        return  # a ShardedOptimizer
    known = not_elementwise(optimizer)
    if not known or not any(getattr(p, "_hsdp_sharded", False) for g in optimizer.param_groups for p in g["params"]):
        return
    raise ValueError(f"{type(optimizer).__name__} steps hsdp's sharded parameters directly, which gives wrong "
                     f"updates ({known[0]} is not element-wise): wrap it, "
                     f"optimizer = hsdp.ShardedOptimizer(model, optimizer)")
