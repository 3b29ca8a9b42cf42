"""Optimizer steps in parts, unit by unit: each unit's parameters stepped as soon as they are ready.

An element-wise optimizer updates each element from its own gradient and state, so a step in parts, each on a
subset of the parameters, gives the values one step on all of them gives. Two schedules use it:

* late gradients (``runtime/late_grads.py``): the units in the order their inter-node hops land, so the step of
  the first runs under the last ones' hops;
* the replica-sharded optimizer: the slices in the next forward's unit order, each unit's slice all-gather
  queued as soon as its slices are stepped, so the first gathers overlap the step of the rest.

Each part calls ``step``: the wrapped class's own step without torch's step hooks, which
``ShardedOptimizer.step`` ran once around the whole.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from hsdp.engine.model import ShardedModel
from hsdp.engine.optim.local_step import LocalViews, local_step
from hsdp.engine.runtime.late_grads import LateGrads
from hsdp.engine.runtime.step_read import StepRead


def step_as_grads_land(optimizer: torch.optim.Optimizer, views: LocalViews, late: LateGrads, step_read: StepRead,
                       step: Callable[[], Any]) -> None:
    """Land the late gradients in backward order and step each unit's parameters as soon as theirs are final;
    then every other parameter (no gradient this backward, or one held from before), as one step would."""
    groups = [list(g["params"]) for g in optimizer.param_groups]
    stepped: set[int] = set()
    with local_step(optimizer, views):  # see [Note: why a local step]
        local = [list(g["params"]) for g in optimizer.param_groups]
        while late.pending:
            final = {id(p) for p in late.land_next()}
            for p in (p for params in groups for p in params if id(p) in final):
                views.view_of(p)  # its view's gradient: the landed one
            step_subset(optimizer, groups, local, final, step)
            stepped |= final
        step_subset(optimizer, groups, local, {id(p) for params in groups for p in params} - stepped, step)
    step_read.before_step()  # what the landing queued is dropped or read as after a backward (step_read.py)


def step_slices_unit_by_unit(optimizer: torch.optim.Optimizer, model: ShardedModel, views: LocalViews,
                             step: Callable[[], Any]) -> None:
    """Replica-sharded optimizer: step the slices one unit at a time, in the next forward's order, and queue
    each unit's slice all-gather as soon as its slices are stepped, so the first units' gathers (what the
    next forward needs first) overlap the optimizer's work on the rest, then that forward."""
    for sp in model.sharded_params():
        sp.refresh_slice()  # replicas of different degrees: the slice's own buffer, from the chunk
    groups = [list(g["params"]) for g in optimizer.param_groups]
    with local_step(optimizer, views):  # see [Note: why a local step]
        local = [list(g["params"]) for g in optimizer.param_groups]
        for unit in model.units_in_forward_order:
            step_subset(optimizer, groups, local, {id(p.sharded) for p in unit.params}, step)
            model.gather_stepped_slices([unit])


def step_subset(optimizer: torch.optim.Optimizer, groups: list[list[nn.Parameter]],
                local: list[list[nn.Parameter]], ids: set[int], step: Callable[[], Any]) -> None:
    """Inside ``local_step``: step the parameters whose ids are in ``ids`` (through their local views), no
    others; ``groups`` and ``local`` are each group's parameters and their views, in the same order."""
    for g, params, views in zip(optimizer.param_groups, groups, local, strict=True):
        g["params"] = [v for p, v in zip(params, views, strict=True) if id(p) in ids]
    if any(g["params"] for g in optimizer.param_groups):
        step()
