"""``ShardedModel``: wrap any ``nn.Module`` for hybrid sharded data parallel training."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from hsdp.engine.class_swap import swap_class
from hsdp.engine.collectives import Comm
from hsdp.engine.hops import AllReduceHop, ReplicaHop
from hsdp.engine.mesh import HSDPMesh, check_degree_agrees
from hsdp.engine.mesh_init import init_mesh
from hsdp.engine.policy import FULL_PRECISION, MixedPrecision, check_policies
from hsdp.engine.replica_sync import DiLoCo, check_replica_sync
from hsdp.engine.replicas import check_replica_shards
from hsdp.engine.replicate.layer import StepRecord
from hsdp.engine.runtime import batch_weight
from hsdp.engine.runtime.buffers import comparable_buffers, updates_running_stats
from hsdp.engine.runtime.dtensor import as_sharded
from hsdp.engine.runtime.origin import check_origin, stamp
from hsdp.engine.runtime.sharded_param import ShardedParam
from hsdp.engine.runtime.state import HSDPState
from hsdp.engine.runtime.step_guard import install_unwrapped_step_guard
from hsdp.engine.runtime.storage import apply_to_sharded_model
from hsdp.engine.runtime.unit import ShardUnit
from hsdp.engine.sharding import Sharded, UnitOptions, shard_module
from hsdp.engine.wrap import WrapPolicy


class ShardedModel(nn.Module):
    """A module whose parameters, gradients and optimizer state are sharded inside a node and replicated
    across nodes.

    ``ShardedModel(module, sharding_degree=S)`` returns *the same module object*, its class swapped to a
    subclass of both ``ShardedModel`` and the original class (as FSDP2's ``fully_shard`` does): attributes,
    methods and ``state_dict`` keys stay those of the original model.

    Semantics:
      * Parameters are split in dim-0 chunks across the ``S`` ranks of a shard group. Between steps
        ``parameters()`` yields ``DTensor`` parameters of the original shapes, placements
        ``Shard(0)`` on ``mesh.param_mesh`` (this rank's replica): ``numel()``, norms (``clip_grad_norm_``),
        ``state_dict()`` of this module or any parent, and DCP see the global tensors, while an
        element-wise optimizer updates only this rank's chunk (in place, no copy). Inside forward and
        backward the module sees plain, full-shape tensors.
      * Units: by default every block of a repeated stack (e.g. transformer layers) is one unit and the
        rest is the root unit; ``wrap`` takes module classes or a predicate. Each unit's parameters are
        all-gathered (one collective) before it runs and, when ``reshard_after_forward`` (default), freed
        after it and gathered again for its backward. ``False`` trades memory for one all-gather less.
      * Gradients: reduce-scattered in the shard group, then all-reduced across replicas; the result is
        the average over every rank's batch, the update DDP would make.
      * Initial parameters and buffers are broadcast from rank 0, so replicas start identical whatever
        seed each rank used.
      * Device: shards, gradients, optimizer state and buffers live on the mesh's device (``mesh.device``:
        the GPU of ``LOCAL_RANK`` under NCCL, the CPU under gloo) whatever device the module was built on.
        A CPU-built model is moved at wrap shard by shard (each rank copies only its own chunks; with
        several ranks rank 0's values pass through the GPU one unit at a time), so the full model never
        lands on one GPU; buffers are moved whole. See ``hsdp/engine/sharding.py``.
      * Meta-device construction: a model built under ``with torch.device("meta"):`` is wrapped without
        allocating or broadcasting anything; its shards stay on meta until ``hsdp.materialize(model)``
        (each rank initialises only its shards, one module at full size at a time),
        ``hsdp.load_pretrained(model, path)`` or ``model.to_empty(device=mesh.device)`` plus your own init.
      * ``broadcast_buffers``: re-broadcast the buffers from rank 0 before each step's forward, as DDP's
        ``broadcast_buffers`` does, so BatchNorm running statistics stay identical on every rank. Default
        ``None``: on iff the model has a layer tracking running statistics (BatchNorm, InstanceNorm); off
        otherwise, because a world broadcast every step crosses the slow inter-node links and the buffers
        of most models (masks, rotary tables) never change. ``True``/``False`` force it (see
        ``hsdp/engine/runtime/buffers.py``).
      * ``sharding_degree=1`` is plain replication (DDP semantics); the world size is full sharding.
      * ``mixed_precision``: compute/all-gather dtype and a reduce dtype per hop (see ``MixedPrecision``).
      * ``replica_hop``: what replaces the inter-node all-reduce (see ``hsdp.engine.hops``), e.g. bf16 or int8.
      * ``replica_sync=hsdp.DiLoCo(every=H)``: no per-step inter-node hop; replicas sync their weights every H
        steps through an outer optimizer (``hsdp/engine/replica_sync.py``; not DDP's math). Needs
        ``hsdp.ShardedOptimizer``; not with ``replica_hop`` or ``shard_optimizer_across_replicas``.
      * ``shard_optimizer_across_replicas``: optimizer state (and the reduced gradients) sharded over all
        R x S ranks, parameters still sharded over the S ranks of a node (ZeRO over the whole mesh; Megatron's
        "HFSDP"). The inter-node all-reduce becomes a reduce-scatter across replicas; each rank's optimizer
        steps its 1/(R x S) slice; an all-gather across replicas, in the parameter dtype, refreshes the node's
        shards and overlaps the next forward. Same inter-node bytes, optimizer state / R, optimizer step / R.
        Gradients and optimizer state are DTensors of the global shape, placements
        ``(_StridedShard(0, split_factor=S), Shard(0))``; checkpoints move freely between the modes. Needs an
        element-wise optimizer and a hop that can reduce-scatter (both built-ins: the int8 hop as an all-to-all
        of int8 blocks with error feedback per replica row). Between
        ``optimizer.step()`` and the next forward the shards are refreshed lazily: ``parameters()``,
        ``state_dict()``, ``reshard()`` and the hsdp helpers wait for the refresh; a module attribute read
        directly (``model.fc.weight``) right after the step may be stale, so call ``model.reshard()`` first.
        With R = 1 it changes nothing. See ``hsdp/engine/runtime/replica_slice.py``.
    """

    _hsdp_state: HSDPState
    _hsdp_mesh: HSDPMesh

    def __new__(cls, module: nn.Module, sharding_degree: int | None = None, *, mesh: HSDPMesh | None = None,
                wrap: WrapPolicy = None, reshard_after_forward: bool = True,
                mixed_precision: MixedPrecision | None = None, replica_hop: ReplicaHop | None = None,
                broadcast_buffers: bool | None = None,
                shard_optimizer_across_replicas: bool = False,
                replica_sync: DiLoCo | None = None) -> ShardedModel:
        if isinstance(module, ShardedModel):
            raise ValueError(
                f"{type(module).__name__} is already a ShardedModel: wrap each model once (to shard a "
                f"submodule separately, wrap the submodule first, then its parent)"
            )
        if not isinstance(module, nn.Module):
            raise ValueError(f"ShardedModel wraps an nn.Module, got {type(module).__name__}")
        check_policies(mixed_precision, replica_hop)
        mesh = _resolve_mesh(sharding_degree, mesh)
        buffers = updates_running_stats(module) if broadcast_buffers is None else broadcast_buffers
        hop = check_replica_sync(replica_sync, replica_hop, shard_optimizer_across_replicas, mesh, buffers)
        options = UnitOptions(reshard_after_forward, mixed_precision or FULL_PRECISION, hop or AllReduceHop(),
                              broadcast_buffers, shard_optimizer_across_replicas)
        _attach(module, shard_module(module, mesh, wrap, options))
        module._hsdp_state.replica_sync = replica_sync
        if replica_sync is not None:
            module._hsdp_state.step_read.sharded_optimizer_only = "syncs replicas with DiLoCo (its outer step)"
        install_unwrapped_step_guard()
        swap_class(module, ShardedModel)
        return module  # type: ignore[return-value]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Everything happened in __new__ on the existing module; nn.Module.__init__ would wipe it.
        pass

    # -- public runtime API ----------------------------------------------------------------------------
    @property
    def mesh(self) -> HSDPMesh:
        return self._hsdp_mesh

    @property
    def units(self) -> list[ShardUnit]:
        return self._hsdp_state.units

    @property
    def comm(self) -> Comm:
        """The one caller of collectives for this model: what engine extensions (clipping, replica checks,
        sharded optimizer steps) communicate through, so their traffic shows in :meth:`comm_stats`."""
        return self._hsdp_state.comm

    def comm_stats(self) -> dict[str, dict[str, dict[str, float]]]:
        """Collective calls, bytes, ring wire bytes and seconds per group and op since the last reset."""
        return self._hsdp_state.comm.stats.as_dict()

    def reset_comm_stats(self) -> None:
        self._hsdp_state.comm.stats.reset()

    def set_requires_gradient_sync(self, requires: bool) -> None:
        """``False``: the next backwards communicate nothing and keep fp32 unsharded gradient sums (the
        least traffic, the most memory); the first backward with ``True`` reduces the sum."""
        self._hsdp_state.requires_gradient_sync = requires

    def set_requires_all_reduce(self, requires: bool) -> None:
        """``False``: the next backwards reduce-scatter inside the node into an fp32 partial sum but skip
        the inter-node hop; the first backward with ``True`` sends the sum across nodes once."""
        self._hsdp_state.requires_all_reduce = requires

    def set_batch_weight(self, weight: float | torch.Tensor | None) -> None:
        """Weight this rank's next backwards (until set again) as ``weight`` samples or tokens of the global
        batch: the reduced gradient becomes the ``weight``-weighted average over all ranks (and over the
        micro-batches of an accumulation window) of each backward's gradient, i.e. the gradient of one
        process's mean loss over the concatenated uneven batches. Backward each micro-batch's *mean* loss, not
        divided by the micro-batch count: the weighted average does that division. ``weight`` is a positive
        number or a 1-element tensor (a token count on the device: no host sync); ``None`` returns to the
        plain average, which equals weights of 1 bit for bit.

        Every rank must set a weight before its backwards, or none: a mix (or a tensor weight that is zero,
        negative or non-finite) raises ``ValueError`` at the step's host read, before ``optimizer.step()``
        applies the gradient. See ``hsdp/engine/runtime/batch_weight.py`` for how the weights travel.

        Under ``replica_sync=DiLoCo`` the inner steps take the weighted average inside each replica, and a sync
        weighs each replica's pseudo-gradient by what it processed since the last one (the sum of its ranks'
        weights over those inner steps; ``hsdp/engine/optim/outer_step.py``).

        On an elastic mesh (``init_mesh(elastic=True)``) each committed step's gradient is the weighted average
        over the ranks of that step's members only: a replica that left weighs nothing, a joiner counts from the
        first step it takes part in (the weights travel in the step's own reductions, over the quorum's group)."""
        self._hsdp_state.batch_weight = batch_weight.checked(weight, self.mesh.device)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation: backwards inside only reduce inside the node; the inter-node hop runs
        once, on the first backward after the block."""
        previous = self._hsdp_state.requires_all_reduce
        self._hsdp_state.requires_all_reduce = False
        try:
            yield
        finally:
            self._hsdp_state.requires_all_reduce = previous

    def set_prefetch(self, depth: bool | int) -> None:
        """How many units ahead to all-gather while the current one computes, in forward and in backward:
        ``True``/``1`` (the default) the next unit, ``False``/``0`` none (each unit gathers when it is
        reached, exposing every all-gather), ``n`` the next ``n``. Deeper prefetch hides slower all-gathers
        (a slow shard group, or tiny units whose compute is shorter than their gather) at the cost of
        memory: up to ``1 + n`` units are unsharded at once, besides the root. Same value on every rank."""
        if isinstance(depth, bool):
            depth = int(depth)
        if not isinstance(depth, int) or depth < 0:
            raise ValueError(f"set_prefetch takes True, False or a number of units >= 0, got {depth!r}")
        self._hsdp_state.prefetch = depth

    @property
    def shards_optimizer_across_replicas(self) -> bool:
        """Whether the optimizer steps 1/R slices of the shards (``shard_optimizer_across_replicas`` with R > 1)."""
        return any(p.slice is not None for p in self.sharded_params())

    @property
    def units_in_forward_order(self) -> list[ShardUnit]:
        """The units in the order the last forward gathered them (then any it did not use)."""
        return self._hsdp_state.units_in_forward_order()

    def gather_stepped_slices(self, units: list[ShardUnit] | None = None) -> None:
        """Replica-sharded optimizer: start the all-gathers across replicas that bring every replica's stepped
        slices of ``units`` (default: all) into the shards (``ShardedOptimizer.step`` calls it unit by unit).
        Asynchronous, two in flight; the next forward, and everything that reads the shards, waits for them."""
        self._hsdp_state.start_slice_gathers(units)

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        self._hsdp_state.settle_slices()  # a slice all-gather in flight: the shards are being refreshed
        return super().parameters(recurse)

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]:
        self._hsdp_state.settle_slices()
        return super().named_parameters(*args, **kwargs)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``nn.Module.zero_grad`` that does not wait for the slice all-gathers in flight (they refresh values,
        not gradients): ``model.zero_grad()`` right after the step keeps them overlapping the next forward."""
        for _, p in nn.Module.named_parameters(self):  # not self.named_parameters: that one waits
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                if p.grad.grad_fn is not None:
                    p.grad.detach_()
                else:
                    p.grad.requires_grad_(False)
                p.grad.zero_()

    @property
    def last_step(self) -> StepRecord | None:
        """On an elastic mesh (``init_mesh(elastic=True)``), what the last ``optimizer.step()`` did: its step
        number, whether it was committed (applied on every member) or discarded, and the replica ids whose
        gradients it averaged; after a joining replica's heal, the step it resumes after. ``None`` elsewhere.
        Under DiLoCo an inner step crosses no replicas and is always applied: the record is the last inner step
        (healed: the one the live member it was healed from took last), committed, and the replicas of the last
        sync."""
        last, outer = self.mesh.replicas.last, self._hsdp_state.outer
        if last is None or outer is None:
            return last
        return StepRecord(outer.steps() - 1, True, last.replicas)

    def check_replicas(self) -> None:
        """Raise :class:`hsdp.engine.replicas.ReplicaDivergence` naming parameters whose shards differ across
        replicas, or buffers that differ between any two ranks (collectives in the replicate and shard groups;
        call it on every rank). Under DiLoCo, once a ``ShardedOptimizer`` exists, it compares the global copy
        instead of the weights: mid-phase the replicas' weights differ by design (and under Streaming DiLoCo
        they never all agree), the global copy never does."""
        self._hsdp_state.settle_slices()
        with self.comm.phase("ShardedModel.check_replicas"):
            params, outer = self.sharded_params(), self._hsdp_state.outer
            if outer is None:
                check_replica_shards(params, self.comm, buffers=comparable_buffers(self))
            else:  # DiLoCo: the weights differ mid-phase, the global copy never does
                check_replica_shards(params, self.comm, shards=outer.compared_shards(params),
                                     what="DiLoCo global copy shard(s)", buffers=comparable_buffers(self))

    def reshard(self) -> None:
        """Free every unsharded parameter (e.g. after a forward whose backward never ran)."""
        self._hsdp_state.reshard_all()

    def sharded_params(self) -> list[ShardedParam]:
        return [p for u in self.units for p in u.params]

    # -- conversions (.to, .float, .double, .half, .bfloat16, .to_empty, ...) ---------------------------
    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> ShardedModel:
        """What ``.to(dtype | device)``, ``.float()``/``.double()``/``.half()``/``.bfloat16()`` and
        ``.to_empty(device=)`` run; call them on the root ShardedModel, between steps.

        Each unit's flat shard buffer is converted as one tensor, so the DTensor parameters stay views into
        it (and keep their identity where torch can swap them, as ``nn.Module._apply`` does for DTensors);
        their gradients are converted alike, the unsharded faces are re-created in the compute dtype
        (``MixedPrecision.param_dtype`` when set, else the new dtype) and gradient reductions follow the new
        dtype. Buffers go through ``nn.Module._apply`` (then ``MixedPrecision.buffer_dtype`` is re-applied).
        As in plain torch, build the optimizer after a dtype or device change: existing optimizer state
        keeps its old dtype. A conversion that changes shapes or leaves the mesh's device raises
        ``ValueError``. See ``hsdp/engine/runtime/storage.py``.
        """
        self._hsdp_state.settle_slices()
        return apply_to_sharded_model(self, fn, recurse, super()._apply)

    # -- state dict ----------------------------------------------------------------------------------
    def state_dict(self, *args: Any, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> Any:
        """Original keys and shapes; sharded parameters as ``DTensor`` with placements
        ``Shard(0)`` on ``mesh.param_mesh`` (FSDP2's layout inside a replica), buffers as plain tensors. A parent
        module's ``state_dict()`` holds the same DTensors (the parameters are DTensors between steps)."""
        self._hsdp_state.settle_slices()
        sd = super().state_dict(*args, destination=destination, prefix=prefix, keep_vars=keep_vars)
        # Mid-step (a unit still unsharded) the slots hold the plain unsharded faces: report the shards.
        for p in self.sharded_params():
            # Not ``detach()``: see [Note: DTensor over a slice of a flat buffer] (torch.save must work).
            value = stamp(p.sharded if keep_vars else p.to_dtensor(p.sharded_local.detach()))
            for slot in p.slots:
                if prefix + slot.fqn in sd:
                    sd[prefix + slot.fqn] = value
        return sd

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Accept sharded (``DTensor``, any layout) or full tensors under the original keys; keeps this
        rank's chunk. The same conversion runs when a parent module's ``load_state_dict`` reaches this one."""
        if assign:
            raise ValueError("assign=True would replace the sharded parameters: load with assign=False")
        return super().load_state_dict(state_dict, strict=strict)


def check_replicas(model: ShardedModel) -> None:
    """``hsdp.check_replicas(model)``: :meth:`ShardedModel.check_replicas` as a function."""
    if not isinstance(model, ShardedModel):
        raise ValueError("check_replicas expects a ShardedModel")
    model.check_replicas()


def _attach(module: nn.Module, sharded: Sharded) -> None:
    """Give the root (and the nested wrappers it absorbed) the shared runtime and the load hook."""
    object.__setattr__(module, "_hsdp_state", sharded.state)
    object.__setattr__(module, "_hsdp_mesh", sharded.state.mesh)
    for child in sharded.nested:
        object.__setattr__(child, "_hsdp_state", sharded.state)
        child._hsdp_load_hook.remove()
    hook = module._register_load_state_dict_pre_hook(_load_state_dict_pre_hook, with_module=True)
    object.__setattr__(module, "_hsdp_load_hook", hook)


def _load_state_dict_pre_hook(module: nn.Module, state_dict: dict[str, Any], prefix: str,
                              local_metadata: dict[str, Any], *args: Any) -> None:
    """Runs before ``module`` (a root ShardedModel) loads, also from a parent's ``load_state_dict``: put the
    sharded parameters back in their slots and turn full tensors into this rank's DTensor chunk, so that
    ``nn.Module``'s ``param.copy_(value)`` copies shard into shard."""
    if local_metadata.get("assign_to_params_buffers"):
        raise ValueError("assign=True would replace the sharded parameters: load with assign=False")
    state: HSDPState = module._hsdp_state
    state.reshard_all()
    state.loads += 1  # DiLoCo's global copy follows (optim/outer_step.py)
    for unit in state.units:
        for p in unit.params:
            for slot in p.slots:
                key = prefix + slot.fqn
                if key in state_dict:
                    check_origin(state_dict[key], p.device_mesh, f"parameter {key!r}")  # see [Note: pickled chunks]
                    state_dict[key] = as_sharded(state_dict[key], p.layout, p.device_mesh)


def _resolve_mesh(sharding_degree: int | None, mesh: HSDPMesh | None) -> HSDPMesh:
    if mesh is None:
        return init_mesh(sharding_degree)
    check_degree_agrees(sharding_degree, mesh)
    return mesh
