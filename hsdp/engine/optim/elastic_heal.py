"""Healing a replica that joins an elastic job from a live peer, and the optimizer step as a transaction.

A joining replica's rank receives, from the same shard rank of the quorum's ``source`` replica, over the new
epoch's replicate group: every unit's flat shard (the parameters), the buffers, the optimizer's state of its
shards and its param groups' hyperparameters (a scheduled learning rate included), and hsdp's step counters. No
checkpoint is read; a stateful hop's residuals start from zero (``runtime/hop_transaction.py``). Under DiLoCo
also the global copy, the outer optimizer's state and the phase (``outer_transaction.py``). The other members
take part in the same broadcasts (their values are already equal, but for the weights of DiLoCo's members
mid-phase, which they receive into scratch and drop). The heal runs where the step's
quorum is first needed: the joiner's ``ShardedOptimizer`` construction, the members' first inter-node
collective of that step (``elastic/layer.py``). What the optimizer state does not hold (the user's LR
scheduler, data loader, RNG) is the loop's to restore from ``model.last_step``.

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
from hsdp.engine.replicate.elastic.protocol import Quorum
from hsdp.engine.runtime.hop_transaction import reset_hops, restore_hops

if TYPE_CHECKING:
    from hsdp.engine.model import ShardedModel


def attach_heal(model: ShardedModel, optimizer: torch.optim.Optimizer) -> None:
    """Register the heal of ``model`` + ``optimizer`` with the mesh's replicate layer (``ReplicateLayer.attach``:
    an elastic layer runs it whenever replicas join, a joiner before its first forward; a fixed one never)."""
    layer = model.mesh.replicas

    def heal(quorum: Quorum) -> None:
        assert quorum.source is not None
        source = quorum.index(quorum.source)
        joining, sending = layer.index in quorum.joiners, layer.index == quorum.source
        comm = model.comm
        outer = optimizer._hsdp_outer  # type: ignore[attr-defined]
        with torch.no_grad():
            for unit in model._hsdp_state.units:
                if unit.params:
                    # Only a joiner takes the weights: under DiLoCo the other members' differ mid-phase.
                    into = unit.sharded_flat if joining or sending else torch.empty_like(unit.sharded_flat)
                    comm.broadcast(into, source, "replicate")
            model._hsdp_state.buffers.broadcast(lambda flat: comm.broadcast(flat, source, "replicate"))
            payload = _optimizer_payload(optimizer) if sending else None
            data = comm.broadcast_bytes(payload, source, "replicate")
            if outer is not None:  # DiLoCo: the global copy, the outer state, the phase (outer_transaction.py)
                heal_outer(outer, comm, source, sending, joining)
        if joining:
            _load_optimizer_payload(optimizer, data)
            reset_hops(model._hsdp_state.units)  # its own rounding errors: none yet (hop_transaction.py)

    layer.attach(heal)


def finish_step(model: ShardedModel) -> bool:
    """Before ``ShardedOptimizer.step`` applies anything: the replicate layer's decision (elastic: vote and wait
    for the coordinator's), and on an abort drop every gradient; True when the step is to be applied."""
    committed = model.mesh.replicas.finish_step()
    if not committed:
        for p in model.parameters():
            p.grad = None
        restore_hops(model._hsdp_state.step.hop_snapshot)  # the residuals of a step never applied: as before it
    return committed


def _optimizer_payload(optimizer: torch.optim.Optimizer) -> bytes:
    """The optimizer's state of this rank's shards (DTensors as their local tensors), in torch's index layout
    (every member's parameters are in the same order), and hsdp's step counter."""
    state = torch.optim.Optimizer.state_dict(optimizer)
    state["state"] = {i: {k: v.to_local() if isinstance(v, DTensor) else v for k, v in entry.items()}
                      for i, entry in state["state"].items()}
    buffer = io.BytesIO()
    torch.save({"optimizer": state, "steps": optimizer._hsdp_steps}, buffer)  # type: ignore[attr-defined]
    return buffer.getvalue()


def _load_optimizer_payload(optimizer: torch.optim.Optimizer, data: bytes) -> None:
    payload: dict[str, Any] = torch.load(io.BytesIO(data), weights_only=True)
    state = payload["optimizer"]
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for i, entry in state["state"].items():
        p = params[i]
        for k, v in entry.items():
            if isinstance(p, DTensor) and v.shape == p.to_local().shape and v.dim() > 0:
                entry[k] = DTensor.from_local(v, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                              stride=p.stride())
    torch.optim.Optimizer.load_state_dict(optimizer, state)
    object.__setattr__(optimizer, "_hsdp_steps", payload["steps"])
