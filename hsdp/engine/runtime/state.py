"""The runtime of one wrapped model: forward/backward hooks driving its units (FSDP2's FSDPState).

Per unit and step:
  pre_forward    wait for this unit's all-gather (issued now or prefetched), prefetch the next unit's,
                 hook the inputs for post_backward
  post_forward   hook the outputs for pre_backward; reshard unless ``reshard_after_forward=False``
  pre_backward   wait for the all-gather again if resharded, prefetch the unit whose backward is next
  post_backward  after the unit's last use: reduce-scatter its gradients; its inter-node hop is chained
                 right behind on CUDA (the hop stream waits, see streams.py), and starts at the next unit's
                 post_backward on CPUs (where a wait blocks the host); either way it overlaps the backward
                 of earlier units
  end of backward (root callback): reduce what no post_backward reached, wait for every reduction (or
                 leave the last hops in flight for the optimizer step, late_grads.py), reshard everything,
                 reset the per-step bookkeeping.

Prefetch order comes from the previous step: forward follows the order of pre_forward calls, backward the
reverse order of post_forward calls (the root wraps everything, so its backward comes first). Prefetch depth
``d`` (``ShardedModel.set_prefetch``, default 1): at most ``1 + d`` units other than the root are unsharded
at any time.

torch.compile: the hooks run eagerly (``torch.compiler.disable``, as FSDP2 marks its hooks): they swap
parameters, resize storages and issue collectives, none of which belongs in a graph. Compiling the whole
wrapped model therefore breaks the graph at each unit boundary; compiling each block
(``for b in model.blocks: b.compile()``) compiles exactly the code between the hooks.

Activation checkpointing: a forward of a unit while this model's backward runs is a recomputation. It
needs the parameters gathered, nothing else, except when the original forward ran without grad
(reentrant ``torch.utils.checkpoint`` around the unit's call): then the recomputation hooks the unit's
(detached) inputs for post_backward, so the unit still reduces and reshards right after its backward.

A torn step leaves nothing behind: a forward that raised reshards at once (an always-called hook of the
root); a backward that raised, or a forward whose graph was dropped, is repaired by the next root
pre_forward or ``model.reshard()`` (which the optimizer step calls): see
:meth:`HSDPState._repair_torn_step`. Compiled autograd is refused (it would skip the end of backward).
"""

from __future__ import annotations

import functools
import warnings
import weakref
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from hsdp.engine.collectives import Comm
from hsdp.engine.mesh import HSDPMesh
from hsdp.engine.runtime.batch_weight import Weight
from hsdp.engine.runtime.buffers import BufferSync
from hsdp.engine.runtime.slice_gather import SliceGathers
from hsdp.engine.runtime.step_read import StepRead
from hsdp.engine.runtime.step_reductions import StepReductions
from hsdp.engine.runtime.streams import Streams
from hsdp.engine.runtime.unit import ShardedState, ShardUnit

# Methods that run as hooks inside forward and backward; each is kept out of torch.compile graphs.
_HOOKS = ("_pre_forward", "_post_forward", "_after_root_forward", "_pre_backward", "_post_backward",
          "_finalize_backward")


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs; its backward runs once the unit's backward for that call is done.

    ``on_free`` runs when the node is freed (its graph dropped, e.g. after an exception in forward), so that
    a registration whose backward will never come stops counting as pending.
    """

    @staticmethod
    def forward(ctx: Any, callback: Any, on_free: Any, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.callback = callback
        weakref.finalize(ctx, on_free)
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.callback()
        return (None, None, *grads)


class HSDPState:
    """Hooks and per-step bookkeeping for the units of one root :class:`~hsdp.ShardedModel`."""

    def __init__(self, mesh: HSDPMesh, comm: Comm, units: list[ShardUnit],
                 broadcast_buffers: bool | None = None) -> None:
        self.mesh = mesh
        self.comm = comm
        self.units = units  # pre-order: root unit first
        self.slice_gathers = SliceGathers()  # replica-sharded optimizer: the post-step all-gathers
        self.streams = Streams(mesh.device)
        for unit in units:
            unit.slice_gathers = self.slice_gathers
            unit.streams = self.streams
        self.buffers = BufferSync(units[0].module, comm, broadcast_buffers)
        # Gradient sync for the next backward: False/True as FSDP2's set_requires_gradient_sync and
        # set_requires_all_reduce (micro-batches of gradient accumulation).
        self.requires_gradient_sync = True
        self.requires_all_reduce = True
        self.batch_weight: Weight | None = None  # ShardedModel.set_batch_weight (batch_weight.py)
        self.prefetch = 1  # how many units ahead to all-gather (0: none), see ShardedModel.set_prefetch
        self.step_read = StepRead()  # the step's one host read, if any (step_read.py)
        # This backward's reductions, the step's transaction with the replicate layer (step_reductions.py).
        self.step = StepReductions(mesh, units, self.buffers, self.step_read,
                                   hops_on_device=mesh.device.type != "cpu" or self.streams.enabled)
        if mesh.replicas.transactional:
            self.step_read.sharded_optimizer_only = "is elastic (a step the coordinator discards must not be applied)"
        self.replica_sync: Any = None  # ShardedModel(replica_sync=hsdp.DiLoCo(...)), stepped by ShardedOptimizer
        self.outer: Any = None  # DiLoCo's OuterState once a ShardedOptimizer exists (check_replicas compares it)
        self.loads = 0  # weights written from outside training (load_state_dict, load_pretrained, materialize)
        self._callback_queued = False  # a backward started and its end-of-backward has not run yet
        # Registered post_backwards whose backward has neither run nor been freed: token -> unit. Each is
        # counted in its unit's ``pending_post_backward``; whichever of "ran" and "freed" comes first
        # uncounts it, and the end of backward forgets them all (so late frees of stale ones are no-ops).
        self._live: dict[int, ShardUnit] = {}
        self._tokens = 0
        self._recomputed: set[ShardUnit] = set()  # units hooked for post_backward by a recomputation
        self._in_forward = False  # between the root's pre_forward and post_forward (outside backward)
        self._handles: list[Any] = []
        self._forward_order: list[ShardUnit] = []  # pre_forward order of the previous step
        self._backward_order: list[ShardUnit] = []  # reverse post_forward order of the previous step
        self._pre_seen: list[ShardUnit] = []
        self._post_seen: list[ShardUnit] = []
        self._keep_hooks_out_of_graphs()

    def _keep_hooks_out_of_graphs(self) -> None:
        # Per instance, at wrap time: Dynamo is imported by then (DTensor needs it), and a hook that is
        # already disabled costs one graph break under torch.compile, where a wrapper disabling it per
        # call would cost two. Outside compilation a disabled function is a plain call.
        for name in _HOOKS:
            setattr(self, name, torch.compiler.disable(getattr(self, name), recursive=True,
                                                       reason="hsdp hooks swap parameters and communicate"))

    @property
    def root_unit(self) -> ShardUnit:
        return self.units[0]

    def register_hooks(self, units: list[ShardUnit]) -> None:
        for unit in _registration_order(units):
            m = unit.module
            self._handles.append(m.register_forward_pre_hook(
                functools.partial(self._pre_forward, unit), prepend=True, with_kwargs=True))
            self._handles.append(m.register_forward_hook(
                functools.partial(self._post_forward, unit), with_kwargs=True))
        # Runs even when forward raises (after the root's post_forward otherwise).
        self._handles.append(self.root_unit.module.register_forward_hook(self._after_root_forward, always_call=True))

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    # -- forward ---------------------------------------------------------------------------------------
    def _pre_forward(self, unit: ShardUnit, module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if self._in_backward():
            return self._pre_recompute(unit, args, kwargs)
        if unit is self.root_unit:
            # A call of the root inside its own forward (a LightningModule's training_step, run as the module's
            # forward, calling self(x)) continues that forward: no repair, which would reshard and regather.
            if not self._in_forward:
                self.step.land_late()  # the last backward's gradients, if still in flight (late_grads.py)
                self._repair_torn_step()
                self._in_forward = True
                if torch.is_grad_enabled() and self.replica_sync is None:
                    # A training step (not an evaluation or a sample): the replicas' too. Under DiLoCo the inner
                    # steps cross no replicas: the sync is the transaction (outer_transaction.py).
                    self.step.begin()
                self.buffers.pre_forward()
                self._pre_seen, self._post_seen = [], []
            args, kwargs = unit.policy.cast_inputs(args, kwargs)
        if unit not in self._pre_seen:
            self._pre_seen.append(unit)
        unit.wait_for_unshard()
        self._prefetch_after(unit, self._forward_order)
        if not torch.is_grad_enabled():
            return args, kwargs
        unit.used_in_grad_forward = True
        return self._register_post_backward(unit, args, kwargs)

    def _post_forward(self, unit: ShardUnit, module: Any, args: tuple, kwargs: dict, output: Any) -> Any:
        if self._in_backward():
            # Recomputation: the backward about to run needs the parameters. A reentrant recomputation
            # (the only forward of this unit with grad) hooks its outputs to prefetch the next unit.
            if unit in self._recomputed:
                self._recomputed.discard(unit)
                self._register_pre_backward(unit, output)
            return output
        if unit in self._post_seen:
            self._post_seen.remove(unit)
        self._post_seen.append(unit)
        if unit is self.root_unit:
            self._in_forward = False
            self.buffers.post_forward(self.requires_gradient_sync and self.requires_all_reduce)
            self._forward_order = self._pre_seen
            self._backward_order = self._post_seen[::-1]
            output = unit.policy.cast_outputs(output)
        if not torch.is_grad_enabled():
            unit.reshard()
            return output
        self._register_pre_backward(unit, output)
        # The root's parameters are needed first in backward: keep them (as FSDP2 does).
        if unit.reshard_after_forward and unit is not self.root_unit:
            unit.reshard()
        return output

    def _after_root_forward(self, module: Any, args: tuple, output: Any) -> None:
        if not self._in_forward:
            return  # the root's post_forward ran: the forward completed
        # The forward raised: no loss exists to backpropagate, so nothing needs the gathered parameters;
        # free them now so that parameters(), state_dict() and a new optimizer see the shards again.
        self._in_forward = False
        self.reshard_all()

    def _in_backward(self) -> bool:
        # A forward while this model's backward runs is a recomputation (activation checkpointing); one
        # after a backward that raised (its end-of-backward never ran) starts a new step.
        return self._callback_queued and torch._C._current_graph_task_id() != -1

    def _pre_recompute(self, unit: ShardUnit, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        unit.wait_for_unshard()
        if unit.pending_post_backward or not torch.is_grad_enabled():
            return args, kwargs  # non-reentrant: the original forward's post_backward is still to come
        # Reentrant checkpointing ran the original forward without grad, so nothing marks the end of this
        # unit's backward yet: hook the recomputation's inputs (the nested backward reaches them last).
        unit.used_in_grad_forward = True
        args, kwargs = self._register_post_backward(unit, args, kwargs)
        if unit.pending_post_backward:
            self._recomputed.add(unit)
        return args, kwargs

    def _prefetch_after(self, unit: ShardUnit, order: list[ShardUnit]) -> None:
        depth = int(self.prefetch)
        if depth <= 0 or unit not in order:
            return
        i = order.index(unit)
        for ahead in order[i + 1: i + 1 + depth]:
            if ahead.state is ShardedState.SHARDED:
                ahead.unshard(async_op=True)

    def _register_post_backward(self, unit: ShardUnit, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        flat, spec = tree_flatten((args, kwargs))
        idx = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not idx:
            return args, kwargs
        self._tokens += 1
        token = self._tokens
        self._live[token] = unit
        unit.pending_post_backward += 1
        outs = _PostBackward.apply(functools.partial(self._post_backward, unit, token),
                                   functools.partial(self._forget, token), *(flat[i] for i in idx))
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
        if _compiled_autograd_active():
            self._reset_step()  # nothing reduced yet: leave the model as it was before this step
            raise ValueError(
                "hsdp does not support compiled autograd (torch._dynamo.config.compiled_autograd = True): its "
                "end-of-backward reduction would be skipped. Set torch._dynamo.config.compiled_autograd = False "
                "(or run loss.backward() outside the compiled function); torch.compile of the model or of its "
                "blocks works as usual")
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finalize_backward)
        unit.wait_for_unshard()
        self._prefetch_after(unit, self._backward_order)

    def _post_backward(self, unit: ShardUnit, token: int) -> None:
        if not self._forget(token):
            return  # from a graph older than the last end of backward: that one reduced its gradients
        if unit.pending_post_backward > 0:
            return  # used again earlier in forward: its backward is still to come
        self._reduce(unit)  # reshards the unit too

    def _reduce(self, unit: ShardUnit) -> None:
        self.step.add(unit, self.requires_gradient_sync, self.requires_all_reduce, self.batch_weight)

    def _forget(self, token: int) -> bool:
        """Uncount one post_backward registration (its backward ran, or its graph was freed)."""
        unit = self._live.pop(token, None)
        if unit is None:
            return False
        unit.pending_post_backward -= 1
        return True

    def _finalize_backward(self) -> None:
        for unit in reversed(self.units):
            has_leftover = any(p.unsharded.grad is not None for p in unit.params)
            if unit.used_in_grad_forward or has_leftover:
                self._reduce(unit)
        # Raises where the layer cannot discard the step. DiLoCo and weighted batches never land late (late_grads.py).
        if not self.step.finish_hops(self.replica_sync is None and self.batch_weight is None):
            self._reset_step()  # discarded on every member: ShardedOptimizer.step applies nothing
            return
        try:
            self.step.conclude(self.batch_weight)  # buffers, then the step's host read (may raise a deferred check)
        finally:
            self._reset_step()

    def _reset_step(self) -> None:
        for unit in self.units:
            unit.reshard()
            unit.pending_post_backward = 0
            unit.used_in_grad_forward = False
        self._live.clear()
        self._recomputed.clear()
        self._callback_queued = False

    # -- a torn step ------------------------------------------------------------------------------------
    def _repair_torn_step(self) -> None:
        """At the root's pre_forward (outside backward): undo what an interrupted step left behind.

        * A backward that raised (its end-of-backward never ran): its gradients are discarded, in flight
          or not: unsharded gradients, reductions (waited for, then dropped), and the unsynchronised
          micro-batch sums of the current accumulation window, which that backward may have partly
          consumed. Completed steps' ``param.grad`` stay untouched, so the next steps equal a fresh run
          once ``zero_grad()`` is called, as after an exception in a plain model's backward. Warns.
        * No forward's graph still waits for its backward (every registration ran or was freed: an
          exception in forward, or a grad-mode forward whose output was dropped): units left unsharded
          are resharded, so the next forward gathers current values. A forward whose graph is still
          alive may yet be backpropagated (two forwards, one backward): then nothing is touched.

        Local only (the all-gathers a torn forward left in flight are waited for, identically on every
        rank); assumes every rank tore at the same point, as an error in common code does.
        """
        if self._callback_queued:
            self._discard_torn_backward()
        elif not self._live:
            # Not reshard_all: that also finishes every slice all-gather in flight, which the forward starting
            # now overlaps unit by unit (each unit settles its own before its all-gather).
            for unit in self.units:
                unit.reshard()

    def _discard_torn_backward(self) -> None:
        warnings.warn(
            "hsdp: the previous backward did not finish (an exception inside backward?): its gradients and "
            "the micro-batch gradients accumulated since the last synchronised step were discarded; call "
            "optimizer.zero_grad() after such an exception, as for a plain model", RuntimeWarning, stacklevel=2)
        self.step.abandon()
        for unit in self.units:
            for p in unit.params:
                p.unsharded.grad = None
                p.grad_acc = None
        self._reset_step()

    # -- explicit control ----------------------------------------------------------------------------
    def reshard_all(self) -> None:
        """Free every unsharded parameter and finish the slice all-gathers in flight (the shards are then
        current); after a backward that raised, discard it first (see :meth:`_repair_torn_step`), so that an
        optimizer step right after the exception is safe."""
        if self._callback_queued and torch._C._current_graph_task_id() == -1:
            self._discard_torn_backward()
        self.step.land_late()
        for unit in self.units:
            unit.reshard()
        self.slice_gathers.settle_all()

    def settle_slices(self) -> None:
        """Finish every slice all-gather, in flight or queued (see :meth:`start_slice_gathers`)."""
        self.slice_gathers.settle_all()

    def units_in_forward_order(self) -> list[ShardUnit]:
        """The units in the order the last forward gathered them, then any it did not use."""
        return self._forward_order + [u for u in self.units if u not in self._forward_order]

    def start_slice_gathers(self, units: list[ShardUnit] | None = None) -> None:
        """Replica-sharded optimizer, after stepping ``units``' slices (default: every unit): queue their
        all-gathers across replicas, in forward order, the first ones started (``slice_gather.py``)."""
        for unit in self.units_in_forward_order() if units is None else units:
            self.slice_gathers.append(unit)

    def is_idle(self) -> bool:
        return all(u.state is ShardedState.SHARDED for u in self.units) and self.step.idle


def _compiled_autograd_active() -> bool:
    # Compiled autograd drops the end-of-backward callback (queue_callback): gradients would silently be
    # left unreduced. Every rank checks in its first backward hook, before any backward collective.
    from torch._dynamo import compiled_autograd

    return compiled_autograd.in_compiled_autograd_region or compiled_autograd.compiled_autograd_enabled


def _registration_order(units: list[ShardUnit]) -> list[ShardUnit]:
    """Units sharing a module (one per dtype, see ``hsdp.engine.model``) register last-first: the pre-hooks are
    prepended, so the module's first unit (the root unit, for the root) then runs its pre_forward first."""
    by_module: dict[int, list[ShardUnit]] = {}
    for unit in units:
        by_module.setdefault(id(unit.module), []).append(unit)
    return [unit for group in by_module.values() for unit in reversed(group)]

