"""Shard storage after wrapping: converting it (``ShardedModel._apply``) and allocating it for a meta model.

[Note: converting a wrapped model] ``nn.Module._apply`` (behind ``.to``, ``.double()``, ``.to_empty``, ...)
would convert each DTensor parameter on its own, so its local tensor would stop being a view into the
unit's flat shard buffer and the all-gather would read stale values. Instead the conversion runs once per
unit on ``sharded_flat`` (one tensor, so views stay views), every ``ShardedParam`` is re-bound to its slot
in the result, and only then does the default ``_apply`` see the module, with the sharded parameters
hidden, for buffers and anything else a module keeps. Nested ShardedModels (absorbed by the root) let the
root do it: their units belong to the root's state.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from hsdp.engine.mesh import HSDPMesh
from hsdp.engine.runtime.unit import ShardUnit

Convert = Callable[[torch.Tensor], torch.Tensor]
_APPLYING = "_hsdp_applying"  # set on the root while its default _apply recurses into nested wrappers


def apply_to_sharded_model(model: nn.Module, fn: Convert, recurse: bool,
                           default_apply: Callable[[Convert, bool], nn.Module]) -> nn.Module:
    """``ShardedModel._apply``: convert the shards unit by unit, then the rest through ``default_apply``."""
    state = model._hsdp_state
    root = state.root_unit.module
    if model is not root:
        if root.__dict__.get(_APPLYING):
            return default_apply(fn, recurse)  # the root converted this part's shards already
        raise ValueError(
            f"{type(model).__name__} is nested inside another ShardedModel whose units now hold its parameters: "
            f"call .to()/.float()/.double()/.to_empty() on the outermost ShardedModel"
        )
    state.reshard_all()
    convert_units(state.units, fn, state.mesh)
    params = [p for u in state.units for p in u.params]
    for p in params:  # hidden from the default _apply, which would convert each one on its own
        for slot in p.slots:
            slot.module._parameters[slot.name] = None
    object.__setattr__(root, _APPLYING, True)
    try:
        default_apply(fn, recurse)
    finally:
        root.__dict__.pop(_APPLYING, None)
        for p in params:
            p.to_sharded()
    buffer_dtype = state.root_unit.policy.buffer_dtype
    if buffer_dtype is not None:
        cast_floating_buffers(root, buffer_dtype)
    return model


def convert_units(units: list[ShardUnit], fn: Convert, mesh: HSDPMesh) -> None:
    """Apply ``fn`` to each unit's flat shard buffer and gradient chunks and re-bind its parameters.

    Every result is checked before any unit changes, so a refused conversion leaves the model as it was.
    A unit whose buffer ``fn`` returns unchanged (``.float()`` of fp32, ``.cpu()`` on CPU) is left alone.
    """
    plans = []
    for unit in units:
        if not unit.params:
            continue
        flat = unit.sharded_flat
        with torch.no_grad():
            new = fn(flat)
            if new is flat:
                continue
            grads = [None if (g := p.grad_local) is None else fn(g) for p in unit.params]
        _check_converted(unit, flat, new, mesh)
        plans.append((unit, new, grads))
    for unit, new, grads in plans:
        unit.adopt_flat(new, grads)
        # Partial sums of unsynchronised micro-batches follow the shards; they stay at least fp32, converted
        # directly (not through fn: a .to(bfloat16) there would round them first).
        if unit.partial is not None:
            unit.partial = _following(unit.partial, new)
        for p in unit.params:
            if p.grad_acc is not None:
                p.grad_acc = _following(p.grad_acc, new)


def allocate_shards(unit: ShardUnit, mesh: HSDPMesh) -> None:
    """Give a unit still on the meta device zero-filled shard storage on the mesh's device (no-op otherwise)."""
    if unit.params and unit.sharded_flat.is_meta:
        convert_units([unit], lambda t: torch.zeros_like(t, device=mesh.device), mesh)


def cast_floating_buffers(module: nn.Module, dtype: torch.dtype) -> None:
    for m in module.modules():
        for name, b in m._buffers.items():
            if b is not None and b.is_floating_point() and b.dtype != dtype:
                m._buffers[name] = b.to(dtype)


def _check_converted(unit: ShardUnit, flat: torch.Tensor, new: object, mesh: HSDPMesh) -> None:
    if not isinstance(new, torch.Tensor) or isinstance(new, DTensor):
        raise ValueError(f"{unit.name}: the conversion returned {type(new).__name__}, not a plain tensor: "
                         f"hsdp supports dtype and device conversions (.to, .float, .double, .half, .bfloat16, "
                         f".to_empty)")
    if new.shape != flat.shape:
        raise ValueError(f"{unit.name}: the conversion changes the shard's shape {tuple(flat.shape)} to "
                         f"{tuple(new.shape)}: hsdp supports dtype and device conversions only; reshape "
                         f"parameters before wrapping")
    if not new.is_floating_point():
        raise ValueError(f"{unit.name}: the conversion makes the parameters {new.dtype}: sharded parameters "
                         f"must stay floating point")
    if new.device != mesh.device and not (new.is_meta and flat.is_meta):
        raise ValueError(f"{unit.name}: the conversion moves the shards to {new.device}, but this mesh "
                         f"communicates on {mesh.device}: move the model before wrapping it, or build the mesh "
                         f"on that device (init_mesh with the matching backend)")


def _following(t: torch.Tensor, shards: torch.Tensor) -> torch.Tensor:
    """A partial sum on the shards' device, in their dtype or fp32, whichever is wider."""
    return t.to(device=shards.device, dtype=torch.promote_types(shards.dtype, torch.float32))
