"""DiLoCo's outer step (``replica_sync.py``): the global copy, the pseudo-gradient all-reduce, the outer update.

The global copy is one fp32 flat per unit, laid out like the unit's flat shard (each rank holds its own shard of
it, never a full copy), and the outer optimizer's state (its momentum) is sharded the same way. After every
H-th inner step (``ShardedOptimizer.step``): pseudo-gradient = global - local, all-reduced (average) over the
replicate group in the wire dtype, set as the global copy's gradient; the outer optimizer steps; the global copy
is copied into the shards. Padding rows are zero on every replica, so they stay zero.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from hsdp.engine.replica_sync import DiLoCo

if TYPE_CHECKING:
    from hsdp.engine.model import ShardedModel


class OuterState:
    """The global copy and outer optimizer of one model under DiLoCo."""

    def __init__(self, model: ShardedModel, policy: DiLoCo) -> None:
        self.model, self.policy = model, policy
        self.units = [u for u in model._hsdp_state.units if u.params]
        self.global_copy = [u.sharded_flat.detach().float().clone() for u in self.units]
        self.outer = policy.make_outer(self.global_copy)
        self.inner_steps = 0  # since the last sync (the phase)

    def after_inner_step(self) -> bool:
        """Count one inner step; sync replicas when it is the H-th. True when it synced."""
        self.inner_steps += 1
        if self.inner_steps < self.policy.every:
            return False
        self.inner_steps = 0
        self.sync()
        return True

    @torch.no_grad()
    def sync(self) -> None:
        comm, wire = self.model.comm, self.policy.wire_dtype
        for unit, global_copy in zip(self.units, self.global_copy, strict=True):
            delta = global_copy - unit.sharded_flat.float()
            sent = delta if wire is None else delta.to(wire)
            comm.all_reduce(sent, "replicate", op=dist.ReduceOp.AVG, label=f"{unit.name} pseudo-gradient")
            global_copy.grad = sent.float() if sent is not delta else delta
        self.outer.step()
        self.outer.zero_grad(set_to_none=True)
        for unit, global_copy in zip(self.units, self.global_copy, strict=True):
            unit.sharded_flat.copy_(global_copy)
