"""Checkpoints of a DiLoCo model (``replica_sync=hsdp.DiLoCo``): every replica's state, under its own keys.

Between syncs every replica holds its own weights, and its inner optimizer state differs from the others'
always (DiLoCo never averages it). An ordinary checkpoint holds one copy of each shard (on a grid DCP keeps one
writer per identically named chunk), so it would silently resume every replica from one replica's state. A
DiLoCo checkpoint holds::

    model.<name>                               the global copy, in the parameter's dtype (buffers as always)
    optim.state.<param>.<name>                 replica 0's inner optimizer state (replica 0 writes it; on an
                                               elastic mesh the one replica that saves)
    optim.param_groups.<i>.<name>              the inner hyper-parameters (the same on every replica)
    diloco.global.<param>                      the global copy in fp32, sharded like the parameter
    diloco.outer.<param>.<name>                the outer optimizer's state (momentum), sharded like the parameter
    diloco.outer_scalars.<param>.<name>        its scalars (a step count)
    diloco.phase                               inner steps since the last sync
    diloco.replica.<q>.model.<param>           replica q's weights, for every replica q
    diloco.replica.<q>.optim.state.<param>.<n> replica q's inner optimizer state, for q >= 1
    diloco.replica.<q>.residual.<param>        replica q's int8-wire residuals (``DiLoCo(wire_dtype=torch.int8)``)

(``hsdp/engine/optim/outer_checkpoint.py`` cuts the global copy and outer state into the parameters'
chunks.) Every tensor has the parameter's name and shape, so the checkpoint reshards to any shard degree. The
``model`` and ``optim`` sections are what a model without DiLoCo loads: the global copy's weights and replica
0's inner optimizer state (``hsdp export`` writes the global copy too). Loading into a DiLoCo model:

* a DiLoCo checkpoint of as many replicas: replica q reads its own weights, inner state and int8-wire residuals
  (every replica reads
  its ``diloco.replica.<q>`` entries itself; nothing of it is broadcast), and every replica the global copy,
  outer state and phase: training continues bit for bit;
* a DiLoCo checkpoint of another number of replicas: every replica starts from the global copy with replica 0's
  inner state, the outer state kept and phase 0: the state just after the last sync, the inner steps since
  then dropped (a warning says so); replicas have no identity across replica counts (int8-wire residuals start
  from zero);
* a checkpoint without DiLoCo: every replica loads its weights and inner state; the global copy becomes the
  weights, the phase 0 and the outer momentum starts fresh (``ShardedOptimizer.load_state_dict``).

Without an optimizer (``load_checkpoint(path, model)``) only the ``model`` section is read: the global copy.
"""

from __future__ import annotations

import warnings
from typing import Any

from hsdp.checkpoint.dcp_io import Entry
from hsdp.checkpoint.names import DILOCO, MODEL, OPTIM
from hsdp.engine.model import ShardedModel
from hsdp.engine.optim.outer_checkpoint import (
    RESIDUAL,
    check_savable,
    global_weights,
    outer_state_dict,
    residual_state_dict,
)
from hsdp.engine.optim.sharded_optimizer import ShardedOptimizer

REPLICA = "replica"
SHARED = ("global", "outer", "outer_scalars")  # read by replica 0 and broadcast, like the model's shards


def is_diloco(optimizer: ShardedOptimizer | None) -> bool:
    """Whether ``optimizer`` steps a DiLoCo model (its checkpoints hold this module's layout)."""
    return optimizer is not None and optimizer._hsdp_outer is not None


def check(model: ShardedModel, optimizer: ShardedOptimizer | None) -> None:
    """``ValueError`` naming the fix for a DiLoCo state a checkpoint cannot hold; before any collective."""
    if optimizer is None and model._hsdp_state.replica_sync is not None:
        # The module's weights are this replica's (they differ between syncs): DCP would keep any one replica's.
        raise ValueError("save_checkpoint of a model with replica_sync=DiLoCo needs its ShardedOptimizer: the "
                         "replicas' weights differ between syncs and the global copy lives in the optimizer; pass "
                         "it (the checkpoint's model weights are then the global copy)")
    if is_diloco(optimizer):
        assert optimizer is not None and optimizer._hsdp_outer is not None
        check_savable(optimizer._hsdp_outer)


def save_state(model: ShardedModel, optimizer: ShardedOptimizer) -> dict[str, Any]:
    """This rank's part of a DiLoCo checkpoint (module docstring); views of the live tensors, no copy."""
    outer = optimizer._hsdp_outer
    assert outer is not None
    replica = model.mesh.replicate_rank
    model_sd = model.state_dict()
    mine: dict[str, Any] = {MODEL: {p.fqn: model_sd[p.fqn] for p in model.sharded_params()}}
    weights = global_weights(outer)
    for p in model.sharded_params():
        for slot in p.slots:
            model_sd[slot.fqn] = weights[p.fqn]
    inner = optimizer._named_state_dict()
    # ``optim`` holds the inner state of the lowest replica saving, which a load on another replica count reads:
    # replica 0, or this replica where it saves alone (elastic: the other replicas are other jobs).
    lowest_saving = replica if model.mesh.replicas.outside_world else 0
    if replica == lowest_saving:
        optim = inner
    else:  # the lowest's state sits in ``optim``; the others' must not collide with it
        optim = {k: v for k, v in inner.items() if k != "state"}
        mine[OPTIM] = {"state": inner["state"]}
    residuals = residual_state_dict(outer)
    if residuals:
        mine[RESIDUAL] = residuals
    diloco = {**outer_state_dict(outer), REPLICA: {str(replica): mine}}
    return {MODEL: model_sd, OPTIM: optim, DILOCO: diloco}


def plan_tensors(where: str, found: dict[str, Entry], model: ShardedModel,
                 tensors: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The tensors a DiLoCo model and its optimizer load from a checkpoint (``tensors``: the model and optim
    sections' entries, as ``build_spec`` lists them). Entries only one replica loads, each replica from its own
    keys, carry ``"replica": q`` (see :func:`for_replica`). Runs on rank 0, before anything is read."""
    diloco = {e.path[1:]: e for e in found.values() if e.path[0] == DILOCO}
    if not diloco:
        return tensors  # a checkpoint without DiLoCo: ShardedOptimizer.load_state_dict restarts the outer state
    params = model.sharded_params()
    missing = [p.fqn for p in params if ("global", p.fqn) not in diloco]
    if missing:
        raise ValueError(f"checkpoint {where} holds DiLoCo state without the global copy of {missing[:5]}: it is "
                         f"of another model, or damaged")
    shared = [_json(e, e.path) for path, e in sorted(diloco.items()) if path[0] in SHARED]
    saved = sorted({int(path[1]) for path in diloco if path[0] == REPLICA})
    live = model.mesh.replicate_degree
    if saved != list(range(live)):
        warnings.warn(f"checkpoint {where}: a DiLoCo run of {len(saved)} replica(s) loaded on {live}: every replica "
                      f"starts from the global copy with replica 0's inner optimizer state, phase 0 (the inner steps "
                      f"since the last sync are dropped)", stacklevel=2)
        return tensors + shared
    shared.append(_json(diloco[("phase",)], (DILOCO, "phase")))
    slots = {s.fqn: p.fqn for p in params for s in p.slots}
    kept = []
    for t in tensors:
        path = tuple(t["path"])
        if path[0] == MODEL and path[1] in slots:
            continue  # the global copy: each replica loads its own weights instead
        kept.append({**t, "replica": 0} if path[:2] == (OPTIM, "state") else t)
    return kept + shared + _replica_entries(where, diloco, params, saved)


def _replica_entries(where: str, diloco: dict[tuple, Entry], params: list, replicas: list[int]) -> list[dict]:
    out = []
    for q in replicas:
        for p in params:
            e = diloco.get((REPLICA, str(q), MODEL, p.fqn))
            if e is None or tuple(e.shape) != tuple(p.layout.dtensor_shape):
                raise ValueError(f"checkpoint {where}: replica {q}'s weights of {p.fqn} are missing or of another "
                                 f"shape: it is of another model, or damaged")
            out += [_json(e, (MODEL, slot.fqn), q) for slot in p.slots]
            residual = diloco.get((REPLICA, str(q), RESIDUAL, p.fqn))
            if residual is not None and tuple(residual.shape) == tuple(p.layout.dtensor_shape):
                out.append(_json(residual, (DILOCO, RESIDUAL, p.fqn), q))
        if q > 0:
            out += [_json(e, path[2:], q) for path, e in sorted(diloco.items())
                    if path[:4] == (REPLICA, str(q), OPTIM, "state")]
    return out


def _json(e: Entry, path: tuple, replica: int | None = None) -> dict[str, Any]:
    """A spec entry: read ``e`` (its stored key) into ``path`` of the loaded state."""
    out: dict[str, Any] = {"key": e.key, "path": list(path), "shape": list(e.shape), "dtype": e.dtype}
    if replica is not None:
        out["replica"] = replica
    return out


def for_replica(spec: dict[str, Any], replica: int) -> dict[str, Any]:
    """``spec`` as replica ``replica`` loads it: its own entries and the shared ones."""
    return {**spec, "tensors": [t for t in spec["tensors"] if t.get("replica", replica) == replica]}
