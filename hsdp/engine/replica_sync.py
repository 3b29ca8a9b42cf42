"""How replicas are kept in sync: every step (HSDP's gradient hop, the default) or every H steps (DiLoCo).

``ShardedModel(..., replica_sync=hsdp.DiLoCo(every=H))`` turns the inter-node hop off: inside a replica every
step is ordinary HSDP (the intra-node reduce-scatter averages the replica's ranks, the inner optimizer steps
the shards), and nothing crosses nodes for H - 1 steps. Every H inner steps each rank all-reduces the
*pseudo-gradient* of its shards (the global copy minus its local weights) over the replicate group, an outer
optimizer steps the global copy with the mean pseudo-gradient as its gradient, and the result becomes every
replica's weights (Douillard et al. 2023, DiLoCo). Inter-node bytes: one all-reduce of the model per H steps.

Streaming DiLoCo (Douillard et al. 2025), ``fragments=F, delay=tau, mix=alpha``: the units are split into F
contiguous fragments of about equal size; fragment p syncs every H steps too, but at its own offset
((p + 1) * H // F within the H steps), so the link carries 1/F of the model at a time (peak bandwidth / F).
Its all-reduce is started asynchronously after the inner step that reaches the offset and waited ``delay``
inner steps later, just before the outer update is applied: the transfer overlaps those steps' compute, and no
step waits on the link unless the transfer takes longer than ``delay`` steps. The update then lands on weights
that trained ``delay`` more steps than the pseudo-gradient saw: they become ``mix * local + (1 - mix) *
global`` (``mix=0``, the default: the global copy replaces them, those steps' local progress on that fragment is
dropped, as in the paper's alpha = 0). ``fragments=1, delay=0`` is DiLoCo.

This is not DDP's math: replicas drift apart for H steps, and the update is the outer optimizer's. With H = 1,
outer lr 1, no outer momentum and an inner SGD it equals plain HSDP (the update is linear in the gradients).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from hsdp.engine.hops import NoHop
from hsdp.engine.replicate.combinations import Feature, refused


@dataclass(frozen=True)
class DiLoCo:
    """``every``: inner steps between syncs (H); ``outer_lr``, ``outer_momentum``: the outer optimizer,
    ``torch.optim.SGD(lr=outer_lr, momentum=outer_momentum, nesterov=outer_momentum > 0)`` unless
    ``outer_optimizer`` (a callable taking the global copies, returning a torch optimizer) is given;
    ``wire_dtype``: the pseudo-gradient's dtype across nodes (``None``: fp32, the global copy's; ``torch.bfloat16``
    halves the bytes; ``torch.int8`` quantises per block of 256 with one fp32 scale and error feedback, the
    rounding error of a sync added to the unit's next, about a quarter of fp32's bytes with two replicas:
    ``optim/outer_wire.py``);
    ``fragments``: Streaming DiLoCo's F, the units split into F fragments synced at staggered steps (at most
    the number of units with parameters, and at most ``every``); ``delay``: tau, inner steps between starting a
    fragment's all-reduce and applying its outer update (0: at once, blocking; ``< every``, so a fragment's
    update lands before its next sync; ``<= every // fragments`` keeps one fragment in flight at a time, which an
    elastic mesh requires);
    ``mix``: the share of its own weights a replica keeps when an update lands (alpha; 0 replaces them)."""

    every: int = 40
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    fragments: int = 1
    wire_dtype: torch.dtype | None = None
    outer_optimizer: Callable[[Iterable[torch.Tensor]], torch.optim.Optimizer] | None = None
    delay: int = 0
    mix: float = 0.0

    def __post_init__(self) -> None:
        if not _is_int(self.every) or self.every < 1:
            raise ValueError(f"DiLoCo(every={self.every!r}): the inner steps between syncs must be an int >= 1 "
                             f"(1 syncs every step; the paper uses 500, torchft 40)")
        if not self.outer_lr > 0 or not 0 <= self.outer_momentum < 1:
            raise ValueError(f"DiLoCo(outer_lr={self.outer_lr}, outer_momentum={self.outer_momentum}): need "
                             f"outer_lr > 0 and 0 <= outer_momentum < 1 (the paper: 0.7 and 0.9)")
        if not _is_int(self.fragments) or self.fragments < 1:
            raise ValueError(f"DiLoCo(fragments={self.fragments!r}) must be an int >= 1")
        if self.fragments > self.every:
            raise ValueError(f"DiLoCo(every={self.every}, fragments={self.fragments}): each fragment syncs at its "
                             f"own step of the {self.every}, so fragments must be <= every: raise every or "
                             f"lower fragments")
        if not _is_int(self.delay) or not 0 <= self.delay < self.every:
            raise ValueError(f"DiLoCo(delay={self.delay!r}, every={self.every}): the outer update is applied "
                             f"delay inner steps after its all-reduce starts and must land before the "
                             f"fragment's next sync: use an int with 0 <= delay < every (0 waits at once; "
                             f"delay < every / fragments keeps one fragment in flight)")
        if isinstance(self.mix, bool) or not isinstance(self.mix, (int, float)) or not 0 <= self.mix < 1:
            raise ValueError(f"DiLoCo(mix={self.mix!r}): the share of the local weights kept when an outer "
                             f"update lands must be a float with 0 <= mix < 1 (0 replaces them by the global "
                             f"copy)")
        if self.wire_dtype is not None and not (isinstance(self.wire_dtype, torch.dtype)
                                                 and (self.wire_dtype.is_floating_point
                                                      or self.wire_dtype == torch.int8)):
            raise ValueError(f"DiLoCo(wire_dtype={self.wire_dtype!r}) takes a floating torch dtype (e.g. "
                             f"torch.bfloat16), torch.int8 (quantised with error feedback) or None for fp32")

    def offset(self, fragment: int) -> int:
        """The phase (inner steps mod ``every``) after which ``fragment`` starts its sync: staggered by
        ``every / fragments``, the last fragment at phase 0 (with one fragment: every H-th step, DiLoCo's)."""
        return (fragment + 1) * self.every // self.fragments % self.every

    def make_outer(self, params: list[torch.Tensor]) -> torch.optim.Optimizer:
        """The outer optimizer over the global copies."""
        if self.outer_optimizer is not None:
            return self.outer_optimizer(params)
        return torch.optim.SGD(params, lr=self.outer_lr, momentum=self.outer_momentum,
                               nesterov=self.outer_momentum > 0)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_replica_sync(sync: object, hop: object, sliced: bool, mesh: object,
                       buffers: bool = False) -> object | None:
    """The per-step hop for ``sync`` (``hsdp.engine.hops.NoHop`` under DiLoCo, else ``hop``), refusing what DiLoCo
    does not combine with: before any collective. ``buffers``: the model's buffers are broadcast every step
    (running statistics)."""
    if sync is None:
        return hop
    if not isinstance(sync, DiLoCo):
        raise ValueError(f"replica_sync takes hsdp.DiLoCo(every=H, ...) or None, got {sync!r}")
    if hop is not None:
        raise ValueError("replica_sync=DiLoCo sends no per-step inter-node hop, so replica_hop has nothing to do: "
                         "drop replica_hop (DiLoCo(wire_dtype=torch.bfloat16) halves the sync's bytes, "
                         "torch.int8 quarters them)")
    if sliced and refused(Feature.DILOCO, Feature.SLICED_OPTIMIZER):
        raise ValueError("replica_sync=DiLoCo keeps a whole optimizer state per replica (each replica steps on its "
                         "own): turn shard_optimizer_across_replicas off")
    if getattr(mesh, "elastic", None) is not None:
        # An elastic sync is a transaction of the replicas present (optim/outer_transaction.py), of any shard
        # degrees (its pseudo-gradients reduced piece by piece, a joiner's outer state re-cut: outer_heal.py).
        if sync.delay * sync.fragments > sync.every:
            # The layer has one transaction open at a time, so a fragment's sync must land before the next one
            # starts: then nothing but the sync under way is in flight when a joiner is healed (optim/outer_plan.py).
            raise ValueError(f"Streaming DiLoCo (every={sync.every}, fragments={sync.fragments}, delay={sync.delay}) "
                             f"on an elastic mesh keeps one fragment's sync in flight at a time, so a fragment's "
                             f"update must land before the next fragment starts: use delay <= every // fragments "
                             f"({sync.every // sync.fragments}) there")
        if buffers:
            raise ValueError("replica_sync=DiLoCo on an elastic mesh with buffers broadcast every step (running "
                             "statistics: BatchNorm) is not supported yet: pass broadcast_buffers=False, or use a "
                             "model without running statistics (LayerNorm)")
    return NoHop()
