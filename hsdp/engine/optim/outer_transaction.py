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
and ``outer_heal.py``) gives it the lowest-numbered live member's weights, inner optimizer state, global copy,
outer optimizer state and phase, before the sync's all-reduce; its phase weight is zeroed, so its pseudo-gradient
weighs 0 in that sync (and in a redo of it), and the landing leaves it with the new global copy like every
member. A replica built while its layer has a step open (``outer_heal.join_open_sync``: a joiner healed at its
``ShardedOptimizer`` construction, or every replica at an elastic job's start) takes part in that sync right
there, so the members never wait for its start-up. A sync in which every replica weighs 0 (the job's start)
moves nothing: the outer optimizer does not step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from hsdp.engine.hops import Int8ErrorFeedbackHop
    from hsdp.engine.replicate.layer import ReplicateLayer

T = TypeVar("T")  # a sync in flight (outer_step.PendingSync)


def transact_sync(layer: ReplicateLayer, wire: Int8ErrorFeedbackHop | None, attempt: Callable[[], T],
                  land: Callable[[T], None], what: str) -> None:
    """One sync as a transaction of the replicate layer ``layer`` (module docstring): ``attempt`` all-reduces the
    pseudo-gradients of the sync's members (and waits for it), ``land`` applies the outer update; redone among
    the survivors until the layer commits it. ``wire``: the int8 wire, whose residuals a redo puts back."""
    while True:
        # The int8 wire's residuals before this attempt (its hop replaces them, never writes into them): a redo
        # must send the same error-compensated values, not fold the failed attempt's rounding in twice.
        residuals = dict(wire.residuals) if wire is not None else None
        layer.begin_step()
        try:
            layer.await_step()  # the sync's members; joiners are healed here (a member may die meanwhile)
            sync: T | None = attempt()
        except RuntimeError as e:  # (the coordinator stopping the job raises again at finish_step)
            if not layer.step_failed(f"{what}: {type(e).__name__}: {e}"):
                raise
            sync = None
        if layer.finish_step():
            assert sync is not None, "a sync whose all-reduce failed here was committed (an hsdp bug)"
            land(sync)
            return
        if wire is not None and residuals is not None:
            wire.residuals = residuals
