"""DiLoCo's sync as the replicate layer's transaction: who takes part, a failure mid-sync, a replica joining.

Under DiLoCo the inner steps cross no replicas, so the replicate layer's step lifecycle (``replicate/layer.py``)
runs around each fragment's sync instead of each training step. A sync's transaction:

- opens at its start (:func:`open_sync`): ``begin_step`` / ``await_step``, the replicas present at the sync (an
  elastic layer waits for the sync's quorum here; a replica lost mid-phase is simply absent from it, and a replica
  that joins is healed now), then each member starts the all-reduce of its pseudo-gradient with its phase weight
  (outer_step.py, [Note: pieces and weights]);
- votes as soon as its all-reduce completed on this rank (``step_reduced``, polled after every inner step by
  ``OuterState._vote_reduced``; the int8 wire's second stage runs on the hop worker, so the whole all-reduce
  completes in the background);
- closes where the outer update is to land (:func:`close_sync`): the all-reduce is waited, ``step_failed`` when it
  failed on this rank (a member died mid-sync), then ``finish_step``: the update lands only when the layer commits
  the sync on every member. A discarded sync is redone at once among the survivors (:func:`transact_sync`, the
  next transaction), with the same pseudo-gradients and weights: no phase is lost. As the members vote when
  their all-reduces complete, a member waits at the landing only where it comes before the slowest member's
  all-reduce (which starts at that member's own start) and one inner step after it (its poll).

With ``delay=0`` a sync opens and closes at once (:func:`transact_sync`). With ``delay > 0`` it stays open over
the ``delay`` inner steps its all-reduce overlaps and closes at the landing step; discarded there, it is redone
synchronously among the survivors before it lands (``OuterState`` keeps the buffers it sent for that). On a
fixed layer the lifecycle is a no-op: every sync commits once, as it always did.

A joining replica (restarted, or dropped while alive) enters at a sync boundary: the heal (``elastic_heal.py`` and
``outer_heal.py``) gives it the lowest-numbered live member's inner optimizer state, global copy (every fragment,
which become its weights), outer optimizer state and phase, in the await of a sync's transaction; its phase weights
are zeroed, so its pseudo-gradient weighs 0 in that sync (and in a redo of it), and each landing leaves it with the
fragment's new global copy like every member. It then runs the rest of the members' syncs of that inner step
(``outer_plan.py``): a replica built while its layer has a transaction open (``outer_heal.join_open_sync``: a
joiner healed at its ``ShardedOptimizer`` construction, or every replica at an elastic job's start) takes part in
that sync right there, so the members never wait for its start-up. A sync in which every replica weighs 0 (the
job's start) moves nothing: the outer optimizer does not step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar

if TYPE_CHECKING:
    from hsdp.engine.hops import Int8ErrorFeedbackHop
    from hsdp.engine.replicate.layer import ReplicateLayer

T = TypeVar("T")  # a sync in flight (outer_step.PendingSync)


@dataclass
class OpenSync(Generic[T]):
    """A sync whose transaction is open: ``sync`` in flight (``None``: its start failed on this rank, so the
    layer discards it), and the int8 wire's residuals before it, which a discard puts back."""

    sync: T | None
    residuals: dict | None


def open_sync(layer: ReplicateLayer, wire: Int8ErrorFeedbackHop | None, start: Callable[[], T],
              what: str) -> OpenSync[T]:
    """Open a sync's transaction on ``layer``: its members (joiners healed here), then ``start`` its all-reduce."""
    # The int8 wire's residuals before this attempt (its hop replaces them, never writes into them): a redo must
    # send the same error-compensated values, not fold the failed attempt's rounding in twice. (Only where the
    # layer can discard a sync: elsewhere nothing puts them back, and a sync in flight need not hold the old ones.)
    residuals = dict(wire.residuals) if wire is not None and layer.transactional else None
    layer.begin_step()
    try:
        layer.await_step()  # the sync's members; joiners are healed here (a member may die meanwhile)
        return OpenSync(start(), residuals)
    except RuntimeError as e:  # (the coordinator stopping the job raises again at finish_step)
        fail_sync(layer, what, e)
        return OpenSync(None, residuals)


def close_sync(layer: ReplicateLayer, wire: Int8ErrorFeedbackHop | None, opened: OpenSync[T],
               settle: Callable[[T], object], rejoined: Callable[[], bool], what: str) -> bool:
    """Close an open sync: wait for its all-reduce (``settle``), vote, and return whether the layer committed it
    (then it is to land). Discarded, the wire's residuals go back to what they were before it, unless this replica
    was healed as a joiner meanwhile (``rejoined``: a live replica the coordinator dropped is healed in
    ``finish_step``; the heal set its residuals)."""
    if opened.sync is not None:
        try:
            settle(opened.sync)
        except RuntimeError as e:
            fail_sync(layer, what, e)
            opened.sync = None
    if layer.finish_step():
        assert opened.sync is not None, "a sync whose all-reduce failed here was committed (an hsdp bug)"
        return True
    if wire is not None and opened.residuals is not None and not rejoined():
        wire.residuals = opened.residuals
    return False


def transact_sync(layer: ReplicateLayer, wire: Int8ErrorFeedbackHop | None, attempt: Callable[[], T],
                  land: Callable[[T], None], rejoined: Callable[[], bool], what: str) -> bool:
    """One sync as a transaction opened and closed at once (module docstring): ``attempt`` all-reduces the
    pseudo-gradients of the sync's members (and waits for it), ``land`` applies the outer update; redone among the
    survivors until the layer commits it. False, landing nothing, when this replica was healed as a joiner
    meanwhile (``rejoined``): the members' syncs are then its to follow, not its own (``outer_plan.py``)."""
    while True:
        opened = open_sync(layer, wire, attempt, what)
        if close_sync(layer, wire, opened, lambda sync: None, rejoined, what):
            assert opened.sync is not None
            land(opened.sync)
            return True
        if rejoined():
            return False


def fail_sync(layer: ReplicateLayer, what: str, e: RuntimeError) -> None:
    """A collective of the sync failed on this rank: the layer discards the sync everywhere, or it is raised."""
    if not layer.step_failed(f"{what}: {type(e).__name__}: {e}"):
        raise e
