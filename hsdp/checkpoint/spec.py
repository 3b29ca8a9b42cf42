"""Check a checkpoint against a model and optimizer before touching them, and describe what to load.

Runs on one rank (global rank 0), reads only ``.metadata``, the manifest, ``extra.json`` and the small
non-tensor values (hyper-parameters), and returns a JSON-able *spec* that every rank builds its load
buffers from. Every mismatch is found here, so a bad checkpoint fails before any live tensor changes:
missing or unexpected keys, shape mismatches, an optimizer of another kind or other parameter groups.
"""

from __future__ import annotations

import base64
import json
import os
from typing import Any

from hsdp.checkpoint.dcp_io import (
    METADATA,
    CheckpointReader,
    Entry,
    check_storage,
    decode_object,
    entries,
    load_locally,
    read_metadata_file,
)
from hsdp.checkpoint.diloco import is_diloco, plan_tensors
from hsdp.checkpoint.names import (
    MODEL,
    OPTIM,
    live_groups,
    live_state_names,
    optimizer_kind,
    param_by_name,
    sharded_param_of,
)
from hsdp.checkpoint.resolve import Candidate
from hsdp.engine.model import ShardedModel
from hsdp.engine.optim.local_step import is_elementwise
from hsdp.engine.optim.sharded_optimizer import ShardedOptimizer

EXTRA = "extra.json"
_SHOW = 5


def _names(keys: list[str]) -> str:
    more = f" and {len(keys) - _SHOW} more" if len(keys) > _SHOW else ""
    return ", ".join(keys[:_SHOW]) + more


def build_spec(cand: Candidate, model: ShardedModel, optimizer: ShardedOptimizer | None) -> dict[str, Any]:
    """Validate ``cand`` against ``model``/``optimizer``; the JSON spec of what to load, and bytes read."""
    metadata, nbytes = read_metadata_file(os.path.join(cand.path, METADATA))
    if cand.manifest is not None:
        check_storage(metadata, {n: e.size for n, e in cand.manifest.files.items()}, cand.path)
    found = entries(metadata)
    model_keys = _check_model(cand.path, found, model)
    optim_keys = [] if optimizer is None else [k for k, e in found.items() if e.path[0] == OPTIM]
    wanted = model_keys + optim_keys
    raw, read = _read_objects(cand.path, [found[k] for k in wanted if not found[k].is_tensor])
    if optimizer is not None:
        _check_optimizer(cand, [found[k] for k in optim_keys], raw, model, optimizer)
    extra, extra_bytes = _read_extra(cand)
    tensors = [_entry_json(found[k]) for k in sorted(wanted) if found[k].is_tensor]
    if is_diloco(optimizer):  # each replica's own weights and inner state, the global copy and outer state
        tensors = plan_tensors(cand.path, found, model, tensors)
    return {
        "path": cand.path,
        "step": None if cand.manifest is None else cand.manifest.step,
        "extra": extra,
        "tensors": tensors,
        "objects": {k: {"path": list(found[k].path), "raw": base64.b64encode(v).decode()} for k, v in raw.items()},
        "bytes_read": nbytes + read + extra_bytes,
    }


def _entry_json(e: Entry) -> dict[str, Any]:
    return {"key": e.key, "path": list(e.path), "shape": list(e.shape), "dtype": e.dtype}


def _check_model(where: str, found: dict[str, Entry], model: ShardedModel) -> list[str]:
    saved = {str(e.path[1]): e for e in found.values() if e.path[0] == MODEL and len(e.path) == 2}
    if not saved:
        raise ValueError(f"checkpoint {where} holds no model state (no 'model.*' entries): it was not written by "
                         f"hsdp.save_checkpoint or as dcp.save({{'model': ..., 'optim': ...}})")
    live = model.state_dict()
    missing = sorted(set(live) - set(saved))
    unexpected = sorted(set(saved) - set(live))
    if missing or unexpected:
        parts = [f"{label} keys [{_names(keys)}]" for label, keys in (("missing", missing), ("unexpected", unexpected))
                 if keys]
        raise ValueError(f"checkpoint {where} is of another model: {', '.join(parts)}: load it into the "
                         f"architecture it was saved from")
    wrong = [f"{k} {tuple(saved[k].shape)} in the checkpoint vs {tuple(v.shape)} here" for k, v in live.items()
             if hasattr(v, "shape") and (not saved[k].is_tensor or tuple(saved[k].shape) != tuple(v.shape))]
    if wrong:
        raise ValueError(f"checkpoint {where} is of another model: shape mismatch for {_names(wrong)}: build the "
                         f"model with the configuration it was saved with")
    return [saved[k].key for k in live]


def _read_objects(path: str, wanted: list[Entry]) -> tuple[dict[str, bytes], int]:
    """The raw ``torch.save`` bytes of small non-tensor values, read on this process alone."""
    if not wanted:
        return {}, 0
    reader = CheckpointReader(path)
    planner = load_locally({e.key: None for e in wanted}, reader)
    return planner.raw, reader.bytes_read


def _check_optimizer(cand: Candidate, saved: list[Entry], raw: dict[str, bytes], model: ShardedModel,
                     optimizer: ShardedOptimizer) -> None:
    where = cand.path
    if not saved:
        raise ValueError(f"checkpoint {where} holds no optimizer state: pass optimizer=None to load the model only")
    kind = optimizer_kind(optimizer)
    if cand.manifest is not None and cand.manifest.optimizer not in (None, kind):
        raise ValueError(f"checkpoint {where} holds {cand.manifest.optimizer} state but this optimizer is {kind}: "
                         f"build the optimizer the checkpoint was saved with")
    groups: dict[int, dict[str, Any]] = {}
    for e in saved:
        if e.path[1] == "param_groups" and len(e.path) == 4:
            groups.setdefault(int(e.path[2]), {})[str(e.path[3])] = decode_object(raw[e.key], e.key)
    params = param_by_name(model)
    _check_groups(where, [groups[i] for i in sorted(groups)], optimizer, params)
    _check_state(where, saved, optimizer, params)


def _check_groups(where: str, groups: list[dict[str, Any]], optimizer: ShardedOptimizer, params: dict) -> None:
    live = live_groups(optimizer)
    if len(groups) != len(live):
        raise ValueError(f"checkpoint {where} has {len(groups)} parameter groups, this optimizer {len(live)}: build "
                         f"the optimizer with the parameter groups it was saved with")
    required = set(optimizer.defaults)
    for i, (group, (_, live_params)) in enumerate(zip(groups, live)):
        lacking = sorted(required - set(group))
        if lacking:
            raise ValueError(f"checkpoint {where} is of an optimizer of another kind: its parameter group {i} lacks "
                             f"{_names(lacking)} which {type(optimizer).__name__} needs: build the optimizer the "
                             f"checkpoint was saved with")
        saved_params = {params[n].fqn if n in params else n for n in group.get("params", [])}
        if saved_params != set(live_params):
            gone, new = sorted(saved_params - set(live_params)), sorted(set(live_params) - saved_params)
            raise ValueError(f"checkpoint {where}: parameter group {i} holds other parameters (only in the "
                             f"checkpoint: [{_names(gone)}], only here: [{_names(new)}]): build the optimizer "
                             f"with the same parameter groups")


def _check_state(where: str, saved: list[Entry], optimizer: ShardedOptimizer, params: dict) -> None:
    state: dict[str, set[str]] = {}
    elementwise = is_elementwise(optimizer)
    for e in saved:
        if e.path[1] != "state" or len(e.path) != 4:
            continue
        name = str(e.path[2])
        if name not in params:
            raise ValueError(f"checkpoint {where} holds optimizer state for {name}, which this model lacks: load it "
                             f"into the model it was saved from")
        # An element-wise optimizer's state has the parameter's shape, or none (step); a factored one's
        # (Adafactor's row and column variances) has other shapes, resharded by ShardedOptimizer itself.
        if e.is_tensor and e.shape and elementwise and sharded_param_of(e.path, e.shape, params) is None:
            raise ValueError(f"checkpoint {where}: optimizer state {e.key} has shape {e.shape}, the parameter "
                             f"{params[name].layout.dtensor_shape}: the checkpoint is of another model")
        state.setdefault(params[name].fqn, set()).add(str(e.path[3]))
    for fqn, names in live_state_names(optimizer).items():
        if fqn in state and state[fqn] != names:
            raise ValueError(f"checkpoint {where} is of an optimizer of another kind: state of {fqn} is "
                             f"{sorted(state[fqn])} there, {sorted(names)} here: build the optimizer it was saved with")


def _read_extra(cand: Candidate) -> tuple[Any, int]:
    if cand.manifest is None or EXTRA not in cand.manifest.files:
        return None, 0
    with open(os.path.join(cand.path, EXTRA), "rb") as f:
        data = f.read()
    try:
        return json.loads(data), len(data)
    except ValueError as e:
        raise ValueError(f"{cand.path}: {EXTRA} is not valid JSON ({e})") from e
