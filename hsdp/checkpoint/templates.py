"""Load buffers: fresh tensors shaped like this rank's part of every checkpoint entry, and the state
dicts built from them once filled.

Loading goes into these copies, never into the live parameters or optimizer state: only after every
rank read its part and all agreed that nothing failed are the copies handed to ``load_state_dict``. The
cost is one extra copy of this rank's shards (1/S of the model and optimizer state) during the load.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from hsdp.checkpoint.dcp_io import decode_object, dtype_of
from hsdp.checkpoint.names import DILOCO, MODEL, OPTIM, param_by_name, sharded_param_of
from hsdp.engine.model import ShardedModel
from hsdp.engine.runtime.dtensor import to_sharded_dtensor


@dataclass
class Buffers:
    """``locals``: what is read or broadcast into; ``values``: what DCP and ``load_state_dict`` receive;
    ``own``: keys this rank's replica reads itself and nothing broadcasts (a DiLoCo replica's own state)."""

    locals: dict[str, torch.Tensor] = field(default_factory=dict)
    values: dict[str, torch.Tensor] = field(default_factory=dict)
    sharded: set[str] = field(default_factory=set)
    own: set[str] = field(default_factory=set)

    def add(self, key: str, local: torch.Tensor, value: torch.Tensor | None = None, own: bool = False) -> None:
        self.locals[key] = local
        self.values[key] = local if value is None else value
        if value is not None:
            self.sharded.add(key)
        if own:
            self.own.add(key)


def allocate(spec: dict[str, Any], model: ShardedModel) -> Buffers:
    """Empty buffers for every tensor of ``spec`` (sharded entries: this rank's chunk only)."""
    live = model.state_dict()
    params = param_by_name(model)
    param_mesh = model.mesh.param_mesh
    device = model.mesh.device
    out = Buffers()
    for t in spec["tensors"]:
        path, shape, dtype = tuple(t["path"]), tuple(t["shape"]), dtype_of(t["dtype"])
        own = "replica" in t  # see hsdp.checkpoint.diloco.plan_tensors
        if path[0] == MODEL:
            value = live[path[1]]
            if isinstance(value, DTensor):
                local = torch.empty_like(value.to_local())
                out.add(t["key"], local, to_sharded_dtensor(local, value.device_mesh, tuple(value.shape),
                                                                value.placements), own)
            else:
                out.add(t["key"], torch.empty_like(value), own=own)
            continue
        p = sharded_param_of(path, shape, params)
        if p is None:
            out.add(t["key"], torch.empty(shape, dtype=dtype, device=device), own=own)
        else:
            local = torch.empty(p.layout.local_shape, dtype=dtype, device=device)
            out.add(t["key"], local, to_sharded_dtensor(local, param_mesh, shape, p.layout.placements), own)
    return out


def _set(root: dict, path: tuple, value: Any) -> None:
    """``root[path[0]][path[1]]... = value``, creating dicts (integer keys become list indices later)."""
    node = root
    for part in path[:-1]:
        node = node.setdefault(part, {})
    node[path[-1]] = value


def assemble(spec: dict[str, Any], buffers: Buffers, model: ShardedModel) -> tuple[dict, dict | None, dict | None]:
    """The model state dict, the FQN-keyed optimizer state dict (``None`` if none was loaded) and a DiLoCo
    model's global copy, outer state and phase (``outer_checkpoint.outer_state_dict``'s layout; ``None``
    unless loaded)."""
    tree: dict = {}
    for t in spec["tensors"]:
        value = buffers.values[t["key"]]
        if t["path"][0] in (OPTIM, DILOCO) and value.dim() == 0:
            # Scalars (Adam's step) were read on the mesh device for the broadcast; torch keeps them on the
            # CPU unless capturable/fused, and load_state_dict moves them to the device in those cases.
            value = value.cpu()
        _set(tree, tuple(t["path"]), value)
    for key, obj in spec["objects"].items():
        _set(tree, tuple(obj["path"]), decode_object(base64.b64decode(obj["raw"]), key))
    optim = tree.get(OPTIM)
    if optim is not None:
        optim = _canonical_optim(optim, model)
    return tree.get(MODEL, {}), optim, tree.get(DILOCO)


def _canonical_optim(optim: dict, model: ShardedModel) -> dict:
    """Tied parameters may be named by any alias (other tools): use the name hsdp's optimizer uses."""
    params = param_by_name(model)

    def canon(name: str) -> str:
        return params[name].fqn if name in params else name

    groups = optim.get("param_groups", {})
    out = {
        "state": {canon(k): v for k, v in optim.get("state", {}).items()},
        "param_groups": [{**groups[i], "params": [canon(n) for n in groups[i].get("params", [])]}
                         for i in sorted(groups)],
    }
    if "hop_residuals" in optim:
        out["hop_residuals"] = {canon(k): v for k, v in optim["hop_residuals"].items()}
    return out
