"""A stateful inter-node hop's state under a replicate layer that discards steps (elastic): the step as a
transaction.

The int8 hop's residuals are what each replica failed to send (``hops.py``): they belong to the replica and are
only right if they follow the steps that were applied. So, where the layer is ``transactional``:

- at each training forward (``begin_step``) the runtime snapshots every stateful hop's state;
- when the step is discarded (a member left mid-step: ``finish_step`` returns False) the snapshot is put back,
  so the residuals are as they were before the step, as the weights and the optimizer state are;
- a replica that joins (healed from a live member) starts with zero residuals: the rounding error of steps it
  never sent is not its own, and a live member's would be another replica's error counted twice.

The snapshot keeps references, not copies: a hop *replaces* the tensors of its state at each hop (see
``ReplicaHop.state_dict``), never writes into them. A key the discarded step added (a hop's first) is put back
as zeros, which is no residual.
"""

from __future__ import annotations

import torch

from hsdp.engine.hops import ReplicaHop
from hsdp.engine.runtime.unit import ShardUnit

HopSnapshot = list[tuple[ReplicaHop, dict[str, torch.Tensor]]]


def snapshot_hops(units: list[ShardUnit]) -> HopSnapshot:
    """Every distinct stateful hop of ``units`` with its state as it is now (units usually share one hop)."""
    seen: dict[int, tuple[ReplicaHop, dict[str, torch.Tensor]]] = {}
    for unit in units:
        state = unit.hop.state_dict()
        if state is not None and id(unit.hop) not in seen:
            seen[id(unit.hop)] = (unit.hop, dict(state))
    return list(seen.values())


def restore_hops(snapshot: HopSnapshot) -> None:
    """Put every hop's state back as :func:`snapshot_hops` saw it (keys added since: zeros)."""
    for hop, before in snapshot:
        now = hop.state_dict() or {}
        hop.load_state_dict({**{k: torch.zeros_like(v) for k, v in now.items() if k not in before}, **before})


def reset_hops(units: list[ShardUnit]) -> None:
    """Zero every stateful hop's state (a joining replica's: no rounding error of its own yet)."""
    restore_hops([(hop, {}) for hop, _ in snapshot_hops(units)])
