"""DiLoCo's outer step (``replica_sync.py``): the global copy, the pseudo-gradient all-reduce, the outer update.

The global copy is one fp32 flat per unit, laid out like the unit's flat shard (each rank holds its own shard of it,
never a full copy), and the outer optimizer's state (its momentum) is sharded the same way. The units with parameters
are split into ``fragments`` contiguous fragments (:func:`split_fragments`; one fragment: all of them). After the inner
step (``ShardedOptimizer.step``) that brings the phase to a fragment's offset (``DiLoCo.offset``), the fragment's sync
is *started*: pseudo-gradient = global - local, all-reduced (average) over the replicate group in the wire dtype,
asynchronously ([Note: pieces and weights]; ``wire_dtype=torch.int8``: quantised with error feedback, reduce-scattered
and all-gathered in int8, ``outer_wire.py``). ``delay`` inner steps later it *lands*: the all-reduce is waited, the mean
is set as the fragment's global copies' gradient, the outer optimizer steps (torch's optimizers skip parameters without
a gradient, so one optimizer serves every fragment and the others' state is untouched), and the global copy is merged
into the shards (``mix * local + (1 - mix) * global``; a plain copy at ``mix=0``, and at ``sync_now``'s syncs of every
fragment, which leave the replicas equal). With one fragment and ``delay=0`` that is DiLoCo's sync after every H-th
step, on the same code path. Each sync is a transaction of the replicate layer (``outer_transaction.py``: on an elastic
mesh the replicas present at the sync, a failed all-reduce redone among the survivors, a joiner healed at the boundary
and weighing 0), opened at its start and closed at its landing (at once with ``delay=0``); the syncs one call runs are a
plan (``outer_plan.py``), which a joiner healed in one of them follows from there. Padding rows are zero on every
replica, so they stay zero. A checkpoint waits for the syncs in flight and keeps their means and steps left, so they
land at the same steps after a resume (``outer_checkpoint.py``, [Note: syncs in flight]).

[Note: loads after the optimizer] torch lets the optimizer be built before the weights are loaded
(``model.load_state_dict``, ``hsdp.load_pretrained``, ``hsdp.materialize``, a model-only ``hsdp.load_checkpoint``,
or a user's own ``p.copy_`` under ``no_grad``). The global copy must then be the loaded weights, or the next sync
pulls every replica back toward the weights the optimizer first saw. So the outer state records, after each
write of its own (an inner step, a landing, a load of its state), the model's load count (``HSDPState.loads``,
which hsdp's load paths bump: every rank runs them, so every rank sees the same count) and each parameter's
version counter (which a user's in-place write to the DTensor parameter bumps; the inner step writes the local
chunks, which leaves it alone); before the next inner step any change means the weights were loaded, and it
:meth:`OuterState.restart`s from them. The flat shard's own version counter cannot serve: collectives (a
broadcast from replica 0) and DTensor dispatch write it without bumping it.

[Note: pieces and weights] Across replicas of different shard degrees (``init_mesh(sharding_degree=[2, 1])``)
the flat shards are cut by each replica's own degree, so a unit's pseudo-gradient is averaged piece by piece
over the replicas' common partition, with the gradients' piece plan (``runtime/piece_plan.py``, at the
all-reduce floor; no pre-scale: each replica's pseudo-gradient counts once). Under batch weights
(``model.set_batch_weight``) a replica's pseudo-gradient counts by what it processed over the phase: each unit's
reductions add the replica's weight (summed over its ranks) to ``ShardUnit.phase_weight``; the sync sends
``W_r * delta_r`` followed by ``W_r`` and divides the average by the averaged weight, so the outer gradient is
``sum_r W_r delta_r / sum_r W_r`` (the weight travels in the wire dtype, as a hop's does). A fragment none of
whose units saw a weighted backward since its last sync takes the plain average, bit for bit. Every replica
must weight its batches or none (a mix within a replica is refused at the step; across replicas the buffers
would differ in length). The phase weights are not checkpointed: after a resume mid-phase they count from it.
A replica joining an elastic job restarts them at its heal: it weighs 0 in the sync it enters and, in each other
fragment's next sync, the batches it processed since.

[Note: one order everywhere] Every rank starts the same fragments' all-reduces after the same inner steps, in
fragment and unit order, and lands them in the order started, so the replicate group's collectives match on
every rank although several may be in flight.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from hsdp.engine.collectives import Handle
from hsdp.engine.hops import AllReduceHop
from hsdp.engine.optim.outer_pending import Carried, PendingSync
from hsdp.engine.optim.outer_plan import LAND, START, TRANSACT, SyncPlan
from hsdp.engine.optim.outer_transaction import OpenSync, close_sync, fail_sync, open_sync, transact_sync
from hsdp.engine.optim.outer_wire import wire_hop, wire_key
from hsdp.engine.replica_sync import DiLoCo
from hsdp.engine.runtime.piece_hop import follow_plan, plan_of, start_piece_hops
from hsdp.engine.runtime.piece_plan import PiecePlan
from hsdp.engine.runtime.reduction import slot_offsets

if TYPE_CHECKING:
    from hsdp.engine.model import ShardedModel
    from hsdp.engine.runtime.sharded_param import ShardedParam
    from hsdp.engine.runtime.unit import ShardUnit


def split_fragments(sizes: list[int], count: int) -> list[range]:
    """``count`` contiguous, non-empty runs of the indices of ``sizes`` whose sums are about equal: cut ``k``
    falls where the running sum is nearest ``k / count`` of the total. ``sizes`` are the units' parameter
    counts: the same on every rank and at any shard degree, so a resumed run splits its units the same way."""
    total, cuts = sum(sizes), [0]
    running = [sum(sizes[: i + 1]) for i in range(len(sizes))]
    for k in range(1, count):
        candidates = range(cuts[-1] + 1, len(sizes) - (count - k) + 1)  # leave one unit for each later run
        cuts.append(min(candidates, key=lambda i: abs(running[i - 1] - k * total / count)))
    cuts.append(len(sizes))
    return [range(a, b) for a, b in itertools.pairwise(cuts)]


def chunks(outer: OuterState, unit_index: int, flat: torch.Tensor) -> Iterator[tuple[ShardedParam, torch.Tensor]]:
    """Each parameter of unit ``unit_index`` with its chunk of ``flat`` (a view, shaped like the parameter's
    local chunk): ``flat`` is laid out like the unit's flat shard, padding between the chunks."""
    offset = 0
    for p in outer.units[unit_index].params:
        yield p, flat[offset: offset + p.layout.local_numel].view(p.layout.local_shape)
        offset += p.layout.padded_numel


def _take_weight(unit: ShardUnit) -> torch.Tensor:
    """The unit's phase weight ([Note: pieces and weights]), a replica that never weighted counting 1 per
    backward; reset for the next phase."""
    weight = unit.phase_weight.clone()
    unit.phase_weight.zero_()
    unit.phase_weighted = False
    return weight


def _numel(unit: ShardUnit) -> int:
    """The unit's parameter count (the parameters' full shapes: before data and tensor parallelism)."""
    return sum(math.prod(p.layout.dtensor_shape) for p in unit.params)


@dataclass(frozen=True)
class SyncStep:
    """What DiLoCo did after one inner step: the fragments whose all-reduce started and those whose outer update
    landed (both empty on most steps; with one fragment and no delay, every H-th step has ``(0,)`` in each), its
    wall seconds on this rank (``seconds``), and of those ``waited``: before a start, for the other replicas to
    reach the sync (an elastic mesh's quorum; a failed attempt's redo). Over a phase, ``waited`` is how long this
    replica idled for the others, which a batch weight can turn into training
    (``benchmarks/decentralized_balance.py``); a fixed mesh has no quorum: a late replica shows in ``seconds``."""

    started: tuple[int, ...] = ()
    landed: tuple[int, ...] = ()
    seconds: float = dataclasses.field(default=0.0, compare=False)  # timings: not what the step did
    waited: float = dataclasses.field(default=0.0, compare=False)


class OuterState:
    """The global copy, outer optimizer and in-flight fragment syncs of one model under DiLoCo."""

    def __init__(self, model: ShardedModel, policy: DiLoCo, steps: Callable[[], int] | None = None) -> None:
        self.model, self.policy = model, policy
        self.steps = steps or (lambda: 0)  # inner steps applied so far (the optimizer's counter)
        self.units = [u for u in model._hsdp_state.units if u.params]
        if policy.fragments > len(self.units):
            raise ValueError(f"DiLoCo(fragments={policy.fragments}): the model has {len(self.units)} units with "
                             f"parameters and each fragment needs one: use fragments <= {len(self.units)}, or "
                             f"wrap more submodules as units (ShardedModel(wrap=...))")
        self.fragments = split_fragments([_numel(u) for u in self.units], policy.fragments)
        self._plans: dict[int, dict[tuple[int, ...], PiecePlan | None]] = {0: {}, 1: {}}  # by the tail's length
        for unit in self.units:  # the reductions add each backward's weight ([Note: pieces and weights])
            unit.phase_weight = torch.zeros((), dtype=torch.float64, device=unit.sharded_flat.device)
        self.global_copy = [u.sharded_flat.detach().float().clone() for u in self.units]
        self.wire = wire_hop(policy)  # the int8 wire's quantiser and residuals (``outer_wire.py``); None for floats
        self._wire_plans: dict[str, PiecePlan] = {}  # the plan each unit's wire residuals follow (residual_plan)
        self.outer = policy.make_outer(self.global_copy)
        self.inner_steps = 0  # the phase: inner steps since the last fragment's sync started, mod H
        self.pending: list[PendingSync] = []  # started, not landed, in the order started
        self.carried: dict[int, Carried] = {}  # per fragment whose sync started and has not landed
        self.last: SyncStep | None = None  # what the last inner step did (None before the first)
        self._waited, self._mark = 0.0, 0.0  # SyncStep.waited so far; perf_counter before the await (_start)
        self.plan: SyncPlan | None = None  # the syncs of the call under way, which a joiner healed in one follows
        self.joined: SyncPlan | None = None  # healed as a joiner: the healing member's plan, to run instead
        self._seen = self._versions()  # see [Note: loads after the optimizer]
        model._hsdp_state.outer = self  # ShardedModel.check_replicas compares the global copy (compared_shards)

    def _versions(self) -> tuple[int, list[int]]:
        """The model's load count and its parameters' version counters ([Note: loads after the optimizer])."""
        return self.model._hsdp_state.loads, [p.sharded._version for u in self.units for p in u.params]

    def mark_written(self) -> None:
        """The flat shards were just written by DiLoCo's own steps (an inner step, a landing, a load of the
        outer state): not a load of the model."""
        self._seen = self._versions()

    def follow_loads(self) -> None:
        """Before an inner step: weights written since DiLoCo's last own write were loaded (see [Note: loads
        after the optimizer]), so restart from them."""
        if self._versions() != self._seen:
            self.restart()

    @torch.no_grad()
    def restart(self) -> None:
        """Global copy := the model's current weights, phase 0, a fresh outer optimizer state (its momentum), no
        sync in flight: what loading weights without DiLoCo's own state means (``outer_checkpoint.py``)."""
        self.drop_pending()
        for unit, flat in zip(self.units, self.global_copy, strict=True):
            flat.copy_(unit.sharded_flat)
        self.outer.state.clear()
        if self.wire is not None:
            self.wire.residuals = {}  # error feedback of the pseudo-gradients toward the old copy: gone
        for unit in self.units:
            _take_weight(unit)
        self.inner_steps = 0
        self.mark_written()

    def drop_pending(self) -> None:
        """Forget the syncs in flight (waiting for their all-reduces first: every rank started them) and the
        weights they carried."""
        self.settle()
        self.pending, self.carried = [], {}

    def compared_shards(self, params: list[ShardedParam]) -> list[torch.Tensor]:
        """Each of ``params``' chunk of the global copy, shaped like its local shard: what every replica holds
        equal at every step (mid-phase their weights differ, and under Streaming DiLoCo they never all agree),
        so what ``check_replicas`` compares."""
        found = {id(p): chunk for i in range(len(self.units)) for p, chunk in chunks(self, i, self.global_copy[i])}
        return [found[id(p)] for p in params]

    def fragment_units(self, fragment: int) -> list[ShardUnit]:
        return [self.units[i] for i in self.fragments[fragment]]

    def after_inner_step(self) -> bool:
        """Count one inner step, then run its syncs (``outer_plan.py``): land the syncs due, start those whose
        offset this is (landing them at once when ``delay`` is 0). True when an outer update landed."""
        began = time.perf_counter()
        self.inner_steps = (self.inner_steps + 1) % self.policy.every
        self._vote_reduced()
        for sync in self.pending:
            sync.left -= 1
        lands = [s.fragment for s in self.pending if s.left <= 0]
        starts = [f for f in range(self.policy.fragments) if self.policy.offset(f) == self.inner_steps]
        return self.run(SyncPlan.after_step(lands, starts, self.policy.delay), began)

    def _vote_reduced(self) -> None:
        """An open sync whose all-reduce already completed here is settled and voted on now, not where it lands
        (``ReplicateLayer.step_reduced``): the decision then waits only for the slowest member's all-reduce, not
        for it to reach its landing too, so ``delay`` inner steps absorb that much of the members' spread. A
        failure found here is the sync's, as at its landing."""
        for sync in self.pending:
            if sync.opened and not (sync.failed or sync.voted) and sync.ready() and self._settle_or_fail(sync):
                self.model.mesh.replicas.step_reduced()
                sync.voted = True

    def sync_now(self) -> None:
        """Sync every fragment now: land the syncs in flight, then all-reduce and land every fragment's
        pseudo-gradient (one outer step per fragment), so every replica holds the global copy; the phase
        restarts at 0. The same calls on every rank (the end of training, before evaluating or exporting).
        Right after DiLoCo's own sync of its one fragment (phase 0, none in flight) nothing trained since: no
        collective, no outer step (on a zero pseudo-gradient it would still move the weights by the momentum);
        the replicas only take the global copy (with ``mix > 0`` each kept a share of its own)."""
        if self.inner_steps == 0 and not self.pending and self.policy.fragments == 1:
            self._take_global()
            return
        self.run(SyncPlan.sync_all([s.fragment for s in self.pending], self.policy.fragments))

    @torch.no_grad()
    def _take_global(self) -> None:
        for unit, global_copy in zip(self.units, self.global_copy, strict=True):
            unit.sharded_flat.copy_(global_copy)
        self.last = SyncStep()
        self.mark_written()

    def enter(self) -> None:
        """Admitted into a sync under way (``outer_heal.join_open_sync``): run the healing member's plan from that
        sync on, or at an elastic job's start the sync of the fragment due ([Note: a joiner enters mid-plan])."""
        plan, self.joined = self.joined or SyncPlan.joined(None, self.due()), None
        self.run(plan)

    def due(self) -> int:
        """The fragment whose sync starts at the current phase (the last one, synced at phase 0, between)."""
        return next((f for f in range(self.policy.fragments) if self.policy.offset(f) == self.inner_steps),
                    self.policy.fragments - 1)

    def run(self, plan: SyncPlan, began: float | None = None) -> bool:
        """Run ``plan``'s syncs in order, each a transaction of the replicate layer; a replica healed as a joiner
        meanwhile (dropped while alive, it rejoined in a sync's vote) drops the rest of its own plan for the
        healing member's. True when an outer update landed. ``began``: the ``perf_counter`` the step's sync work
        began at (``SyncStep.seconds``), by default now."""
        began = time.perf_counter() if began is None else began
        self._waited = 0.0
        started: list[int] = []
        landed: list[int] = []
        self.plan = plan
        while plan.at < len(plan.steps):
            kind, fragment = plan.steps[plan.at]
            if kind != LAND:
                started.append(fragment)
            if self._run_step(kind, fragment) and kind != START:
                landed.append(fragment)
            if self.joined is not None:  # healed meanwhile: the member's plan ([Note: a joiner enters mid-plan])
                plan, self.joined, started, landed = self.joined, None, [], []
                self.plan = plan
                continue
            plan.at += 1
        self.plan = None
        if plan.phase is not None:
            self.inner_steps = plan.phase
        self.last = SyncStep(tuple(started), tuple(landed), time.perf_counter() - began, self._waited)
        self.mark_written()
        return bool(landed)

    def _run_step(self, kind: str, fragment: int) -> bool:
        """One step of a plan; True when it committed (and landed, but for a start)."""
        if kind == START:
            self.pending.append(self._open(fragment))
            return True
        if kind == TRANSACT:
            return self.transact(fragment)
        sync = next((s for s in self.pending if s.fragment == fragment), None)
        if sync is None:  # a joiner healed in the members' redo of this landing: it takes part in the redo
            return self.transact(fragment)
        self.pending.remove(sync)
        return self._close(sync)

    def transact(self, fragment: int) -> bool:
        """Start and land ``fragment``'s sync as one transaction of the replicate layer (``outer_transaction.py``:
        redone among the survivors until committed; on a fixed layer, once). False when this replica was healed
        as a joiner meanwhile (nothing landed)."""
        def attempt() -> PendingSync:
            sync = self._start(fragment)
            sync.settle()
            return sync

        self._mark = time.perf_counter()
        return transact_sync(self.model.mesh.replicas, self.wire, attempt, self._land, self._rejoined,
                             f"fragment {fragment}'s sync")

    def _open(self, fragment: int) -> PendingSync:
        """Start ``fragment``'s sync with its transaction left open, to land ``delay`` inner steps later."""
        if self.model.mesh.replicas.transactional:
            # What it sends, taken before the await: a start that fails there is redone with the same buffers.
            self._carried(fragment)
        self._mark = time.perf_counter()
        opened = open_sync(self.model.mesh.replicas, self.wire, lambda: self._start(fragment),
                           f"fragment {fragment}'s sync")
        sync = opened.sync or PendingSync(fragment, self.policy.delay, [], [], failed=True)
        sync.opened, sync.residuals = True, opened.residuals
        return sync

    def _close(self, sync: PendingSync) -> bool:
        """Land ``sync``, due, once its transaction commits; discarded, it is redone synchronously among the
        survivors with the buffers it first sent (``Carried``), then landed. False when this replica was healed
        as a joiner meanwhile."""
        if not sync.opened:  # put back by a checkpoint, already reduced: no transaction to close
            self._land(sync)
            return True
        opened = OpenSync(None if sync.failed else sync, sync.residuals)
        what = f"fragment {sync.fragment}'s sync"
        if close_sync(self.model.mesh.replicas, self.wire, opened, PendingSync.settle, self._rejoined, what):
            self._land(sync)
            return True
        return not self._rejoined() and self.transact(sync.fragment)

    def _rejoined(self) -> bool:
        return self.joined is not None

    def settle(self) -> None:
        """Wait for every all-reduce in flight, keeping the results to land at their steps (a checkpoint). One that
        failed on this rank (a member died) is discarded by the layer where it was to land and redone there, so
        it holds nothing to keep (raised where the layer cannot discard it)."""
        for sync in (s for s in self.pending if not s.failed):
            self._settle_or_fail(sync)

    def _settle_or_fail(self, sync: PendingSync) -> bool:
        """Wait for ``sync``'s all-reduce; False when it failed on this rank (told to the layer, marked failed)."""
        try:
            sync.settle()
        except RuntimeError as e:
            fail_sync(self.model.mesh.replicas, f"fragment {sync.fragment}'s sync", e)
            sync.failed = True
            return False
        return True

    def _carried(self, fragment: int) -> Carried:
        """What the fragment's sync sends, taken at its first start and kept until it lands (``Carried``). Where
        the layer can discard a sync (elastic) the weights always travel, so a replica whose inner steps do not
        count (a joiner, healed at the sync) weighs 0, and the buffers are kept, so the survivors' redo sends the
        same pseudo-gradients even after the ``delay`` inner steps it overlapped."""
        if fragment not in self.carried:
            units = self.fragment_units(fragment)
            transactional = self.model.mesh.replicas.transactional
            weighted = any(u.phase_weighted for u in units) or transactional
            carried = Carried(weighted, [_take_weight(unit) for unit in units])
            if transactional:
                carried.buffers = list(self._buffers(fragment, carried))
            self.carried[fragment] = carried
        return self.carried[fragment]

    @torch.no_grad()
    def _buffers(self, fragment: int, carried: Carried) -> Iterator[torch.Tensor]:
        """Each unit's pseudo-gradient (global - local) as sent: weighted, its weight appended ([Note: pieces and
        weights]); in the wire dtype (int8: fp32, the hop quantises it)."""
        wire = self.policy.wire_dtype
        for i, unit, weight in zip(self.fragments[fragment], self.fragment_units(fragment), carried.weights,
                                   strict=True):
            delta = self.global_copy[i] - unit.sharded_flat.float()
            if carried.weighted:
                delta = torch.cat([delta.mul_(weight), weight.to(delta.dtype).reshape(1)])
            yield delta if wire is None or self.wire is not None else delta.to(wire)

    @torch.no_grad()
    def _start(self, fragment: int) -> PendingSync:
        """Start the average of the fragment's pseudo-gradients over the replicas; kept buffers are sent as
        copies (the all-reduce writes its buffer). Called once the layer's await is over: that time was waited."""
        now = time.perf_counter()
        self._waited, self._mark = self._waited + now - self._mark, now
        carried = self._carried(fragment)
        buffers = self._buffers(fragment, carried) if carried.buffers is None else \
            (b.clone() for b in carried.buffers)
        handles, sent = [], []
        for unit, buffer in zip(self.fragment_units(fragment), buffers, strict=True):
            handles.append(self._average(unit, buffer, int(carried.weighted)))
            sent.append(buffer)
        if self.wire is not None:
            self.wire.flush(self.model.comm)  # the int8 second stages complete in the background too
        return PendingSync(fragment, self.policy.delay, handles, sent, carried.weighted)

    def _average(self, unit: ShardUnit, buffer: torch.Tensor, n_extra: int) -> Handle:
        """Start the average of ``buffer`` (laid out like the unit's flat shard, then ``n_extra`` values) over the
        replicas: one all-reduce on a grid, one per bucket of pieces across replicas of different degrees."""
        comm, label = self.model.comm, wire_key(unit)
        plan = self.piece_plan(unit, n_extra)
        if plan is None and self.wire is not None:
            return self.wire.start(buffer, n_extra, comm, label)
        if plan is None:
            return comm.all_reduce(buffer, "replicate", op=dist.ReduceOp.AVG, async_op=True, label=label)
        # Scale 1: each replica's pseudo-gradient counts once (the gradients' pre-scale weighs ranks, not replicas).
        hop = AllReduceHop() if self.wire is None else self.wire
        if self.wire is not None and self.model.mesh.replicas.transactional:  # quorums of other degrees (elastic)
            follow_plan(self.wire, label, self._wire_plans.get(label), plan, buffer.numel() - n_extra, buffer.device)
            self._wire_plans[label] = plan
        return start_piece_hops(hop, buffer, dataclasses.replace(plan, scale=1.0), comm, label)

    def residual_plan(self, unit: ShardUnit) -> PiecePlan | None:
        """The piece plan the unit's int8-wire residuals are laid out by (``None``: one residual, laid out like its
        flat shard). On a transactional layer (elastic) the plan of the unit's last sync: a quorum since may have
        other degrees, and a save after the last sync (``sync_replicas`` at the end of training) must not wait for
        a quorum that never comes; its next sync re-cuts them (``piece_hop.follow_plan``)."""
        if self.model.mesh.replicas.transactional:
            return self._wire_plans.get(wire_key(unit))
        return self.piece_plan(unit)

    def piece_plan(self, unit: ShardUnit, n_extra: int = 0) -> PiecePlan | None:
        """The unit's piece plan across replicas of different degrees for a buffer laid out like its flat shard
        then ``n_extra`` values (``None`` on a grid); the same pieces whatever ``n_extra``."""
        return plan_of(self.model.comm, unit.params, slot_offsets(unit.params), n_extra, unit.sharded_flat.numel(),
                       self._plans[n_extra])

    @torch.no_grad()
    def _land(self, sync: PendingSync) -> None:
        indices = self.fragments[sync.fragment]
        means = sync.settle()
        self.carried.pop(sync.fragment, None)
        if not sync.empty:
            for i, mean in zip(indices, means, strict=True):
                self.global_copy[i].grad = mean
            self.outer.step()
            self.outer.zero_grad(set_to_none=True)
        # sync_now's syncs leave the replicas equal: the global copy (outer_plan.SyncPlan.lands_global).
        mix = 0.0 if self.plan is not None and self.plan.lands_global else self.policy.mix
        for i in indices:
            local, global_copy = self.units[i].sharded_flat, self.global_copy[i]
            local.copy_(global_copy if mix == 0 else torch.lerp(global_copy, local.float(), mix))
