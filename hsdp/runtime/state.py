"""The runtime of one wrapped model: forward/backward hooks driving its units (FSDP2's FSDPState).

Per unit and step:
  pre_forward    wait for this unit's all-gather (issued now or prefetched), prefetch the next unit's,
                 hook the inputs for post_backward
  post_forward   hook the outputs for pre_backward; reshard unless ``reshard_after_forward=False``
  pre_backward   wait for the all-gather again if resharded, prefetch the unit whose backward is next
  post_backward  after the unit's last use: reduce-scatter its gradients; the previous unit's inter-node
                 hop starts now, overlapping this reduce-scatter and the backward of earlier units
  end of backward (root callback): reduce what no post_backward reached, wait for every reduction,
                 reshard everything, reset the per-step bookkeeping.

Prefetch order comes from the previous step: forward follows the order of pre_forward calls, backward the
reverse order of post_forward calls (the root wraps everything, so its backward comes first). At most two
units other than the root are unsharded at any time.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from hsdp.collectives import Comm
from hsdp.mesh import HSDPMesh
from hsdp.runtime.reduction import Reduction
from hsdp.runtime.unit import ShardedState, ShardUnit


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs; its backward runs once the unit's backward for that call is done."""

    @staticmethod
    def forward(ctx: Any, callback: Any, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.callback = callback
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.callback()
        return (None, *grads)


class ShardingState:
    """Hooks and per-step bookkeeping for the units of one root :class:`~hsdp.ShardedModel`."""

    def __init__(self, mesh: HSDPMesh, comm: Comm, units: list[ShardUnit]) -> None:
        self.mesh = mesh
        self.comm = comm
        self.units = units  # pre-order: root unit first
        # Gradient sync for the next backward: False/True as FSDP2's set_requires_gradient_sync and
        # set_requires_all_reduce (micro-batches of gradient accumulation).
        self.requires_gradient_sync = True
        self.requires_all_reduce = True
        self.prefetch = True
        self._pending: list[Reduction] = []
        self._callback_queued = False  # also "a backward is running": set by the first pre_backward
        self._handles: list[Any] = []
        self._forward_order: list[ShardUnit] = []  # pre_forward order of the previous step
        self._backward_order: list[ShardUnit] = []  # reverse post_forward order of the previous step
        self._pre_seen: list[ShardUnit] = []
        self._post_seen: list[ShardUnit] = []

    @property
    def root_unit(self) -> ShardUnit:
        return self.units[0]

    def register_hooks(self, units: list[ShardUnit]) -> None:
        for unit in units:
            m = unit.module
            self._handles.append(m.register_forward_pre_hook(
                functools.partial(self._pre_forward, unit), prepend=True, with_kwargs=True))
            self._handles.append(m.register_forward_hook(
                functools.partial(self._post_forward, unit), with_kwargs=True))

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    # -- forward ---------------------------------------------------------------------------------------
    def _pre_forward(self, unit: ShardUnit, module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if self._callback_queued:
            # Activation checkpointing recomputes this unit inside backward: it only needs its parameters;
            # its post_backward is already registered from the original forward.
            unit.wait_for_unshard()
            return args, kwargs
        if unit is self.root_unit:
            self._pre_seen, self._post_seen = [], []
            args, kwargs = self._cast_inputs(unit, args, kwargs)
        if unit not in self._pre_seen:
            self._pre_seen.append(unit)
        unit.wait_for_unshard()
        self._prefetch_after(unit, self._forward_order)
        if not torch.is_grad_enabled():
            return args, kwargs
        unit.used_in_grad_forward = True
        return self._register_post_backward(unit, args, kwargs)

    def _post_forward(self, unit: ShardUnit, module: Any, args: tuple, kwargs: dict, output: Any) -> Any:
        if self._callback_queued:
            return output  # recomputation in backward: the backward about to run needs the parameters
        if unit in self._post_seen:
            self._post_seen.remove(unit)
        self._post_seen.append(unit)
        if unit is self.root_unit:
            self._forward_order = self._pre_seen
            self._backward_order = self._post_seen[::-1]
            output = self._cast_outputs(unit, output)
        if not torch.is_grad_enabled():
            unit.reshard()
            return output
        self._register_pre_backward(unit, output)
        # The root's parameters are needed first in backward: keep them (as FSDP2 does).
        if unit.reshard_after_forward and unit is not self.root_unit:
            unit.reshard()
        return output

    def _prefetch_after(self, unit: ShardUnit, order: list[ShardUnit]) -> None:
        if not self.prefetch or unit not in order:
            return
        i = order.index(unit)
        if i + 1 < len(order) and order[i + 1].state is ShardedState.SHARDED:
            order[i + 1].unshard(async_op=True)

    @staticmethod
    def _cast_inputs(unit: ShardUnit, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        dtype = unit.policy.param_dtype
        if dtype is None or not unit.policy.cast_forward_inputs:
            return args, kwargs
        cast = functools.partial(_cast_floating, dtype=dtype)
        return tree_map(cast, args), tree_map(cast, kwargs)

    @staticmethod
    def _cast_outputs(unit: ShardUnit, output: Any) -> Any:
        dtype = unit.policy.output_dtype
        return output if dtype is None else tree_map(functools.partial(_cast_floating, dtype=dtype), output)

    def _register_post_backward(self, unit: ShardUnit, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        flat, spec = tree_flatten((args, kwargs))
        idx = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not idx:
            return args, kwargs
        unit.pending_post_backward += 1
        outs = _PostBackward.apply(functools.partial(self._post_backward, unit), *(flat[i] for i in idx))
        for i, t in zip(idx, outs, strict=True):
            flat[i] = t
        return tree_unflatten(flat, spec)

    def _register_pre_backward(self, unit: ShardUnit, output: Any) -> None:
        flat, _ = tree_flatten(output)
        hook = functools.partial(self._pre_backward, unit)
        for t in flat:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(hook)

    # -- backward --------------------------------------------------------------------------------------
    def _pre_backward(self, unit: ShardUnit, grad: torch.Tensor) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finalize_backward)
        unit.wait_for_unshard()
        self._prefetch_after(unit, self._backward_order)

    def _post_backward(self, unit: ShardUnit) -> None:
        unit.pending_post_backward -= 1
        if unit.pending_post_backward > 0:
            return  # used again earlier in forward: its backward is still to come
        self._reduce(unit)  # reshards the unit too

    def _reduce(self, unit: ShardUnit) -> None:
        reduction = unit.reduce_grads(self.requires_gradient_sync, self.requires_all_reduce)
        unit.used_in_grad_forward = False
        if reduction is None:
            return
        # Pipeline: the previous unit's reduce-scatter ran during this unit's backward; its inter-node
        # hop now overlaps with this unit's reduce-scatter and the backward of earlier units.
        if self._pending:
            self._pending[-1].start_replica_hop()
        self._pending.append(reduction)

    def _finalize_backward(self) -> None:
        for unit in reversed(self.units):
            has_leftover = any(p.unsharded.grad is not None for p in unit.params)
            if unit.used_in_grad_forward or has_leftover:
                self._reduce(unit)
        for reduction in self._pending:
            reduction.finish()
        self._pending.clear()
        for unit in self.units:
            unit.reshard()
            unit.pending_post_backward = 0
            unit.used_in_grad_forward = False
        self._callback_queued = False

    # -- explicit control ----------------------------------------------------------------------------
    def reshard_all(self) -> None:
        for unit in self.units:
            unit.reshard()

    def is_idle(self) -> bool:
        return all(u.state is ShardedState.SHARDED for u in self.units) and not self._pending


def _cast_floating(x: Any, dtype: torch.dtype) -> Any:
    if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
        return x.to(dtype)
    return x
