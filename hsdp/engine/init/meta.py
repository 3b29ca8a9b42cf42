"""``materialize``: initialise a ShardedModel built on the meta device, holding only this rank's shards.

[Note: why module by module, in ``modules()`` order] A plain construction runs each module's
``reset_parameters()`` (from its ``__init__``) in construction order, drawing from the global RNG. Running
the same calls in the same order on full-size tensors on every rank, with the same seed, draws the same
numbers, so every rank computes the same full parameters and keeps its own chunk: the result equals the
plain model bitwise, and replicas agree without sending anything. Each module's own parameters exist at
full size only while its init runs, then its chunk is copied into the unit's shard and the full tensor is
freed; a unit's shard storage is allocated when its first parameter is initialised. Peak memory per rank
is therefore its shards plus the largest module's own parameters.

Tied parameters take the value of their first holder in ``modules()`` order (an embedding tied to a later
LM head: the embedding's init wins, as in a plain construction where the head's own weight is replaced by
the tie). A later holder's init still runs, on a scratch tensor, so the RNG advances as in a plain
construction; when that holder is the last module initialised, the scratch is a meta tensor (nothing
drawn, no memory): the weights are unchanged, only the generator's final state differs from a plain build.

Buffers built in ``__init__`` under ``torch.device("meta")`` hold no values. A module's init re-creates
them (``reset_parameters`` assigning the buffer again, or filling it in place); a meta buffer in a module
with no ``reset_parameters`` (and no ``init``) is an error naming it.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from hsdp.engine.collectives import Comm
from hsdp.engine.model import ShardedModel
from hsdp.engine.runtime.sharded_param import ShardedParam
from hsdp.engine.runtime.storage import allocate_shards, cast_floating_buffers
from hsdp.engine.runtime.unit import ShardUnit

InitFn = Callable[[nn.Module], None]


def materialize(model: nn.Module, device: torch.device | str | None = None,
                init: InitFn | None = None) -> nn.Module:
    """Allocate and initialise this rank's shards of a ShardedModel built under ``torch.device("meta")``.

    Every module that holds parameters or meta buffers of its own (``recurse=False``) is initialised in
    ``model.modules()`` order, at full size on ``device`` (default: the mesh's device): by
    ``module.reset_parameters()``, or ``init(module)`` when given. Either must write all of the module's own
    parameters and meta buffers and only those (FSDP's contract for ``reset_parameters``); an init that leaves
    one unwritten raises ``ValueError`` naming it. Each parameter's chunk is then copied into this rank's
    shard on the mesh's device and the full tensor freed. Returns ``model``.

    Call it on every rank with the same RNG state (``torch.manual_seed(seed)`` everywhere): the weights then
    equal those of the model built plainly on ``device`` with that seed, bitwise, when its own init is its
    modules' ``reset_parameters`` in construction order (torch's layers), and replicas are identical with
    nothing broadcast. Differing RNG states raise ``ValueError`` on every rank (one 8-byte all-gather of a
    digest of the generators). ``device="cpu"`` on a GPU mesh reproduces a plain CPU construction (the CPU
    generator) at the cost of host-to-device copies. The sharded parameters keep their identity, but build
    the optimizer afterwards, as after ``to_empty``. A model that is not on meta is re-initialised in place
    (its non-meta buffers are left to its inits). See [Note: why module by module] in this file.
    """
    model = root_model(model, "materialize")
    init_device = torch.device(device) if device is not None else model.mesh.device
    if init_device.type == "meta":
        raise ValueError("materialize(device='meta') would initialise nothing: pass the device to initialise on "
                         "(default: the mesh's device)")
    owners = slot_owners(model)
    calls = _plan(model, owners, init)  # raises before the collective below
    check_same_rng(model.comm, init_device)
    model.reshard()
    unit_of = {id(p): u for u in model.units for p in u.params}
    names = {id(m): name for name, m in model.named_modules()}
    done: set[int] = set()
    for i, (m, fn) in enumerate(calls):
        scratch = init_device if i + 1 < len(calls) else torch.device("meta")
        _ModuleInit(m, names[id(m)], owners, done, init_device, scratch).run(fn, unit_of, model)
    for unit in model.units:
        allocate_shards(unit, model.mesh)  # units whose parameters no module initialised (none, normally)
    model._hsdp_state.loads += 1  # DiLoCo's global copy follows (optim/outer_step.py)
    buffer_dtype = model.units[0].policy.buffer_dtype
    if buffer_dtype is not None:
        cast_floating_buffers(model, buffer_dtype)
    return model


# ---------------------------------------------------------------------------------------------------------
# Helpers shared with load_pretrained.
# ---------------------------------------------------------------------------------------------------------
def root_model(model: nn.Module, what: str) -> ShardedModel:
    """``model`` itself, checked to be the outermost ShardedModel (whose units hold every shard)."""
    if not isinstance(model, ShardedModel):
        raise ValueError(f"{what} expects a ShardedModel: wrap the model first, e.g. "
                         f"model = hsdp.ShardedModel(model, mesh=mesh) (built under torch.device('meta'))")
    if model.units[0].module is not model:
        raise ValueError(f"{what}: {type(model).__name__} is nested inside another ShardedModel: pass the "
                         f"outermost one")
    return model


def slot_owners(model: ShardedModel) -> dict[tuple[int, str], ShardedParam]:
    """``(id(module), name)`` of every place a sharded parameter is registered -> that parameter."""
    return {(id(s.module), s.name): p for u in model.units for p in u.params for s in p.slots}


def meta_buffer_names(module: nn.Module) -> list[str]:
    return [name for name, b in module._buffers.items() if b is not None and b.is_meta]


def check_same_rng(comm: Comm, device: torch.device) -> None:
    """Raise on every rank unless every rank's CPU generator (and ``device``'s) is in the same state."""
    states = [torch.get_rng_state()]
    if device.type not in ("cpu", "meta"):
        states.append(torch.get_device_module(device.type).get_rng_state(device))
    digest = hashlib.sha256(b"".join(s.numpy().tobytes() for s in states)).digest()[:8]
    everyone = comm.all_gather_bytes(digest, "world")
    differ = [r for r, d in enumerate(everyone) if d != everyone[0]]
    if differ:
        raise ValueError(
            f"materialize draws every rank's weights from its own RNG, and ranks {differ} have a different RNG "
            f"state from rank 0: call torch.manual_seed(seed) with the same seed on every rank before "
            f"materialize (and draw nothing rank-dependent in between)"
        )


def init_placeholder(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Storage for an init to fill: NaN where floating, so entries it never writes are detectable (an
    in-place write through ``.data`` does not bump the version counter)."""
    if dtype.is_floating_point or dtype.is_complex:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


# glibc serves allocations above its mmap threshold with their own mapping, returned to the OS when freed;
# the threshold rises to the size of each such free, up to 32 MiB on 64-bit. A module's full-size
# tensors live only during its init: from below the threshold they would leave holes in the heap that
# later shards only partly fill, and RSS would grow towards the whole model. Carved from one mapping above
# the cap, they always go back; its untouched pages cost no memory.
_ALWAYS_MAPPED = 64 << 20


def scratch_placeholders(specs: list[tuple[tuple[int, ...], torch.dtype]],
                         device: torch.device) -> list[torch.Tensor]:
    """:func:`init_placeholder` tensors of ``specs`` carved from one scratch allocation (on the CPU one
    that glibc returns to the OS when freed); each is freed when the last of them is."""
    if not specs:
        return []
    sizes = [math.prod(shape) * torch.empty((), dtype=d).element_size() for shape, d in specs]
    offsets = [sum(-(-n // 64) * 64 for n in sizes[:i]) for i in range(len(sizes))]  # 64-byte aligned
    total = offsets[-1] + sizes[-1]
    scratch = torch.empty(max(total, _ALWAYS_MAPPED) if device.type == "cpu" else total, dtype=torch.uint8,
                          device=device)
    out = []
    for (shape, dtype), offset, nbytes in zip(specs, offsets, sizes, strict=True):
        t = scratch[offset: offset + nbytes].view(dtype).view(shape)
        if dtype.is_floating_point or dtype.is_complex:
            t.fill_(float("nan"))
        out.append(t)
    return out


def unwritten(value: object, placeholder: torch.Tensor, version: int) -> str | None:
    """Why ``value`` (a module's tensor after its init ran on ``placeholder``) is not initialised, or None."""
    if not isinstance(value, torch.Tensor):
        return f"is {type(value).__name__}"
    if value.is_meta:
        return "is still on the meta device"
    if value is not placeholder:
        return None  # re-created by the init (e.g. a buffer assigned again)
    if value.is_floating_point() or value.is_complex():
        if not bool(value.sum().isnan()):  # a NaN entry makes the sum NaN; no full-size temporary
            return None
        missing = int(torch.isnan(value).sum())  # (+inf and -inf entries also sum to NaN)
        return f"has {missing} of {value.numel()} entries never written" if missing else None
    return "was never written" if value._version == version else None


# ---------------------------------------------------------------------------------------------------------
# The walk.
# ---------------------------------------------------------------------------------------------------------
def _plan(model: nn.Module, owners: dict[tuple[int, str], ShardedParam],
          init: InitFn | None) -> list[tuple[nn.Module, InitFn]]:
    """The (module, init) calls in order; ``ValueError`` naming every module that needs an init it lacks."""
    calls, problems, seen = [], [], set()
    names = {id(m): name for name, m in model.named_modules()}
    for m in model.modules():
        own = [owners[(id(m), n)] for n, p in m._parameters.items() if p is not None]
        fresh = [p for p in own if id(p) not in seen]
        buffers = meta_buffer_names(m)
        seen.update(id(p) for p in own)
        if not own and not buffers:
            continue
        fn = init if init is not None else _reset_of(m)
        if fn is not None:
            calls.append((m, fn))
        elif fresh or buffers:
            what = [p.fqn for p in fresh] + [f"buffer {_join(names[id(m)], b)}" for b in buffers]
            problems.append(f"{names[id(m)] or '<root>'} ({type(m).__name__}): {', '.join(what)}")
    if problems:
        raise ValueError(
            "materialize initialises each module with its reset_parameters(), and these modules hold "
            "parameters or meta buffers of their own but have none: " + "; ".join(problems[:8])
            + ". Give them a reset_parameters() that (re-)creates those tensors, pass init=fn (called as "
              "fn(module) for every module with tensors of its own), or create such buffers outside the meta "
              "device (e.g. torch.linspace(..., device='cpu'))"
        )
    return calls


def _reset_of(module: nn.Module) -> InitFn | None:
    reset = getattr(module, "reset_parameters", None)
    return (lambda m: reset()) if callable(reset) else None


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


@dataclass
class _ModuleInit:
    """One module's init: its own parameters at full size (scratch ones where tied to an earlier holder),
    its meta buffers as placeholders, then the chunks into the shards and the buffers onto the device."""

    module: nn.Module
    name: str
    owners: dict[tuple[int, str], ShardedParam]
    done: set[int]  # ids of ShardedParams already initialised (by an earlier holder)
    device: torch.device
    scratch_device: torch.device

    def run(self, fn: InitFn, unit_of: dict[int, ShardUnit], model: ShardedModel) -> None:
        m = self.module
        params = {n: self.owners[(id(m), n)] for n, p in m._parameters.items() if p is not None}
        fresh = {n: sp for n, sp in params.items() if id(sp) not in self.done}
        for sp in fresh.values():
            # Before the full-size tensors: long-lived shards below short-lived scratch keep the CPU heap
            # from fragmenting (glibc keeps freed holes resident).
            allocate_shards(unit_of[id(sp)], model.mesh)
        full = scratch_placeholders([(fresh[n].layout.dtensor_shape, fresh[n].dtype) for n in fresh], self.device)
        placeholders = dict(zip(fresh, full, strict=True))
        holders = {}
        for n, sp in params.items():
            value = placeholders.get(n)
            if value is None:  # tied to an earlier holder: drawn (for the RNG) but not kept
                value = init_placeholder(sp.layout.dtensor_shape, sp.dtype, self.scratch_device)
            holders[n] = nn.Parameter(value, requires_grad=sp.requires_grad)
            m._parameters[n] = holders[n]
        buffers = {n: init_placeholder(tuple(m._buffers[n].shape), m._buffers[n].dtype, self.device)
                   for n in meta_buffer_names(m)}
        m._buffers.update(buffers)
        versions = {id(t): t._version for t in (*holders.values(), *buffers.values())}
        try:
            with torch.device(self.device), torch.no_grad():
                fn(m)
            values = {n: m._parameters[n] for n in fresh}
            new_buffers = {n: m._buffers.get(n) for n in buffers}
        finally:
            for n, sp in params.items():
                m._parameters[n] = sp.sharded
        self._check(values, holders, new_buffers, buffers, versions)
        with torch.no_grad():
            for n, sp in fresh.items():
                sp.sharded_local.copy_(sp.layout.chunk_of_full(values[n].detach()))
                self.done.add(id(sp))
        for n, value in new_buffers.items():
            m._buffers[n] = value.detach().to(model.mesh.device)

    def _check(self, values: dict[str, object], holders: dict[str, torch.Tensor],
               new_buffers: dict[str, object], buffers: dict[str, torch.Tensor], versions: dict[int, int]) -> None:
        problems = []
        for n, value in values.items():
            shape = self.owners[(id(self.module), n)].layout.dtensor_shape
            if isinstance(value, torch.Tensor) and tuple(value.shape) != shape:
                problems.append(f"{_join(self.name, n)} changed shape from {shape} to {tuple(value.shape)}")
            elif (why := unwritten(value, holders[n], versions[id(holders[n])])) is not None:
                problems.append(f"{_join(self.name, n)} {why}")
        for n, value in new_buffers.items():
            if (why := unwritten(value, buffers[n], versions[id(buffers[n])])) is not None:
                problems.append(f"buffer {_join(self.name, n)} {why}")
        if problems:
            raise ValueError(
                f"the init of {self.name or '<root>'} ({type(self.module).__name__}) did not initialise "
                f"everything it owns: {'; '.join(problems)}. Its reset_parameters() or your init= must write "
                f"all of the module's own parameters and meta buffers (recurse=False)"
            )
