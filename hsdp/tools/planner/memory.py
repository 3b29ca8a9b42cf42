"""Memory per rank of one layout: model state (what ``hsdp.state_bytes`` reports) plus what training adds.

State (persistent, per rank, ``S`` = shard degree):
  * parameters: the unit's padded flat shard, ``sum ceil(rows/S) * row_numel`` elements per unit;
  * gradients: the same elements of trainable parameters (rank 0 holds full chunks: the largest rank);
  * optimizer: ``optimizer_bytes`` per trainable element plus a scalar ``step`` per tensor (AdamW);
  * master: a separate master copy when the precision keeps one (hsdp's fp32 shards *are* the master).
  With 16 bytes per parameter that is ``16 P / S``: 16P for DDP (S=1), 16P/N for full sharding (S=N).

Transient (peak during backward):
  * unsharded: the root unit (never resharded between forward and backward) with its gradient, the
    units prefetch keeps gathered (at most two besides the root) and one unit's gradient plus its
    reduce-scatter buffer; with ``reshard_after_forward=False`` every unit stays gathered until its backward;
  * accumulation: between micro-batches, fp32 reduce-scattered partial sums (``sync="deferred"``, P/S) or
    fp32 unsharded gradient sums (``sync="local"``, P);
  * activations: the model's estimate (or the measured profile) at the compute dtype.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from hsdp.tools.planner.model import ComputeProfile, ModelSpec, UnitSpec
from hsdp.tools.planner.options import TrainOptions

OPTIMIZER_STEP_BYTES = 4  # AdamW keeps `step` as a float32 scalar tensor per parameter
PREFETCHED_UNITS = 2  # the runtime's limit of non-root units gathered at once


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes on one rank, by kind. ``state`` is comparable to ``hsdp.state_bytes(model, optimizer).total``."""

    params: float
    grads: float
    optimizer: float
    master: float
    unsharded: float
    accumulation: float
    activations: float

    @property
    def state(self) -> float:
        return self.params + self.grads + self.optimizer + self.master

    @property
    def total(self) -> float:
        return self.state + self.unsharded + self.accumulation + self.activations

    def as_dict(self) -> dict[str, float]:
        return {**asdict(self), "state": self.state, "total": self.total}


def full_elements(unit: UnitSpec, shard: int) -> int:
    """Elements of a unit once gathered: ``S`` padded slots (the all-gather output)."""
    return shard * unit.slot(shard)


def state_memory(model: ModelSpec, shard: int, options: TrainOptions) -> tuple[float, float, float, float]:
    """(params, grads, optimizer, master) bytes on the largest rank."""
    p = options.precision
    slot = sum(u.slot(shard) for u in model.units)
    trainable = sum(u.trainable_slot(shard) for u in model.units)
    tensors = sum(u.tensors for u in model.units)
    return (slot * p.param_bytes, trainable * p.grad_bytes,
            trainable * p.optimizer_bytes + tensors * OPTIMIZER_STEP_BYTES, trainable * p.master_bytes)


def unsharded_memory(model: ModelSpec, shard: int, options: TrainOptions) -> float:
    """Peak bytes of gathered parameters, their gradients and reduce buffers during backward."""
    c, r = options.precision.compute_bytes, options.precision.reduce_bytes
    root = full_elements(model.root, shard)
    blocks = [full_elements(u, shard) for u in model.blocks] or [0]
    largest = max(blocks)
    if options.reshard_after_forward:
        live = min(len(model.blocks), PREFETCHED_UNITS if options.prefetch else 1) * largest
    else:
        live = sum(blocks)  # gathered in forward, freed only after each unit's backward
    # Root params + root grads (reduced only at the end of backward) + live blocks + one block's gradient
    # and its reduce-scatter input.
    return root * 2 * c + live * c + largest * (c + r)


def accumulation_memory(model: ModelSpec, shard: int, options: TrainOptions) -> float:
    if options.micro_batches == 1 or options.sync == "every":
        return 0.0
    if options.sync == "local":
        return 4.0 * sum(full_elements(u, shard) for u in model.units)
    return 4.0 * sum(u.trainable_slot(shard) + u.tensors for u in model.units)


def activation_memory(model: ModelSpec, options: TrainOptions, profile: ComputeProfile | None = None) -> float:
    if profile is not None and profile.activation_bytes is not None:
        return profile.activation_bytes
    c = options.precision.compute_bytes
    if not options.activation_checkpointing:
        return model.activation_elements * c
    # Kept: each unit's input; during one unit's recomputation, that unit's full activations.
    per_unit = (model.activation_elements - model.checkpoint_elements) / max(1, len(model.blocks))
    return (model.checkpoint_elements + per_unit) * c


def estimate_memory(model: ModelSpec, shard: int, options: TrainOptions,
                    profile: ComputeProfile | None = None) -> MemoryEstimate:
    """Peak bytes per rank for sharding degree ``shard`` (the replicate degree does not change memory)."""
    params, grads, optimizer, master = state_memory(model, shard, options)
    return MemoryEstimate(params, grads, optimizer, master, unsharded_memory(model, shard, options),
                          accumulation_memory(model, shard, options), activation_memory(model, options, profile))
