"""DiLoCo's sync as the replicate layer's transaction: who takes part, a failure mid-sync, a replica joining.

Under DiLoCo the inner steps cross no replicas, so the replicate layer's step lifecycle (``replicate/layer.py``)
runs around each sync instead of each training step. :func:`transact_sync` is one sync of one fragment:

- ``begin_step`` / ``await_step``: the replicas present at the sync (an elastic layer waits for the sync's quorum
  here; a replica lost mid-phase is simply absent from it, and a replica that joins is healed now);
- each member all-reduces its pseudo-gradient with its phase weight (outer_step.py, [Note: pieces and weights]);
- ``step_failed`` when the all-reduce failed on this rank (a member died mid-sync), then ``finish_step``: the
  outer update lands only when the layer commits the sync on every member; a discarded sync is redone at once
  among the survivors (the next transaction), with the same pseudo-gradients and weights: no phase is lost.

On a fixed layer the lifecycle is a no-op and the sync runs once, as it always did.

A joining replica (restarted, or dropped while alive) enters at a sync boundary: the heal (``elastic_heal.py``
and :func:`heal_outer`) gives it the lowest-numbered live member's weights, inner optimizer state, global copy,
outer optimizer state and phase, before the sync's all-reduce; its phase weight is zeroed, so its pseudo-gradient
weighs 0 in that sync (and in a redo of it), and the landing leaves it with the new global copy like every
member. A replica built while its layer has a step open (:func:`join_open_sync`: a joiner healed at its
``ShardedOptimizer`` construction, or every replica at an elastic job's start) takes part in that sync right
there, so the members never wait for its start-up. A sync in which every replica weighs 0 (the job's start)
moves nothing: the outer optimizer does not step.
"""

from __future__ import annotations

import io
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from hsdp.engine.collectives import Comm
    from hsdp.engine.optim.outer_step import OuterState


def transact_sync(outer: OuterState, fragment: int) -> None:
    """Start and land ``fragment``'s sync as a transaction of the replicate layer (module docstring): redone among
    the survivors until the layer commits it."""
    layer = outer.model.mesh.replicas
    while True:
        # The int8 wire's residuals before this attempt (its hop replaces them, never writes into them): a redo
        # must send the same error-compensated values, not fold the failed attempt's rounding in twice.
        residuals = dict(outer.wire.residuals) if outer.wire is not None else None
        layer.begin_step()
        try:
            layer.await_step()  # the sync's members; joiners are healed here (a member may die meanwhile)
            sync = outer._start(fragment)
            sync.settle()
        except RuntimeError as e:  # (the coordinator stopping the job raises again at finish_step)
            if not layer.step_failed(f"fragment {fragment}'s sync: {type(e).__name__}: {e}"):
                raise
            sync = None
        if layer.finish_step():
            assert sync is not None, "a sync whose all-reduce failed here was committed (an hsdp bug)"
            outer._land(sync)
            return
        if residuals is not None:
            outer.wire.residuals = residuals


def join_open_sync(outer: OuterState) -> None:
    """At ``ShardedOptimizer`` construction: a replica admitted into a step under way (an elastic joiner, healed
    at the members' sync boundary; every replica at the job's start) takes part in that sync now, weighing 0."""
    if not outer.model.mesh.replicas.step_open:
        return
    policy = outer.policy
    # The fragment the members sync at the healed phase (an elastic mesh has one; mid-phase: sync_replicas's).
    due = [f for f in range(policy.fragments) if policy.offset(f) == outer.inner_steps] or [policy.fragments - 1]
    transact_sync(outer, due[0])
    if policy.fragments == 1:  # a whole-model sync leaves the phase at 0 (sync_replicas's too, mid-phase)
        outer.inner_steps = 0
    outer.mark_written()


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
    outer.pending, outer.carried = [], {}  # (none in flight on an elastic mesh: delay 0)
    if outer.wire is not None:  # the int8 wire's rounding error of syncs it never sent is not its own
        outer.wire.residuals = {}
    for unit in outer.units:
        unit.phase_weight.zero_()
        unit.phase_weighted = False
    outer.mark_written()


def _payload(outer: OuterState) -> bytes:
    buffer = io.BytesIO()
    torch.save({"outer": outer.outer.state_dict(), "phase": outer.inner_steps}, buffer)
    return buffer.getvalue()
