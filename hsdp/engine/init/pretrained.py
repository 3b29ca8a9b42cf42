"""``load_pretrained``: a safetensors checkpoint read straight into a ShardedModel's shards.

Only the ranks of replica 0 read: each reads, for every parameter, just the rows of its own chunk
(``get_slice(name)[start:stop]``) into its shard, and broadcasts the unit's shard inside its replicate
group (one broadcast per unit, through ``hsdp.engine.collectives.Comm``). Buffers are small and replicated: replica
0's ranks read them whole and broadcast them the same way. Peak memory per rank is its shards plus one
tensor's chunk, whatever the checkpoint's size; a model built on the meta device gets its shard storage
allocated here, unit by unit, and needs no ``materialize``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.tensor import Shard

from hsdp.engine.init.meta import init_placeholder, meta_buffer_names, root_model, unwritten
from hsdp.engine.init.safetensors_source import KeyMap, SafetensorsSource
from hsdp.engine.model import ShardedModel
from hsdp.engine.runtime.sharded_param import ShardedParam
from hsdp.engine.runtime.storage import allocate_shards, cast_floating_buffers


def load_pretrained(model: nn.Module, path: str | os.PathLike, *, key_map: KeyMap = None) -> nn.Module:
    """Load ``path`` into ``model`` (a root ShardedModel, built on the meta device or not); returns it.

    ``path``: a ``.safetensors`` file, a ``model.safetensors.index.json``, or a folder holding either (a
    Hugging Face model folder). ``key_map`` turns checkpoint names into the model's: a callable
    (``name -> model name``, or ``None`` to skip the tensor) or a dict of prefix rewrites
    (``{"model.": ""}`` strips a ``model.`` prefix; the longest matching prefix wins; ``None`` skips).

    Every parameter and persistent buffer must be in the checkpoint (a tied parameter under any of its
    names; hsdp's export records tied aliases, which count) and every checkpoint tensor must be used, with
    the model's shapes; values are cast to the model's dtypes. Otherwise ``ValueError`` lists the missing
    and unexpected names and the shape mismatches, raised on every rank from the file headers alone, before
    any collective. Non-persistent buffers are loaded when the checkpoint has them; meta ones it lacks are
    re-created by their module's ``reset_parameters()`` (run with its parameters on meta, so nothing else is
    touched). Build the optimizer afterwards. Every rank must be able to open ``path`` (headers only off
    replica 0).
    """
    model = root_model(model, "load_pretrained")
    source = SafetensorsSource(path, key_map)
    plan = _match(model, source)
    plan.raise_problems(os.fspath(path))
    model.reshard()
    _load_params(model, source, plan)
    model._hsdp_state.loads += 1  # DiLoCo's global copy follows (optim/outer_step.py)
    _load_buffers(model, source, plan)
    for module, prefix in plan.rebuild:
        _rebuild_meta_buffers(module, prefix, model.mesh.device)
    buffer_dtype = model.units[0].policy.buffer_dtype
    if buffer_dtype is not None:
        cast_floating_buffers(model, buffer_dtype)
    return model


@dataclass
class _Plan:
    params: dict[int, str] = field(default_factory=dict)  # id(ShardedParam) -> checkpoint entry name
    buffers: list[tuple[nn.Module, str, str]] = field(default_factory=list)  # (module, buffer name, entry)
    rebuild: list[tuple[nn.Module, str]] = field(default_factory=list)  # modules whose meta buffers to rebuild
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)
    unrebuildable: list[str] = field(default_factory=list)

    def raise_problems(self, path: str) -> None:
        parts = []
        for title, names in (("missing", self.missing), ("unexpected", self.unexpected),
                             ("shape mismatches", self.mismatched)):
            if names:
                parts.append(f"{title} ({len(names)}): {', '.join(names[:10])}{' ...' if len(names) > 10 else ''}")
        if parts:
            raise ValueError(f"checkpoint {path} does not fit the model: " + "; ".join(parts) + ". Map names "
                             "with key_map= (a callable, or a dict of prefix rewrites such as {'model.': ''}; "
                             "None drops a tensor)")
        if self.unrebuildable:
            raise ValueError(
                f"buffers on the meta device that the checkpoint lacks and no reset_parameters() re-creates: "
                f"{', '.join(self.unrebuildable[:10])}: give their modules a reset_parameters() that "
                f"re-creates them, or create them outside the meta device")


def _match(model: ShardedModel, source: SafetensorsSource) -> _Plan:
    """Pair model tensors with checkpoint entries; collect every problem (no collective, no data read)."""
    plan, used = _Plan(), set()
    for unit in model.units:
        for p in unit.params:
            names = [s.fqn for s in p.slots]
            hit = next((n for n in names if n in source.entries), None)
            used.update(n for n in names if n in source.entries)
            if hit is None:
                plan.missing.append(names[0])
            elif source.entries[hit].shape != p.layout.dtensor_shape:
                plan.mismatched.append(f"{hit}: checkpoint {source.entries[hit].shape}, model {p.layout.dtensor_shape}")
            else:
                plan.params[id(p)] = hit
    for prefix, module in model.named_modules():
        lacking = []
        for name, b in module._buffers.items():
            if b is None:
                continue
            fqn = f"{prefix}.{name}" if prefix else name
            entry = source.entries.get(fqn)
            used.add(fqn)
            if entry is None:
                if name not in module._non_persistent_buffers_set:
                    plan.missing.append(fqn)
                elif b.is_meta:
                    lacking.append(fqn)
            elif entry.shape != tuple(b.shape):
                plan.mismatched.append(f"{fqn}: checkpoint {entry.shape}, model {tuple(b.shape)}")
            else:
                plan.buffers.append((module, name, fqn))
        if lacking and callable(getattr(module, "reset_parameters", None)):
            plan.rebuild.append((module, prefix))
        else:
            plan.unrebuildable.extend(lacking)
    plan.unexpected = sorted(n for n in source.entries if n not in used)
    return plan


def _load_params(model: ShardedModel, source: SafetensorsSource, plan: _Plan) -> None:
    """Replica 0's ranks read their rows of each unit; one broadcast per unit in the replicate group. Replicas
    of different shard degrees hold different rows: every rank reads its own (no broadcast)."""
    mesh, comm = model.mesh, model.comm
    reading = mesh.replicate_rank == 0 or mesh.heterogeneous
    for unit in model.units:
        if not unit.params:
            continue
        allocate_shards(unit, mesh)
        if reading:
            requests, columns = _row_requests(unit.params, plan)
            with torch.no_grad():
                source.read_rows(requests)
                for p, rows in columns:  # a row-parallel piece: its columns of the rows read
                    assert p.layout.tp is not None
                    p.sharded_local.copy_(p.layout.tp.piece(rows))
        if not mesh.heterogeneous:
            comm.broadcast(unit.sharded_flat, 0, "replicate")


def _row_requests(params: list[ShardedParam], plan: _Plan) -> tuple[list[tuple[str, int, int, torch.Tensor]],
                                                                     list[tuple[ShardedParam, torch.Tensor]]]:
    """What each parameter reads: its rows of the checkpoint tensor, straight into its shard; under tensor
    parallelism the rows of its TP piece (a column-parallel piece is a row range of the full tensor too),
    and for a piece split along a later dim (row-parallel) its rows at full width into a buffer, narrowed
    after the read (the second list)."""
    out, columns = [], []
    for p in params:
        start, rows, tp = p.layout.row_offset(), p.layout.local_rows(), p.layout.tp
        if not rows:
            continue
        split = tp is not None and isinstance(tp.placement, Shard)
        if split and tp.placement.dim == 0:
            full_rows = tp.full_shape[0]
            start += min(tp.rank * -(-full_rows // tp.degree), full_rows)
        if split and tp.placement.dim > 0:
            buffer = p.sharded_local.new_empty((rows, *tp.full_shape[1:]))
            out.append((plan.params[id(p)], start, start + rows, buffer))
            columns.append((p, buffer))
        else:
            out.append((plan.params[id(p)], start, start + rows, p.sharded_local))
    return out, columns


def _load_buffers(model: ShardedModel, source: SafetensorsSource, plan: _Plan) -> None:
    """Replica 0 reads the buffers whole; one broadcast per dtype in the replicate group (every rank reads them
    on replicas of different shard degrees, which have no one replicate group)."""
    device = model.mesh.device
    reading = model.mesh.replicate_rank == 0 or model.mesh.heterogeneous
    values = [torch.empty(source.entries[e].shape, dtype=m._buffers[n].dtype, device=device)
              for m, n, e in plan.buffers]
    if reading:
        with torch.no_grad():
            source.read_rows((e, 0, source.entries[e].shape[0] if source.entries[e].shape else 0, v)
                             for (_, _, e), v in zip(plan.buffers, values, strict=True))
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for v in values:
        groups.setdefault(v.dtype, []).append(v)
    for tensors in groups.values():
        flat = torch.cat([t.reshape(-1) for t in tensors])
        if not model.mesh.heterogeneous:
            model.comm.broadcast(flat, 0, "replicate")
        for t, piece in zip(tensors, flat.split([t.numel() for t in tensors]), strict=True):
            t.copy_(piece.view_as(t))
    with torch.no_grad():
        for (module, name, _), value in zip(plan.buffers, values, strict=True):
            current = module._buffers[name]
            if current.is_meta or current.device != device:
                module._buffers[name] = value
            else:
                current.copy_(value)  # keep the tensor object (a graph or another module may hold it)


def _rebuild_meta_buffers(module: nn.Module, prefix: str, device: torch.device) -> None:
    """Run ``module.reset_parameters()`` with its own parameters swapped for meta tensors (their values are
    untouched, nothing is drawn for them) and its meta buffers as placeholders on ``device``."""
    params = dict(module._parameters)
    names = meta_buffer_names(module)
    holders = {n: init_placeholder(tuple(module._buffers[n].shape), module._buffers[n].dtype, device) for n in names}
    versions = {n: t._version for n, t in holders.items()}
    for n, p in params.items():
        if p is not None:
            # Plain meta tensors of the global shape (the slots hold DTensor shards).
            module._parameters[n] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"),
                                                 requires_grad=p.requires_grad)
    module._buffers.update(holders)
    try:
        with torch.device(device), torch.no_grad():
            module.reset_parameters()
    finally:
        module._parameters.update(params)
    for n in names:
        value = module._buffers.get(n)
        why = unwritten(value, holders[n], versions[n])
        if why is not None:
            raise ValueError(f"buffer {prefix + '.' if prefix else ''}{n} {why} after "
                             f"{type(module).__name__}.reset_parameters(): it must re-create its buffers")
        module._buffers[n] = value.detach().to(device)
