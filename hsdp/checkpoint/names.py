"""How a ShardedModel and its optimizer map onto checkpoint keys (the layout FSDP2's recipe uses).

A checkpoint is ``dcp.save({"model": model.state_dict(), "optim": optimizer.state_dict()})``: parameters
under ``model.<name>`` with their original names and shapes (``DTensor`` ``Shard(0)`` on the replica's mesh, so
DCP writes each shard once and reshards on load), optimizer state under ``optim.state.<param>.<name>``,
hyper-parameters under ``optim.param_groups.<i>.<name>``. This is what
``torch.distributed.checkpoint.state_dict.get_state_dict`` produces for an FSDP2 model, so checkpoints move
between hsdp and FSDP2 in both directions.
"""

from __future__ import annotations

from typing import Any

import torch

from hsdp.engine.model import ShardedModel
from hsdp.engine.optim.sharded_optimizer import ShardedOptimizer
from hsdp.engine.runtime.sharded_param import ShardedParam

MODEL = "model"
OPTIM = "optim"
DILOCO = "diloco"  # a DiLoCo model's global copy, outer state and every replica's state (diloco.py)
# Entries stored per parameter, sharded like it: (path[0], path[1]); the parameter's name is path[2].
PER_PARAM = {(OPTIM, "state"), (OPTIM, "hop_residuals"), (DILOCO, "global"), (DILOCO, "outer"),
             (DILOCO, "residual")}


def check_types(model: Any, optimizer: Any) -> None:
    """``ValueError`` naming the fix for a model or optimizer that hsdp checkpoints cannot handle."""
    if not isinstance(model, ShardedModel):
        raise ValueError(f"checkpoints hold ShardedModels, got {type(model).__name__}: wrap the model with "
                         f"hsdp.ShardedModel first (for a plain module, export to safetensors and load that)")
    if optimizer is not None:
        if not isinstance(optimizer, ShardedOptimizer):
            raise ValueError(f"expected a ShardedOptimizer, got {type(optimizer).__name__}: wrap it with "
                             f"hsdp.ShardedOptimizer(model, optimizer)")
        if optimizer._hsdp_model is not model:
            raise ValueError("the optimizer belongs to another ShardedModel: pass the model it was built on")


def save_state(model: ShardedModel, optimizer: ShardedOptimizer | None) -> dict[str, Any]:
    state: dict[str, Any] = {MODEL: model.state_dict()}
    if optimizer is not None:
        state[OPTIM] = optimizer.state_dict()
    return state


def param_by_name(model: ShardedModel) -> dict[str, ShardedParam]:
    """Every name a sharded parameter is registered under (tied ones have several) -> the parameter."""
    return {slot.fqn: p for p in model.sharded_params() for slot in p.slots}


def tied_aliases(model: ShardedModel) -> dict[str, str]:
    """Second and later names of tied parameters -> the first name (the one optimizer state uses)."""
    return {slot.fqn: p.fqn for p in model.sharded_params() for slot in p.slots[1:]}


def optimizer_kind(optimizer: ShardedOptimizer) -> str:
    """The wrapped optimizer's class, e.g. ``torch.optim.adamw.AdamW``."""
    base = next(c for c in type(optimizer).__mro__
                if issubclass(c, torch.optim.Optimizer) and not issubclass(c, ShardedOptimizer))
    return f"{base.__module__}.{base.__qualname__}"


def sharded_param_of(path: tuple, shape: tuple[int, ...], params: dict[str, ShardedParam]) -> ShardedParam | None:
    """The parameter an optimizer entry is sharded like: per-parameter state of the parameter's shape."""
    if len(path) < 3 or tuple(path[:2]) not in PER_PARAM:
        return None
    p = params.get(str(path[2]))
    if p is None or not shape or tuple(shape) != p.layout.dtensor_shape:
        return None
    return p


def live_groups(optimizer: ShardedOptimizer) -> list[tuple[set[str], list[str]]]:
    """(hyper-parameter names, parameter names) of each live parameter group."""
    names = {id(p.sharded): p.fqn for p in optimizer._hsdp_model.sharded_params()}
    return [({k for k in g if k != "params"}, [names[id(p)] for p in g["params"]]) for g in optimizer.param_groups]


def live_state_names(optimizer: ShardedOptimizer) -> dict[str, set[str]]:
    """Names of the state entries the live optimizer holds per parameter (empty before its first step)."""
    names = {id(p.sharded): p.fqn for p in optimizer._hsdp_model.sharded_params()}
    return {names[id(p)]: set(s) for p, s in optimizer.state.items() if id(p) in names and s}
