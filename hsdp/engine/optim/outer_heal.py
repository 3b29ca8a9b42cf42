"""A replica joining DiLoCo at a sync boundary: what the heal sends besides the weights, and the sync it enters.

``outer_transaction.py`` says when this happens (an elastic joiner, or every replica at an elastic job's start);
here is what it takes: the lowest-numbered live member's global copy, outer optimizer state, phase and plan
(:func:`heal_outer`, after ``elastic_heal.py`` sent the weights and the inner optimizer state), and the sync under
way that it joins weighing 0 (:func:`join_open_sync`).

The global copy and the outer state's tensors shaped like it (SGD's momentum) are laid out like the units' flat
shards, so they cross as the weights do (``runtime/piece_broadcast.py``, ``state_rows.py``), from the source to the
joiners only: one send per joiner over the ``"replicate"`` group on a grid; across replicas of different shard
degrees piece by piece over the holder groups of the current quorum, each from the source's holder of those rows,
so a joiner of one degree is healed from a member of another, its rows re-cut on the way. The rest (scalars,
hyperparameters, the phase) is bytes, sent to every joiner rank from a source rank of its position group.
"""

from __future__ import annotations

import io
from typing import TYPE_CHECKING, Any

import torch

from hsdp.engine.optim.outer_plan import SyncPlan
from hsdp.engine.optim.state_rows import ROWS, Cut, exchange_rows, take_rows
from hsdp.engine.runtime.piece_broadcast import broadcast_bytes_whole, broadcast_rows
from hsdp.engine.runtime.reduction import slot_offsets

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
def heal_outer(outer: OuterState, comm: Comm, source: int, joining: bool, joiners: tuple[int, ...]) -> None:
    """DiLoCo's part of the heal from member ``source`` to the members ``joiners`` (on their ranks and the
    source's only: the other members' global copies and outer states are equal to the source's at a sync
    boundary), whatever the members' shard degrees (module docstring): the global copy, the outer optimizer's
    state and the phase. A joiner's weights become that global copy (every fragment: what the members hold after
    the sync under way lands, less their drift since each other fragment's last sync, which their own
    pseudo-gradients carry), and it forgets its own phase weights (its inner steps before the boundary do not
    count)."""
    cuts = _cuts(outer)
    for flat in outer.global_copy:
        layouts, offsets = zip(*cuts[id(flat)], strict=True)
        broadcast_rows(comm, flat, list(layouts), list(offsets), source, joiners)
    data = broadcast_bytes_whole(comm, None if joining else _payload(outer), source, joiners)
    state: dict[str, Any] = torch.load(io.BytesIO(data), weights_only=True)
    received = state["outer"]["state"]
    rows = exchange_rows(comm, outer.outer, cuts, received, [tuple(e) for e in state[ROWS]], source, joining,
                         joiners)
    if not joining:
        return
    for (i, k), v in rows.items():
        received[i][k] = v
    outer.outer.load_state_dict(state["outer"])
    for unit, flat in zip(outer.units, outer.global_copy, strict=True):
        # It enters with the global copy, not the source's weights: the source's inner steps since each fragment's
        # last sync are in the source's own pseudo-gradient; taken here too they would count again in the
        # joiner's, weighted by the joiner's samples (its phase weights restart below).
        unit.sharded_flat.copy_(flat)
    outer.inner_steps = state["phase"]
    outer.pending, outer.carried = [], {}  # the members' syncs in flight are not its own
    outer.joined = SyncPlan.joined(state["plan"], outer.due())  # the members' syncs from the one under way
    if outer.wire is not None:  # the int8 wire's rounding error of syncs it never sent is not its own
        outer.wire.residuals = {}
    for unit in outer.units:
        unit.phase_weight.zero_()
        unit.phase_weighted = False
    outer.mark_written()


def _cuts(outer: OuterState) -> dict[int, Cut]:
    """Each global copy flat's parameters (the outer optimizer's parameters are the flats): laid out like its
    unit's flat shard, padded chunks back to back."""
    return {id(flat): list(zip((p.layout for p in unit.params), slot_offsets(unit.params), strict=True))
            for unit, flat in zip(outer.units, outer.global_copy, strict=True)}


def _payload(outer: OuterState) -> bytes:
    """The outer optimizer's state less its flat-shaped tensors (listed under ``ROWS``: they cross piece by piece,
    ``state_rows.py``), and the phase."""
    state = outer.outer.state_dict()
    # New dicts: torch's state_dict hands out the live per-parameter state, which take_rows must not empty.
    state["state"] = {i: dict(entry) for i, entry in state["state"].items()}
    rows = take_rows(state["state"], [p for group in outer.outer.param_groups for p in group["params"]])
    buffer = io.BytesIO()
    plan = outer.plan.rest() if outer.plan is not None else None  # [Note: a joiner enters mid-plan]
    torch.save({"outer": state, ROWS: [list(e) for e in rows], "phase": outer.inner_steps, "plan": plan}, buffer)
    return buffer.getvalue()
