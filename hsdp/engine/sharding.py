"""How a module becomes units: ``ShardedModel``'s construction.

Unit modules are chosen (``wrap.py``) and each parameter is assigned to the innermost one; every check
runs before the first collective; parameters (one flat broadcast per unit) and buffers are broadcast from
rank 0; each unit's flat shard buffer is built; already-wrapped submodules hand their units to the new
root; and one ``HSDPState`` hooks them all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from hsdp.engine.collectives import Comm
from hsdp.engine.hops import ReplicaHop, can_scatter
from hsdp.engine.mesh import HSDPMesh
from hsdp.engine.policy import MixedPrecision
from hsdp.engine.runtime.layout import ShardLayout
from hsdp.engine.runtime.replica_slice import SliceLayout
from hsdp.engine.runtime.sharded_param import ShardedParam
from hsdp.engine.runtime.state import HSDPState
from hsdp.engine.runtime.unit import ShardUnit
from hsdp.engine.wrap import ParamAssignment, WrapPolicy, assign_params, select_unit_modules


def _nested_roots(module: nn.Module) -> list[nn.Module]:
    """Already-wrapped submodules (outermost only): their units are absorbed into the new root."""
    out: list[nn.Module] = []

    def visit(m: nn.Module) -> None:
        for child in m.children():
            if isinstance(getattr(child, "_hsdp_state", None), HSDPState):
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
    shard_optimizer_across_replicas: bool = False  # see hsdp/engine/runtime/replica_slice.py

    def __post_init__(self) -> None:
        # Checked here, before the first collective of wrapping.
        if self.broadcast_buffers is not None and not isinstance(self.broadcast_buffers, bool):
            raise ValueError(f"broadcast_buffers must be True, False or None (automatic: on iff the model has "
                             f"BatchNorm-style running statistics), got {self.broadcast_buffers!r}")
        if not isinstance(self.shard_optimizer_across_replicas, bool):
            raise ValueError(f"shard_optimizer_across_replicas must be True or False, got "
                             f"{self.shard_optimizer_across_replicas!r}")
        if self.shard_optimizer_across_replicas and not can_scatter(self.replica_hop):
            raise ValueError(
                f"shard_optimizer_across_replicas reduce-scatters gradients across replicas, which "
                f"{type(self.replica_hop).__name__} cannot do (it all-gathers its payload): use "
                f"replica_hop=hsdp.AllReduceHop() or AllReduceHop(torch.bfloat16) (half the inter-node bytes), or "
                f"turn shard_optimizer_across_replicas off")


class Sharded(NamedTuple):
    state: HSDPState  # the runtime of the new root: every unit, nested wrappers' included, and the hooks
    nested: list[nn.Module]  # already-wrapped submodules whose units the new root absorbed


def shard_module(module: nn.Module, mesh: HSDPMesh, wrap: WrapPolicy, options: UnitOptions) -> Sharded:
    """Turn ``module`` into units and hook them; every check runs before the first collective (the
    broadcasts from rank 0 that make replicas start identical)."""
    nested = _nested_roots(module)
    for child in nested:
        if child._hsdp_state.mesh is not mesh:
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
        child_state: HSDPState = child._hsdp_state
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
    state = HSDPState(mesh, comm, units, broadcast_buffers=options.broadcast_buffers)
    state.register_hooks(units)
    return Sharded(state, nested)


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
    if options.shard_optimizer_across_replicas and mesh.replicate_degree > 1:  # R = 1: nothing to split
        for p in params:
            p.slice = SliceLayout(p.layout, mesh.replicate_degree, mesh.replicate_rank)
    unit = ShardUnit(module, params, comm, options.reshard_after_forward, key, policy, options.replica_hop)
    unit.load_full([a.param.detach() for a in assigned])
    for p in params:
        p.to_sharded()
    return unit

