"""The optimizer state a heal sends row by row: the tensors shaped like the parameter shards (Adam's moments).

On a grid a joiner's rank receives its shard's state whole from the same shard rank of the source, in the
optimizer's bytes (``elastic_heal.py``). Across replicas of different shard degrees the source's shard holds
other rows than the joiner's, so those tensors leave the bytes (each replaced by an empty tensor of its dtype,
its ``(param index, key)`` listed under :data:`ROWS`) and cross piece by piece like the parameters
(``runtime/piece_broadcast.py``), one flat per dtype; scalars (step counts), hyperparameters and hsdp's counters
stay in the bytes, which every rank receives from a source rank of its position group.

The same goes for DiLoCo's outer optimizer (``outer_heal.py``), whose parameters are the global copy's flats, one
per unit laid out like its flat shard: a state tensor shaped like a flat (SGD's momentum) holds the rows of every
parameter of the unit, each at its offset. :data:`Cut` says where a state tensor's parameters lie.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from hsdp.engine.collectives import Comm
from hsdp.engine.runtime.layout import ShardLayout
from hsdp.engine.runtime.piece_broadcast import broadcast_rows

ROWS = "rows"  # the payload's list of (param index, state key) sent row by row
Entry = tuple[int, str]
Cut = list[tuple[ShardLayout, int]]  # the parameters whose rows a state tensor holds, each at its offset in it


def is_rows(value: object, param: torch.Tensor) -> bool:
    """Whether an optimizer state value is laid out like its parameter's shard (rows of the parameter)."""
    local = param.to_local() if isinstance(param, DTensor) else param
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == local.shape


def take_rows(state: dict[int, dict[str, Any]], params: list[torch.Tensor]) -> list[Entry]:
    """Replace every row-shaped tensor of ``state`` (torch's ``state_dict()["state"]``, local tensors) by an empty
    one of its dtype; the entries replaced, in order."""
    entries = []
    for i, entry in state.items():
        for k, v in entry.items():
            if is_rows(v, params[i]):
                entries.append((i, k))
                entry[k] = v.new_empty(0)
    return entries


def exchange_rows(comm: Comm, optimizer: torch.optim.Optimizer, cuts: dict[int, Cut],
                  state: dict[int, dict[str, Any]], entries: list[Entry], root: int,
                  joining: bool, to: tuple[int, ...]) -> dict[Entry, torch.Tensor]:
    """Member ``root``'s values of ``entries`` (of the received ``state``: their dtypes), sent to the members
    ``to`` (the joiners, ``piece_broadcast.py``) into this rank's shard layout, one send per dtype and holder
    tuple; on a joiner the local tensors to load, on the root an empty dict. ``cuts``: by ``id`` of
    each optimizer parameter, the rows its state tensors hold (a sharded parameter's: ``[(layout, 0)]``)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    by_dtype: dict[torch.dtype, list[Entry]] = {}
    for i, k in entries:
        by_dtype.setdefault(state[i][k].dtype, []).append((i, k))
    out: dict[Entry, torch.Tensor] = {}
    for dtype, group in by_dtype.items():
        locals_ = [_local(optimizer, params[i], k, dtype, joining) for i, k in group]
        starts, layouts, offsets = [0], [], []
        for (i, _), t in zip(group, locals_, strict=True):
            for layout, offset in cuts[id(params[i])]:
                layouts.append(layout)
                offsets.append(starts[-1] + offset)
            starts.append(starts[-1] + t.numel())
        flat = torch.cat([t.reshape(-1) for t in locals_])
        broadcast_rows(comm, flat, layouts, offsets, root, to)
        if joining:
            for (i, k), t, start in zip(group, locals_, starts[:-1], strict=True):
                out[(i, k)] = flat[start: start + t.numel()].view_as(t).clone()
    return out


def _local(optimizer: torch.optim.Optimizer, param: torch.Tensor, key: str, dtype: torch.dtype,
           joining: bool) -> torch.Tensor:
    """This rank's tensor of ``key`` for ``param``: its own (the source's values where it sends), or zeros laid
    out like the shard where it has none yet (a joiner)."""
    local = param.to_local() if isinstance(param, DTensor) else param
    own = optimizer.state.get(param, {}).get(key) if not joining else None
    if own is None:
        return torch.zeros(local.shape, dtype=dtype, device=local.device)
    return own.to_local() if isinstance(own, DTensor) else own
