"""A replica joining DiLoCo at a sync boundary: what the heal sends besides the weights, and the sync it enters.

``outer_transaction.py`` says when this happens (an elastic joiner, or every replica at an elastic job's start);
here is what it takes: the lowest-numbered live member's global copy, outer optimizer state, phase and plan
(:func:`heal_outer`, over the replicate group, after ``elastic_heal.py`` sent the weights and the inner optimizer
state), and the sync under way that it joins weighing 0 (:func:`join_open_sync`).
"""

from __future__ import annotations

import io
from typing import TYPE_CHECKING, Any

import torch

from hsdp.engine.optim.outer_plan import SyncPlan

if TYPE_CHECKING:
    from hsdp.engine.collectives import Comm
    from hsdp.engine.optim.outer_step import OuterState


def join_open_sync(outer: OuterState) -> None:
    """At ``ShardedOptimizer`` construction: a replica admitted into a sync under way (an elastic joiner, healed
    at the members' sync boundary; every replica at the job's start) takes part in that sync now, weighing 0, and
    in the members' other syncs of that inner step (``outer_plan.py``, [Note: a joiner enters mid-plan])."""
    if outer.model.mesh.replicas.step_open:
        outer.enter()


@torch.no_grad()
def heal_outer(outer: OuterState, comm: Comm, source: int, sending: bool, joining: bool) -> None:
    """DiLoCo's part of the heal, over the replicate group from member ``source`` (``sending`` on its ranks): the
    global copy, the outer optimizer's state and the phase; a joiner also forgets its own phase weights (its inner
    steps before the boundary do not count). The members' global copies and outer states are equal at a sync
    boundary, so receiving in place changes nothing for them."""
    for flat in outer.global_copy:
        comm.broadcast(flat, source, "replicate")
    payload = _payload(outer) if sending else None
    data = comm.broadcast_bytes(payload, source, "replicate")
    if not joining:
        return
    state: dict[str, Any] = torch.load(io.BytesIO(data), weights_only=True)
    outer.outer.load_state_dict(state["outer"])
    outer.inner_steps = state["phase"]
    outer.pending, outer.carried = [], {}  # the members' syncs in flight are not its own
    outer.joined = SyncPlan.joined(state["plan"], outer.due())  # the members' syncs from the one under way
    if outer.wire is not None:  # the int8 wire's rounding error of syncs it never sent is not its own
        outer.wire.residuals = {}
    for unit in outer.units:
        unit.phase_weight.zero_()
        unit.phase_weighted = False
    outer.mark_written()


def _payload(outer: OuterState) -> bytes:
    buffer = io.BytesIO()
    plan = outer.plan.rest() if outer.plan is not None else None  # [Note: a joiner enters mid-plan]
    torch.save({"outer": outer.outer.state_dict(), "phase": outer.inner_steps, "plan": plan}, buffer)
    return buffer.getvalue()
