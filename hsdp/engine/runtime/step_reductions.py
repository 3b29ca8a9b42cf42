"""One backward's gradient reductions, as the step's transaction with the replicate layer.

The hooks (``state.py``) hand each unit over as its backward ends (:meth:`StepReductions.add`): its
reduce-scatter is issued and its inter-node hop chained behind it. At the end of backward every hop is waited
for (:meth:`finish_hops`), then the buffers are synced and the step's one host read is taken (:meth:`conclude`).

The replicate layer (``replicate/layer.py``) sees one transaction per training step: :meth:`begin` at the
root's training forward (elastic: the coordinator learns the replica reached the step; stateful hops' state is
snapshotted where a step may be discarded, ``hop_transaction.py``), and ``step_failed`` when an inter-node
collective of the step fails: where the layer discards the step on every member the reductions are dropped and
the backward returns normally (``ShardedOptimizer.step`` then applies nothing); where it cannot, the error is
raised and the next forward repairs the torn step (``state.py``).

Where nothing needs them at the end of backward, the hops are left in flight (:meth:`finish_hops` with
``may_land_late``): the optimizer step lands them unit by unit and steps each unit as it lands; any earlier read
of a gradient lands them all first (``late_grads.py``).

Where a wait only orders device streams (CUDA), each hop is issued right behind its reduce-scatter. Where it
blocks the host (gloo on CPUs) that would stall the backward for the reduce-scatter (and gloo's reduce-scatter
reports completion only once waited: nothing to poll), the mesh's hop worker thread waits for it instead and
issues the hop the moment it completes (``hop_worker.py``).
"""

from __future__ import annotations

from hsdp.engine.mesh import HSDPMesh
from hsdp.engine.runtime.batch_weight import Weight
from hsdp.engine.runtime.buffers import BufferSync
from hsdp.engine.runtime.hop_transaction import HopSnapshot, snapshot_hops
from hsdp.engine.runtime.late_grads import LateGrads
from hsdp.engine.runtime.reduction import Reduction, reduce_grads
from hsdp.engine.runtime.step_read import StepRead
from hsdp.engine.runtime.unit import ShardUnit


class StepReductions:
    """The reductions in flight for the current backward of one wrapped model (module docstring)."""

    def __init__(self, mesh: HSDPMesh, units: list[ShardUnit], buffers: BufferSync, step_read: StepRead,
                 hops_on_device: bool) -> None:
        self.mesh, self.units, self.buffers, self.step_read = mesh, units, buffers, step_read
        self.hops_on_device = hops_on_device
        self.pending: list[Reduction] = []
        self.hop_snapshot: HopSnapshot = []  # stateful hops' state before this step (hop_transaction.py)
        self.late: LateGrads | None = None  # the last backward's hops, still in flight (late_grads.py)

    def begin(self) -> None:
        """A training forward began: the replicate layer's ``begin_step``; where the step may be discarded, the
        stateful hops' state is snapshotted (so must their residuals be)."""
        self.mesh.replicas.begin_step()
        if self.mesh.replicas.transactional:
            self.hop_snapshot = snapshot_hops(self.units)

    def add(self, unit: ShardUnit, gradient_sync: bool, all_reduce: bool, weight: Weight | None) -> None:
        """Reduce ``unit``'s gradients (its backward is done) and chain its inter-node hop."""
        self.land_late()  # a backward with no forward since the last one: its gradients add to those
        if self.pending:
            self.pending[-1].release_input()  # before this unit allocates its own (reduction.release_input)
        reduction = reduce_grads(unit, gradient_sync, all_reduce, weight)
        unit.used_in_grad_forward = False
        if reduction is None:
            return
        self.pending.append(reduction)
        if self.hops_on_device:
            reduction.start_replica_hop()  # chained right behind its reduce-scatter: a wait on the hop stream
        else:
            reduction.chain_hop()  # the host's hop stream: a worker thread waits for it (hop_worker.py)

    def finish_hops(self, may_land_late: bool = False) -> bool:
        """Wait for every reduction, every hop in flight before waiting for any (the last units' hops overlap
        each other); ``may_land_late`` (the caller's part of the conditions in ``late_grads.py``): where the rest
        hold, leave them in flight as :attr:`late` instead. False when an inter-node collective failed and the
        replicate layer discards the step (the reductions are dropped); raises when the layer cannot."""
        try:
            for reduction in self.pending:
                reduction.start_replica_hop()
            if may_land_late and self._may_land_late():
                for reduction in self.pending:
                    reduction.release_input()  # CUDA: not held through the optimizer step (a stream wait only)
                self.late, self.pending = LateGrads(self.pending, lambda landed: self.conclude(None, landed)), []
                return True
            for reduction in self.pending:
                reduction.finish()
        except RuntimeError as e:
            if not self.mesh.replicas.step_failed(f"{type(e).__name__}: {e}"):
                raise
            self.abandon(quiet=True)  # a member left mid-step: the step is discarded at the optimizer
            return False
        return True

    def _may_land_late(self) -> bool:
        """Every hop carries this step's gradients and was issued, its wait issues no collective, every parameter
        had a gradient here, nothing is due at the conclusion, and the layer never discards a step."""
        return bool(self.pending) and all(r.sync_replicas and r.waits_locally and not r.missing for r in self.pending) \
            and not self.buffers.due and not self.mesh.replicas.transactional

    @property
    def idle(self) -> bool:
        """No reduction of this model in flight."""
        return not self.pending and (self.late is None or not self.late.pending)

    def land_late(self) -> None:
        """Land the last backward's late gradients, if any (``late_grads.py``)."""
        late, self.late = self.late, None
        if late is not None:
            late.land_all()

    def take_late(self) -> LateGrads | None:
        """The last backward's late gradients, for the caller to land (the optimizer step, unit by unit)."""
        late, self.late = self.late, None
        return late

    def conclude(self, weight: Weight | None, landed: list[Reduction] | None = None) -> None:
        """After :meth:`finish_hops`: the buffers are synced as the gradients are (``buffers.py``; a broadcast
        that fails where the layer discards steps fails the step instead, and the buffers stay due), then the
        step's host read (``step_read.py``: it may raise a deferred check). Late gradients: once the last landed,
        over ``landed`` (``late_grads.py``)."""
        if landed is None and self.late is not None and self.late.pending:
            return
        reductions = self.pending if landed is None else landed
        try:
            self.buffers.after_backward()
        except RuntimeError as e:
            if not self.mesh.replicas.step_failed(f"buffer broadcast: {type(e).__name__}: {e}"):
                raise
        try:
            self.step_read.after_backward(reductions, weight)
        finally:
            reductions.clear()

    def abandon(self, quiet: bool = False) -> None:
        """Wait for every reduction in flight and drop it, with the units' partial micro-batch sums; ``quiet``:
        without warning (the layer discards the step)."""
        for reduction in self.pending:
            reduction.abandon(quiet=quiet)
        self.pending.clear()
        for unit in self.units:
            unit.partial = None
