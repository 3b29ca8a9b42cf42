"""How a module becomes units: ``ShardedModel``'s construction.

Unit modules are chosen (``wrap.py``) and each parameter is assigned to the innermost one; every check
runs before the first collective; unit module by unit module, its parameters are broadcast from rank 0
(one flat broadcast per dtype) and its units' flat shard buffers are built; buffers are moved to the
mesh's device and broadcast; already-wrapped submodules hand their units to the new root; and one
``HSDPState`` hooks them all.

[Note: the device at wrap] Everything hsdp allocates lives on ``mesh.device`` (the rank's GPU under NCCL,
the CPU under gloo), whatever device the module was built on. A parameter elsewhere (a model built on the
CPU under NCCL) is moved shard by shard: the unit's flat shard buffer is allocated on the mesh's device and
each rank copies only its own chunks into it, so the full model never lands on the GPU. With more than one
rank, rank 0's values travel through a broadcast staged on the mesh's device, one unit module at a time
(peak extra memory: one unit module's parameters, as on the CPU). Buffers are small and replicated: they
are moved whole. Meta parameters and buffers stay on meta (``hsdp.materialize`` allocates them).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from hsdp.engine.collectives import Comm
from hsdp.engine.hops import ReplicaHop, can_scatter
from hsdp.engine.mesh import HSDPMesh
from hsdp.engine.policy import MixedPrecision
from hsdp.engine.replicate.combinations import Feature, refused
from hsdp.engine.runtime.buffers import move_buffers
from hsdp.engine.runtime.layout import ShardLayout
from hsdp.engine.runtime.piece_plan import piece_rows
from hsdp.engine.runtime.piece_slice import piece_slice
from hsdp.engine.runtime.replica_slice import SliceLayout
from hsdp.engine.runtime.sharded_param import ShardedParam
from hsdp.engine.runtime.state import HSDPState
from hsdp.engine.runtime.unit import ShardUnit
from hsdp.engine.tensor_parallel import check_tp_params, tp_split
from hsdp.engine.wrap import ParamAssignment, WrapPolicy, assign_params, dominant_unit_warning, select_unit_modules


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
                f"{type(self.replica_hop).__name__} cannot do (it has no start_scatter): use "
                f"replica_hop=hsdp.AllReduceHop(), AllReduceHop(torch.bfloat16) (half the inter-node bytes) or "
                f"hsdp.Int8ErrorFeedbackHop() (a quarter), or turn shard_optimizer_across_replicas off")


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
    dominant = dominant_unit_warning(module, wrap, assignments)
    if dominant is not None:
        warnings.warn(dominant, stacklevel=3)
    by_owner: dict[int, list[ParamAssignment]] = {id(m): [] for m in unit_modules}
    for a in assignments:
        by_owner[id(a.owner)].append(a)
    # Every check above and here runs before the first collective below.
    _check_meta(assignments)  # devices need no check: every non-meta parameter goes to the mesh's device
    check_tp_params([(a.slots[0].fqn, a.param) for a in assignments], mesh)
    _check_replica_options(mesh, options)

    comm = Comm(mesh)
    prefixes = {id(m): f"{name}." if name else "" for name, m in module.named_modules(remove_duplicate=False)}
    units = []
    # One unit module at a time (see [Note: the device at wrap]): peak extra memory is one unit module's
    # parameters, not the model's.
    for m in unit_modules:
        assigned = by_owner[id(m)]
        values = _broadcast_params(comm, [a.param for a in assigned], mesh.device)
        value_of = {id(a.param): v for a, v in zip(assigned, values, strict=True)}
        for i, group in enumerate(_dtype_groups(assigned)):
            key = _unit_key(prefixes[id(m)].rstrip("."), i, group[0].param.dtype)
            units.append(_build_unit(m, group, [value_of[id(a.param)] for a in group], comm, mesh, options, key))
    # Heterogeneous replicas: the groups every unit's pieces are reduced over, created now on every rank.
    if mesh.heterogeneous:
        mesh.replicas.ensure_groups(piece_rows([p.layout for u in units for p in u.params]))
    skip = {id(b) for n in nested for b in n.buffers()}
    move_buffers(module, mesh.device, skip)
    _broadcast_from_rank0(comm, _own_buffers(module, skip), mesh.device)
    if options.mixed_precision.buffer_dtype is not None:
        _cast_buffers(module, skip, options.mixed_precision.buffer_dtype)
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


def _check_replica_options(mesh: HSDPMesh, options: UnitOptions) -> None:
    """What elastic replicas, or replicas of different degrees, do not compose with, refused before any
    collective."""
    elastic = mesh.elastic is not None
    if elastic and options.shard_optimizer_across_replicas and refused(Feature.ELASTIC, Feature.SLICED_OPTIMIZER):
        raise ValueError("an elastic mesh's replicas come and go, so optimizer state split across them would "
                         "leave with a dead replica: turn shard_optimizer_across_replicas off")
    if mesh.heterogeneous and mesh.tp_degree > 1 and options.shard_optimizer_across_replicas:
        # Each pair works; the three together are not built: a slice of pieces is kept and checkpointed per
        # TP-local piece without the tp coordinate (runtime/piece_slice.py, optim/piece_slice_state.py).
        raise ValueError(f"shard_optimizer_across_replicas with tensor parallelism on replicas of different shard "
                         f"degrees (sharding_degree={list(mesh.replicas.degrees)}) is not supported yet: turn "
                         f"shard_optimizer_across_replicas off, give every replica the same degree, or use "
                         f"tensor_parallel_degree=1")


def _broadcast_params(comm: Comm, params: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Replicas start identical: rank 0's values of whole parameters (plain, or ``Replicate()`` on the tp mesh),
    a world broadcast; a tensor-parallel piece (``Shard(d)`` on the tp mesh) differs by tp rank, so it comes
    from the first rank of its own tp coordinate (replica 0, shard 0): one broadcast across replicas, then
    one in the shard group. Returns TP-local values."""
    out = [p.to_local() if isinstance(p, DTensor) else p for p in params]
    split = [i for i, p in enumerate(params) if isinstance(p, DTensor) and isinstance(p.placements[0], Shard)]
    whole = [i for i in range(len(params)) if i not in set(split)]
    for i, v in zip(whole, _broadcast_from_rank0(comm, [out[i] for i in whole], device, "world"), strict=True):
        out[i] = v
    values = _broadcast_from_rank0(comm, _across_replicas(comm, [out[i] for i in split], device), device, "shard")
    for i, v in zip(split, values, strict=True):
        out[i] = v
    return out


def _across_replicas(comm: Comm, values: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Replica 0's values on shard rank 0 of every replica, per tp coordinate: the grid's ``"replicate"`` group;
    on replicas of different shard degrees the position group of shard rank 0 (``FixedLayer``, one per tp
    coordinate), which the other shard ranks are not in (the shard broadcast after this reaches them). Replicas
    outside this process group's world (elastic) send nothing here: their layer heals every joiner from a live
    member, position by position (the first quorum heals every replica from one), and a broadcast now would
    wait for members that are training."""
    mesh = comm.mesh
    if mesh.replicas.outside_world:
        return values
    if not mesh.heterogeneous:
        return _broadcast_from_rank0(comm, values, device, "replicate")
    if mesh.shard_rank != 0:
        return values
    # The group's ranks are in replica order: replica 0's is its rank 0.
    return _broadcast_from_rank0(comm.replica_view((0,) * mesh.replicate_degree), values, device, "replicate")


def _own_buffers(module: nn.Module, skip: set[int]) -> list[torch.Tensor]:
    """The buffers the new root owns: all but those of nested wrappers (ids in ``skip``)."""
    return [b for b in module.buffers() if id(b) not in skip]


def _cast_buffers(module: nn.Module, skip: set[int], dtype: torch.dtype) -> None:
    for m in module.modules():
        for name, b in m._buffers.items():
            if b is not None and b.is_floating_point() and id(b) not in skip:
                m._buffers[name] = b.to(dtype)


def _broadcast_from_rank0(comm: Comm, tensors: list[torch.Tensor], device: torch.device,
                          group: str = "world") -> list[torch.Tensor]:
    """Replicas start identical: rank 0's value of each of ``tensors``, one flat broadcast per dtype staged
    on ``device`` (the mesh's). A tensor on ``device`` is overwritten in place and returned; one elsewhere
    (a CPU-built model on a GPU mesh) is left as it was and its value returned as a view into the staged
    buffer, from which the caller copies its chunk. Meta tensors hold no values: they are skipped and
    returned as they are (``hsdp.materialize`` initialises them identically on every rank). A world of one
    sends nothing and returns ``tensors``."""
    out = list(tensors)
    if comm.size(group) == 1:
        return out
    groups: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        if not t.is_meta:
            groups.setdefault(t.dtype, []).append(i)
    with torch.no_grad():
        for dtype, indices in groups.items():
            flat, views = _staged([tensors[i] for i in indices], dtype, device)
            if _group_rank(comm, group) == 0:  # the others' values are overwritten: not worth a copy to the device
                for i, view in zip(indices, views, strict=True):
                    view.copy_(tensors[i].detach())
            comm.broadcast(flat, 0, group)
            for i, view in zip(indices, views, strict=True):
                if tensors[i].device == device:
                    tensors[i].copy_(view)
                else:
                    out[i] = view
    return out


def _group_rank(comm: Comm, group: str) -> int:
    mesh = comm.mesh
    return {"world": mesh.rank, "replicate": mesh.replicate_rank, "shard": mesh.shard_rank, "tp": mesh.tp_rank}[group]


def _staged(tensors: list[torch.Tensor], dtype: torch.dtype,
            device: torch.device) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """An uninitialised flat buffer for ``tensors`` on ``device`` and a view of it shaped like each."""
    flat = torch.empty(sum(t.numel() for t in tensors), dtype=dtype, device=device)
    views, offset = [], 0
    for t in tensors:
        views.append(flat[offset: offset + t.numel()].view_as(t))
        offset += t.numel()
    return flat, views


def _sharded_param(a: ParamAssignment, mesh: HSDPMesh, policy: MixedPrecision) -> ShardedParam:
    """The sharded face of one parameter: of its TP-local tensor when tensor parallelism split it."""
    tp = tp_split(a.param, mesh)
    local_shape = tuple(a.param.to_local().shape) if isinstance(a.param, DTensor) else tuple(a.param.shape)
    layout = ShardLayout(local_shape, mesh.sharding_degree, mesh.shard_rank, tp)
    tp_mesh = mesh.tp_mesh if isinstance(a.param, DTensor) else None
    return ShardedParam(a.slots, a.param, layout, policy.compute(a.param.dtype), tp_mesh)


def _build_unit(module: nn.Module, assigned: list[ParamAssignment], values: list[torch.Tensor], comm: Comm,
                mesh: HSDPMesh, options: UnitOptions, key: str) -> ShardUnit:
    """One unit of ``assigned`` (one dtype); ``values`` are rank 0's full values of the parameters (any
    device): each rank copies its chunks of them into the unit's flat shard buffer on the mesh's device."""
    policy = options.mixed_precision
    params = [_sharded_param(a, mesh, policy) for a in assigned]
    if options.shard_optimizer_across_replicas and mesh.replicate_degree > 1:  # R = 1: nothing to split
        for p in params:
            if mesh.heterogeneous:  # each replica's part of every piece (runtime/piece_slice.py)
                p.slice = piece_slice(p.layout, mesh.replicas.degrees, mesh.replicate_rank)
                continue
            p.slice = SliceLayout(p.layout, mesh.replicate_degree, mesh.replicate_rank)
            p.slice_mesh = mesh.device_mesh
    unit = ShardUnit(module, params, comm, options.reshard_after_forward, key, policy, options.replica_hop)
    unit.load_full([v.detach() for v in values])
    for p in params:
        p.to_sharded()
    return unit

