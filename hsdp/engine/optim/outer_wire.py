"""DiLoCo's int8 wire: pseudo-gradients quantised with error feedback (``DiLoCo(wire_dtype=torch.int8)``).

PRIME's int8 all-reduce for DiLoCo: at each sync a rank adds its *residual* (what quantisation lost of its
pseudo-gradient at the unit's previous sync) to the pseudo-gradient, quantises the sum in blocks of
``BLOCK`` values with one fp32 scale each, and keeps the new rounding error as the residual for the next sync; the
replicas all-gather the int8 blocks and scales, and every replica dequantises and averages them in fp32, so all
apply the same outer gradient. The quantisation is the int8 hop's (``hops.Int8ErrorFeedbackHop``: this module
drives one instance per ``OuterState``, keyed by unit, so its code does the work and its residuals are DiLoCo's).
A unit belongs to one fragment, so under Streaming DiLoCo each fragment carries its own residuals from one of its
syncs to the next. From 3 replicas the average is a reduce-scatter then an all-gather, both in int8 (the hop's
``two_stage``: each replica averages a chunk of blocks in fp32 and quantises that mean once more, without feedback,
before the all-gather; issued when the sync lands, ``delay`` inner steps later, which hides its time). Bytes a rank
sends per sync: ``2(R-1)/R x n x (1 + 4 / BLOCK)`` for ``n`` elements (with 2 replicas the hop's all-gather,
``(R-1) x n x (1 + 4 / BLOCK)``, as many bytes and one rounding), against ``2(R-1)/R x n x 4`` for fp32: about a
quarter, whatever R.

Across replicas of different shard degrees the pseudo-gradient crosses bucket by bucket of pieces
(``runtime/piece_hop.py``): the hop keys each bucket's residual apart (``piece_hop.bucket_key``), so every element
keeps one residual. Under batch weights the quantised value is the weighted pseudo-gradient ``W_r x delta_r`` (what
crosses the wire); the weight itself rides in the tail, exact in fp32 (the hop's flags path).

The residuals are per-rank state, like the replica's weights: a DiLoCo checkpoint keeps them per replica
(``diloco.replica.<q>.residual.<param>``, ``hsdp/checkpoint/diloco.py``), laid out as each rank's chunk of its
parameters (:func:`residual_flat` / :func:`set_residual_flat` map them to the flat-shard layout). Whatever restarts
DiLoCo's outer state (a load of weights without DiLoCo's state, another replica count) starts them from zero.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from hsdp.engine.hops import Int8ErrorFeedbackHop
from hsdp.engine.replica_sync import DiLoCo
from hsdp.engine.runtime.piece_hop import bucket_key, flat_from_buckets, state_segments

if TYPE_CHECKING:
    from hsdp.engine.runtime.piece_plan import PiecePlan
    from hsdp.engine.runtime.unit import ShardUnit

BLOCK = 256  # values per fp32 scale: the int8 hop's default (PRIME's granularity)


def wire_hop(policy: DiLoCo) -> Int8ErrorFeedbackHop | None:
    """The int8 wire's hop (it holds the residuals) for ``policy``; ``None`` for a float wire."""
    return Int8ErrorFeedbackHop(BLOCK, two_stage=True) if policy.wire_dtype == torch.int8 else None


def wire_key(unit: ShardUnit) -> str:
    """The key a unit's pseudo-gradient is sent under: its profiler label and the residual's name in the hop."""
    return f"{unit.name} pseudo-gradient"


def residual_flat(hop: Int8ErrorFeedbackHop, unit: ShardUnit, plan: PiecePlan | None) -> torch.Tensor | None:
    """This rank's residual of ``unit`` laid out like its flat shard (``None`` before its first sync); ``plan``:
    the unit's piece plan across replicas of different degrees (``None`` on a grid: one residual per unit)."""
    key = wire_key(unit)
    if plan is None:
        return hop.residuals.get(key)
    buckets = [(hop.residuals.get(bucket_key(key, holders)), segments) for holders, segments in state_segments(plan)]
    return flat_from_buckets(buckets, unit.sharded_flat.numel(), unit.sharded_flat.device)


def set_residual_flat(hop: Int8ErrorFeedbackHop, unit: ShardUnit, plan: PiecePlan | None,
                      flat: torch.Tensor) -> None:
    """The inverse of :func:`residual_flat`: the unit's residual (or its buckets') cut from ``flat``."""
    key = wire_key(unit)
    if plan is None:
        hop.residuals[key] = flat
        return
    for holders, segments in state_segments(plan):
        if segments:
            hop.residuals[bucket_key(key, holders)] = torch.cat([flat[o: o + n] for o, n in segments])
