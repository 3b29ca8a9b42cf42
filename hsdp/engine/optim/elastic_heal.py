"""Healing a replica that joins an elastic job from a live peer, and the optimizer step as a transaction.

A joining replica's rank receives, from the same shard rank of the quorum's ``source`` replica, over the new
epoch's replicate group: every unit's flat shard (the parameters), the buffers, the optimizer's state of its
shards and its param groups' hyperparameters (a scheduled learning rate included), and hsdp's step counters.
Across replicas of different shard degrees the rows are re-cut on the way (``runtime/piece_broadcast.py``): the
flat shards and the optimizer's shard-shaped state piece by piece over the holder groups, each from the source's
holder of those rows (``state_rows.py``), the rest (buffers, scalars, hyperparameters) over the position
groups, so the source may be a replica of any degree. No checkpoint is read; a stateful hop's residuals start
from zero (``runtime/hop_transaction.py``). Under DiLoCo also the global copy, the outer optimizer's state and the
phase (``outer_transaction.py``; ``outer_heal.py``, re-cut the same way). All of it goes point to point from the
source's ranks to the joiners' only: the other members hold it already (but for the weights of DiLoCo's members
mid-phase, which are their own), and a broadcast over the replicate group would send it to them too (gloo's root
sends to every rank), doubling a heal's bytes at three replicas. They take part in the buffers' broadcast alone.
The heal runs where the step's quorum is first needed: the joiner's ``ShardedOptimizer`` construction, the
members' first inter-node collective of that step (``elastic/layer.py``). What the optimizer state does not
hold (the user's LR scheduler, data loader, RNG) is the loop's to restore from ``model.last_step``.

:func:`elastic_step` gates ``ShardedOptimizer.step``: the step is applied only when the coordinator committed
it (every member's inter-node reduction completed); otherwise the gradients are dropped and nothing changes (a
stateful hop's residuals go back to what they were before the step).
"""

from __future__ import annotations

import io
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.tensor import DTensor

from hsdp.engine.optim.outer_heal import heal_outer
from hsdp.engine.optim.state_rows import ROWS, Cut, Entry, exchange_rows, take_rows
from hsdp.engine.replicate.elastic.protocol import Quorum
from hsdp.engine.runtime.hop_transaction import reset_hops, restore_hops
from hsdp.engine.runtime.piece_broadcast import broadcast_bytes_whole, broadcast_rows, broadcast_whole
from hsdp.engine.runtime.reduction import slot_offsets

if TYPE_CHECKING:
    from hsdp.engine.model import ShardedModel


def attach_heal(model: ShardedModel, optimizer: torch.optim.Optimizer) -> None:
    """Register the heal of ``model`` + ``optimizer`` with the mesh's replicate layer (``ReplicateLayer.attach``:
    an elastic layer runs it whenever replicas join, a joiner before its first forward; a fixed one never)."""
    layer = model.mesh.replicas

    def heal(quorum: Quorum) -> None:
        assert quorum.source is not None
        source, joiners = quorum.index(quorum.source), tuple(quorum.index(j) for j in quorum.joiners)
        joining, sending = layer.index in quorum.joiners, layer.index == quorum.source
        comm = model.comm
        with torch.no_grad():
            # Every member takes the source's buffers (a heal re-syncs them, whatever buffers.py's policy).
            model._hsdp_state.buffers.broadcast(lambda flat: broadcast_whole(comm, flat, source))
        if not (joining or sending):
            return  # it holds the state already: the source sends to the joiners only (module docstring)
        data, rows = _send_state(model, optimizer, source, joiners, joining)
        if joining:
            _load_optimizer_payload(optimizer, data, rows)
            reset_hops(model._hsdp_state.units)  # its own rounding errors: none yet (hop_transaction.py)

    layer.attach(heal)


@torch.no_grad()
def _send_state(model: ShardedModel, optimizer: torch.optim.Optimizer, source: int, joiners: tuple[int, ...],
                joining: bool) -> tuple[bytes, dict[Entry, torch.Tensor]]:
    """Member ``source``'s weights, optimizer state and (DiLoCo) outer state sent to the members ``joiners``,
    point to point; on the source and the joiners only. The optimizer's bytes and, across replicas of different
    degrees, its shard-shaped tensors received row by row (empty on the source)."""
    comm, apart = model.comm, not model.mesh.replicas.regular  # apart: shard-shaped state crosses row by row
    for unit in model._hsdp_state.units:
        if unit.params:
            broadcast_rows(comm, unit.sharded_flat, [p.layout for p in unit.params], slot_offsets(unit.params),
                           source, joiners)
    data = broadcast_bytes_whole(comm, None if joining else _optimizer_payload(optimizer, apart), source, joiners)
    rows: dict[Entry, torch.Tensor] = {}
    if apart:
        received = _decode(data)
        cuts: dict[int, Cut] = {id(sp.sharded): [(sp.layout, 0)] for sp in model.sharded_params()}
        rows = exchange_rows(comm, optimizer, cuts, received["optimizer"]["state"],
                             [tuple(e) for e in received[ROWS]], source, joining, joiners)
    outer = optimizer._hsdp_outer  # type: ignore[attr-defined]
    if outer is not None:  # DiLoCo: the global copy, the outer state, the phase (outer_transaction.py)
        heal_outer(outer, comm, source, joining, joiners)
    return data, rows


def finish_step(model: ShardedModel) -> bool:
    """Before ``ShardedOptimizer.step`` applies anything: the replicate layer's decision (elastic: vote and wait
    for the coordinator's), and on an abort drop every gradient; True when the step is to be applied."""
    committed = model.mesh.replicas.finish_step()
    if not committed:
        for p in model.parameters():
            p.grad = None
        restore_hops(model._hsdp_state.step.hop_snapshot)  # the residuals of a step never applied: as before it
    return committed


def _optimizer_payload(optimizer: torch.optim.Optimizer, apart: bool = False) -> bytes:
    """The optimizer's state of this rank's shards (DTensors as their local tensors), in torch's index layout
    (every member's parameters are in the same order), and hsdp's step counter. ``apart``: the shard-shaped
    tensors are left out, listed under ``rows`` (``state_rows.py``: they cross piece by piece)."""
    state = torch.optim.Optimizer.state_dict(optimizer)
    state["state"] = {i: {k: v.to_local() if isinstance(v, DTensor) else v for k, v in entry.items()}
                      for i, entry in state["state"].items()}
    payload: dict[str, Any] = {"optimizer": state, "steps": optimizer._hsdp_steps}  # type: ignore[attr-defined]
    if apart:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        payload[ROWS] = [list(e) for e in take_rows(state["state"], params)]
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    return buffer.getvalue()


def _decode(data: bytes) -> dict[str, Any]:
    return torch.load(io.BytesIO(data), weights_only=True)


def _load_optimizer_payload(optimizer: torch.optim.Optimizer, data: bytes,
                            rows: dict[Entry, torch.Tensor] | None = None) -> None:
    payload = _decode(data)
    state = payload["optimizer"]
    for (i, k), v in (rows or {}).items():  # received row by row (replicas of different degrees)
        state["state"][i][k] = v
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for i, entry in state["state"].items():
        p = params[i]
        for k, v in entry.items():
            if isinstance(p, DTensor) and v.shape == p.to_local().shape and v.dim() > 0:
                entry[k] = DTensor.from_local(v, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                              stride=p.stride())
    torch.optim.Optimizer.load_state_dict(optimizer, state)
    object.__setattr__(optimizer, "_hsdp_steps", payload["steps"])
