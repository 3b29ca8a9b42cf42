"""``ShardedModel``: wrap any ``nn.Module`` for hybrid sharded data parallel training."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hsdp.engine.collectives import Comm
from hsdp.engine.hops import AllReduceHop, ReplicaHop
from hsdp.engine.mesh import HSDPMesh, init_mesh
from hsdp.engine.policy import FULL_PRECISION, MixedPrecision
from hsdp.engine.runtime.dtensor import as_sharded
from hsdp.engine.runtime.sharded_param import ShardedParam, ShardLayout
from hsdp.engine.runtime.state import ShardingState
from hsdp.engine.runtime.unit import ShardUnit
from hsdp.engine.wrap import ParamAssignment, WrapPolicy, assign_params, select_unit_modules

_CLASS_CACHE: dict[type, type] = {}


class ShardedModel(nn.Module):
    """A module whose parameters, gradients and optimizer state are sharded inside a node and replicated
    across nodes.

    ``ShardedModel(module, sharding_degree=S)`` returns *the same module object*, its class swapped to a
    subclass of both ``ShardedModel`` and the original class (as FSDP2's ``fully_shard`` does): attributes,
    methods and ``state_dict`` keys stay those of the original model.

    Semantics:
      * Parameters are split in dim-0 chunks across the ``S`` ranks of a shard group. Between steps
        ``parameters()`` yields ``DTensor`` parameters of the original shapes, placements
        ``(Replicate(), Shard(0))`` on ``mesh.device_mesh``: ``numel()``, norms (``clip_grad_norm_``),
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
    """

    _hsdp_state: ShardingState
    _hsdp_mesh: HSDPMesh

    def __new__(cls, module: nn.Module, sharding_degree: int | None = None, *, mesh: HSDPMesh | None = None,
                wrap: WrapPolicy = None, reshard_after_forward: bool = True,
                mixed_precision: MixedPrecision | None = None, replica_hop: ReplicaHop | None = None,
                broadcast_buffers: bool | None = None) -> ShardedModel:
        if isinstance(module, ShardedModel):
            raise ValueError(
                f"{type(module).__name__} is already a ShardedModel: wrap each model once (to shard a "
                f"submodule separately, wrap the submodule first, then its parent)"
            )
        if not isinstance(module, nn.Module):
            raise ValueError(f"ShardedModel wraps an nn.Module, got {type(module).__name__}")
        mesh = _resolve_mesh(sharding_degree, mesh)
        options = UnitOptions(reshard_after_forward, mixed_precision or FULL_PRECISION, replica_hop or AllReduceHop(),
                              broadcast_buffers)
        _shard_module(module, mesh, wrap, options)
        from hsdp.engine.optim.sharded_optimizer import (
            install_unwrapped_step_guard,  # hsdp.engine.optim.sharded_optimizer imports this module
        )

        install_unwrapped_step_guard()
        module.__class__ = _sharded_class(type(module))
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

    def set_prefetch(self, enabled: bool) -> None:
        """Issue the next unit's all-gather while the current one computes (default on)."""
        self._hsdp_state.prefetch = enabled

    def check_replicas(self) -> None:
        """Raise :class:`hsdp.engine.replicas.ReplicaDivergence` naming parameters whose shards differ across
        replicas (a collective in the replicate group; call it on every rank)."""
        from hsdp.engine.replicas import check_replicas

        check_replicas(self)

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
        ``ValueError``. See ``hsdp/engine/init/storage.py``.
        """
        from hsdp.engine.init.storage import apply_to_sharded_model  # hsdp.engine.init imports this module

        return apply_to_sharded_model(self, fn, recurse, super()._apply)

    # -- state dict ----------------------------------------------------------------------------------
    def state_dict(self, *args: Any, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> Any:
        """Original keys and shapes; sharded parameters as ``DTensor`` with placements
        ``(Replicate(), Shard(0))`` on the mesh (the layout FSDP2 uses), buffers as plain tensors. A parent
        module's ``state_dict()`` holds the same DTensors (the parameters are DTensors between steps)."""
        sd = super().state_dict(*args, destination=destination, prefix=prefix, keep_vars=keep_vars)
        # Mid-step (a unit still unsharded) the slots hold the plain unsharded faces: report the shards.
        for p in self.sharded_params():
            # Not ``detach()``: see [Note: DTensor over a slice of a flat buffer] (torch.save must work).
            value = p.sharded if keep_vars else p.to_dtensor(p.sharded_local.detach())
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


def _load_state_dict_pre_hook(module: nn.Module, state_dict: dict[str, Any], prefix: str,
                              local_metadata: dict[str, Any], *args: Any) -> None:
    """Runs before ``module`` (a root ShardedModel) loads, also from a parent's ``load_state_dict``: put the
    sharded parameters back in their slots and turn full tensors into this rank's DTensor chunk, so that
    ``nn.Module``'s ``param.copy_(value)`` copies shard into shard."""
    if local_metadata.get("assign_to_params_buffers"):
        raise ValueError("assign=True would replace the sharded parameters: load with assign=False")
    state: ShardingState = module._hsdp_state
    state.reshard_all()
    for unit in state.units:
        for p in unit.params:
            for slot in p.slots:
                key = prefix + slot.fqn
                if key in state_dict:
                    state_dict[key] = as_sharded(state_dict[key], p.layout, p.device_mesh)


def _sharded_class(orig: type) -> type:
    if orig not in _CLASS_CACHE:
        _CLASS_CACHE[orig] = type(f"Sharded{orig.__name__}", (ShardedModel, orig), {})
    return _CLASS_CACHE[orig]


def _resolve_mesh(sharding_degree: int | None, mesh: HSDPMesh | None) -> HSDPMesh:
    if mesh is None:
        return init_mesh(sharding_degree)
    if sharding_degree is not None and sharding_degree != mesh.sharding_degree:
        raise ValueError(
            f"sharding_degree={sharding_degree} disagrees with mesh.sharding_degree={mesh.sharding_degree}: "
            f"pass only one of them"
        )
    return mesh


# ---------------------------------------------------------------------------------------------------------
# Building the units.
# ---------------------------------------------------------------------------------------------------------
def _nested_roots(module: nn.Module) -> list[nn.Module]:
    """Already-wrapped submodules (outermost only): their units are absorbed into the new root."""
    out: list[nn.Module] = []

    def visit(m: nn.Module) -> None:
        for child in m.children():
            if isinstance(child, ShardedModel):
                out.append(child)
            else:
                visit(child)

    visit(module)
    return out


def _validate_unit(owner: nn.Module, assigned: list[ParamAssignment]) -> None:
    devices = {a.param.device for a in assigned}
    if len(devices) > 1:
        detail = ", ".join(f"{a.slots[0].fqn}: {a.param.device}" for a in assigned)
        raise ValueError(
            f"parameters of one unit ({type(owner).__name__}) must share a device, found {detail}: "
            f"call model.to(device) before wrapping"
        )


def _dtype_groups(assigned: list[ParamAssignment]) -> list[list[ParamAssignment]]:
    """A unit module's parameters split by dtype, in order of first appearance.

    [Note: mixed dtypes in one module] A flat shard buffer holds one dtype, so a module whose parameters
    mix dtypes (an fp32 norm inside a bf16 block) becomes one unit per dtype on the same module: each is
    gathered and reduced on its own (one more all-gather and reduce-scatter per extra dtype) and the hooks
    of all of them run around the module's forward and backward.
    """
    groups: dict[torch.dtype, list[ParamAssignment]] = {}
    for a in assigned:
        groups.setdefault(a.param.dtype, []).append(a)
    return list(groups.values())


def _unit_key(module_key: str, group: int, dtype: torch.dtype) -> str:
    """Unit names: the module's name, plus the dtype for a module's second and later dtype groups (hop
    state is keyed by it, so it must be unique)."""
    return module_key if group == 0 else f"{module_key}[{str(dtype).removeprefix('torch.')}]"


@dataclass(frozen=True)
class UnitOptions:
    reshard_after_forward: bool
    mixed_precision: MixedPrecision
    replica_hop: ReplicaHop
    broadcast_buffers: bool | None = None  # None: automatic (see hsdp/engine/runtime/buffers.py)

    def __post_init__(self) -> None:
        # Checked here, before the first collective of wrapping.
        if self.broadcast_buffers is not None and not isinstance(self.broadcast_buffers, bool):
            raise ValueError(f"broadcast_buffers must be True, False or None (automatic: on iff the model has "
                             f"BatchNorm-style running statistics), got {self.broadcast_buffers!r}")


def _shard_module(module: nn.Module, mesh: HSDPMesh, wrap: WrapPolicy, options: UnitOptions) -> None:
    nested = _nested_roots(module)
    for child in nested:
        if child._hsdp_mesh is not mesh:
            raise ValueError("nested ShardedModels must share one HSDPMesh: pass mesh= to every wrap")
    unit_modules = select_unit_modules(module, wrap, exclude=nested)
    assignments = assign_params(module, unit_modules, skip=nested)
    by_owner: dict[int, list[ParamAssignment]] = {id(m): [] for m in unit_modules}
    for a in assignments:
        by_owner[id(a.owner)].append(a)
    # Every check above and here runs before the first collective below.
    _check_meta(assignments)
    for m in unit_modules:
        _validate_unit(m, by_owner[id(m)])

    comm = Comm(mesh)
    # One flat broadcast per unit (and one for the buffers): peak extra memory is one unit, not the model.
    for m in unit_modules:
        _broadcast_from_rank0(comm, [a.param for a in by_owner[id(m)]])
    _broadcast_from_rank0(comm, _own_buffers(module, nested))
    if options.mixed_precision.buffer_dtype is not None:
        _cast_buffers(module, nested, options.mixed_precision.buffer_dtype)
    prefixes = {id(m): f"{name}." if name else "" for name, m in module.named_modules(remove_duplicate=False)}
    units = []
    for m in unit_modules:
        for i, group in enumerate(_dtype_groups(by_owner[id(m)])):
            key = _unit_key(prefixes[id(m)].rstrip("."), i, group[0].param.dtype)
            units.append(_build_unit(m, group, comm, mesh, options, key))
    for child in nested:
        child_state: ShardingState = child._hsdp_state
        child_state.remove_hooks()
        units.extend(child_state.units)
        for u in child_state.units:
            u.comm = comm
            dtype_tag = u.key[u.key.index("["):] if "[" in u.key else ""  # module names hold no "["
            u.key = prefixes[id(u.module)].rstrip(".") + dtype_tag
            for p in u.params:
                p.rebase(prefixes)
    if not units or units[0].module is not module:
        # The root still needs hooks to be the root (e.g. all params live in nested units).
        units.insert(0, ShardUnit.empty(module, comm, options.mixed_precision))
    state = ShardingState(mesh, comm, units, broadcast_buffers=options.broadcast_buffers)
    state.register_hooks(units)
    object.__setattr__(module, "_hsdp_state", state)
    object.__setattr__(module, "_hsdp_mesh", mesh)
    for child in nested:
        object.__setattr__(child, "_hsdp_state", state)
        child._hsdp_load_hook.remove()
    hook = module._register_load_state_dict_pre_hook(_load_state_dict_pre_hook, with_module=True)
    object.__setattr__(module, "_hsdp_load_hook", hook)


def _check_meta(assignments: list[ParamAssignment]) -> None:
    """A model built under ``torch.device("meta")`` is wrapped with its shards left on meta (no values to
    broadcast) until ``hsdp.materialize`` / ``hsdp.load_pretrained`` / ``to_empty``; half-meta models are
    refused, since their real half would be initialised by construction and the rest by materialize."""
    meta = [a.slots[0].fqn for a in assignments if a.param.is_meta]
    if meta and len(meta) < len(assignments):
        real = [a.slots[0].fqn for a in assignments if not a.param.is_meta]
        raise ValueError(
            f"some parameters are on the meta device ({meta[:3]}) and some are not ({real[:3]}): build the "
            f"whole model under `with torch.device('meta'):` (then hsdp.materialize) or none of it"
        )


def _own_buffers(module: nn.Module, nested: list[nn.Module]) -> list[torch.Tensor]:
    skip = {id(b) for n in nested for b in n.buffers()}
    return [b for b in module.buffers() if id(b) not in skip]


def _cast_buffers(module: nn.Module, nested: list[nn.Module], dtype: torch.dtype) -> None:
    skip = {id(b) for n in nested for b in n.buffers()}
    for m in module.modules():
        for name, b in m._buffers.items():
            if b is not None and b.is_floating_point() and id(b) not in skip:
                m._buffers[name] = b.to(dtype)


def _broadcast_from_rank0(comm: Comm, tensors: list[torch.Tensor]) -> None:
    """Replicas start identical: one flat broadcast per (device, dtype) of ``tensors``. Meta tensors hold no
    values: they are skipped (``hsdp.materialize`` initialises them identically on every rank)."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        if not t.is_meta:
            groups.setdefault((t.device, t.dtype), []).append(t)
    with torch.no_grad():
        for tensors in groups.values():
            flat = torch.cat([t.detach().reshape(-1) for t in tensors])
            comm.broadcast(flat, 0, "world")
            offset = 0
            for t in tensors:
                t.copy_(flat[offset: offset + t.numel()].view_as(t))
                offset += t.numel()


def _build_unit(module: nn.Module, assigned: list[ParamAssignment], comm: Comm, mesh: HSDPMesh,
                options: UnitOptions, key: str) -> ShardUnit:
    policy = options.mixed_precision
    params = [
        ShardedParam(a.slots, a.param, ShardLayout(tuple(a.param.shape), mesh.sharding_degree, mesh.shard_rank),
                     policy.compute(a.param.dtype))
        for a in assigned
    ]
    unit = ShardUnit(module, params, comm, options.reshard_after_forward, key, policy, options.replica_hop)
    unit.load_full([a.param.detach() for a in assigned])
    for p in params:
        p.to_sharded()
    return unit

