"""How a ShardedOptimizer meets ``torch.distributed.checkpoint.state_dict`` (``get_state_dict``, ``set_state_dict``,
``get_optimizer_state_dict``, ``set_optimizer_state_dict``): the FSDP2 recipe gives the same state dicts as
``optimizer.state_dict()``.

[Note: two layouts of one optimizer state]
torch's helpers assume ``optimizer.state_dict()`` is torch.optim's own layout, keyed by parameter index, and
rename each key through a two-way ``fqn <-> index`` map (``_get_optim_state_dict``). A ShardedOptimizer's
``state_dict()`` is keyed by parameter name already (hsdp's checkpoints, the Trainer, accelerate and Lightning
save it as it is), so that map would turn the names back into indices. torch has a protocol for an optimizer
whose ``state_dict`` attribute already returns the name-keyed layout (its own ``_patch_optimizer_state_dict``
installs one): the attribute is registered in ``_patched_state_dict``, and the helpers then call the
*class's* ``state_dict`` / ``load_state_dict`` instead. A ShardedOptimizer is such an optimizer: its class's
``state_dict`` is torch's index layout (the same stamped DTensor values), the instance's ``state_dict`` (set
here, registered) the name-keyed one. ``load_state_dict`` takes both layouts, so it needs no split.

Nothing of torch is replaced: one entry per optimizer in torch's registry, held weakly and removed when the
optimizer is collected. The inter-node hop residuals (``Int8ErrorFeedbackHop``) have no place in torch's
layout: the helpers leave them out, with a warning (load them with ``hsdp.load_checkpoint``, or save
``optimizer.state_dict()``, which has them).
"""

from __future__ import annotations

import functools
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.checkpoint import state_dict as dsd
from torch.distributed.tensor import DTensor

# torch >= 2.3; without it (a later torch that dropped the protocol) the helpers see the name-keyed layout.
_REGISTRY: set[Callable[..., Any]] | None = getattr(dsd, "_patched_state_dict", None)


def install_named_state_dict(optimizer: torch.optim.Optimizer, named: Callable[[Any], dict[str, Any]]) -> None:
    """Make ``optimizer.state_dict()`` return ``named(optimizer)`` (the name-keyed layout) while torch's state
    dict helpers read the class's ``state_dict`` (torch's index layout, which they rename themselves)."""
    ref = weakref.ref(optimizer)

    @functools.wraps(named)
    def state_dict() -> dict[str, Any]:
        live = ref()
        assert live is not None, "state_dict of a collected optimizer"
        return named(live)

    object.__setattr__(optimizer, "state_dict", state_dict)
    if _REGISTRY is None:
        warnings.warn("this torch has no torch.distributed.checkpoint.state_dict._patched_state_dict: its "
                      "get_state_dict would key a ShardedOptimizer's state by index; save optimizer.state_dict() "
                      "(keyed by name) instead", RuntimeWarning, stacklevel=3)
        return
    _REGISTRY.add(state_dict)
    weakref.finalize(optimizer, _REGISTRY.discard, state_dict)


def is_state_warmup(optimizer: torch.optim.Optimizer) -> bool:
    """Whether this ``step()`` is torch's ``_init_optim_state``: before any state exists, ``get_state_dict`` and
    friends step once with every learning rate 0 on all-zero gradients, only to create the state. That is no
    training step: it must not vote in an elastic step, count toward DiLoCo's phase or check replicas. (A real
    first step with lr 0 has gradients that are not all zero; one that has is a no-op either way.) Reads local
    shards only: no collective."""
    if optimizer.state or any(float(g.get("lr", 1.0)) != 0.0 for g in optimizer.param_groups):
        return False
    grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    local = [g.to_local() if isinstance(g, DTensor) else g for g in grads if g is not None]
    return len(local) == len(grads) and not any(bool(t.any()) for t in local)


def warn_dropped_hop_state(has_hop_state: bool) -> None:
    """torch's index layout (what the state dict helpers read) has no place for the hop residuals."""
    if has_hop_state:
        warnings.warn(
            "torch.distributed.checkpoint.state_dict's get_state_dict leaves out the inter-node hop residuals "
            "(Int8ErrorFeedbackHop): after loading that state dict they restart from zero. To keep them, save "
            "with hsdp.save_checkpoint, or dcp.save optimizer.state_dict() (keyed by name, residuals included)",
            RuntimeWarning, stacklevel=4)
