"""Memory per rank of one layout: model state (what ``hsdp.state_bytes`` reports) plus what training adds.

State (persistent, per rank, ``S`` = shard degree):
  * parameters: the unit's padded flat shard, ``sum ceil(rows/S) * row_numel`` elements per unit;
  * gradients: the same elements of trainable parameters (rank 0 holds full chunks: the largest rank);
  * optimizer: ``optimizer_bytes`` per trainable element plus a scalar ``step`` per tensor (AdamW);
  * master: a separate master copy when the precision keeps one (hsdp's fp32 shards *are* the master).
  With 16 bytes per parameter that is ``16 P / S``: 16P for DDP (S=1), 16P/N for full sharding (S=N).
  With ``shard_optimizer_across_replicas`` and R replicas, gradients, optimizer state and master copy
  cover only the rank's 1/R slice of its chunks (``UnitSpec.slice_slot``): AdamW in fp32 goes from
  16P/S to 4P/S + 12P/(R x S).

Transient (peak during backward):
  * unsharded: the root unit (never resharded between forward and backward) with its gradient, the
    units prefetch keeps gathered (at most two besides the root) and one unit's gradient plus its
    reduce-scatter buffer; with ``reshard_after_forward=False`` every unit stays gathered until its backward;
  * accumulation: between micro-batches, fp32 reduce-scattered partial sums (``sync="deferred"``, P/S) or
    fp32 unsharded gradient sums (``sync="local"``, P);
  * activations: the model's estimate (or the measured profile) at the compute dtype;
  * with the optimizer sharded across replicas, two more: during backward one unit's replica-packed
    reduce buffer (R slices of the unit, in the reduce dtype, plus a copy in the hop dtype when it
    differs); after the optimizer step the all-gathers that refresh the shards, queued in forward order with
    two in flight (``hsdp/engine/runtime/slice_gather.py``): (R + 1) x slice of the two largest units in the
    parameter dtype, about two units' shards. That peak is early in the forward, before activations build
    up, so the total is the state plus the larger of it and the backward peak.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from hsdp.tools.planner.model import ComputeProfile, ModelSpec, UnitSpec
from hsdp.tools.planner.options import TrainOptions
from hsdp.tools.planner.tensor_parallel import local_model, local_profile

OPTIMIZER_STEP_BYTES = 4  # AdamW keeps `step` as a float32 scalar tensor per parameter
PREFETCHED_UNITS = 2  # the runtime's limit of non-root units gathered at once
SLICE_GATHERS_IN_FLIGHT = 2  # the runtime's limit of post-step slice all-gathers (replica-sharded optimizer)


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
    refresh: float = 0.0  # replica-sharded optimizer: the post-step all-gather buffers (a separate peak)

    @property
    def state(self) -> float:
        return self.params + self.grads + self.optimizer + self.master

    @property
    def total(self) -> float:
        return self.state + max(self.unsharded + self.accumulation + self.activations, self.refresh)

    @property
    def after_step(self) -> float:
        """What the post-step refresh adds to the peak beyond the backward transients (0 when they are larger):
        stacked on the others, the parts add up to :attr:`total`."""
        return max(0.0, self.refresh - self.unsharded - self.accumulation - self.activations)

    def as_dict(self) -> dict[str, float]:
        return {**asdict(self), "state": self.state, "total": self.total}


def full_elements(unit: UnitSpec, shard: int) -> int:
    """Elements of a unit once gathered: ``S`` padded slots (the all-gather output)."""
    return shard * unit.slot(shard)


def stepped_elements(unit: UnitSpec, shard: int, replicate: int, options: TrainOptions) -> int:
    """Elements of ``unit`` whose gradient and optimizer state the largest rank holds: its chunk, or with
    the optimizer sharded across replicas its 1/R slice of the chunk."""
    if options.shards_optimizer(replicate):
        return unit.slice_slot(shard, replicate)
    return unit.trainable_slot(shard)


def state_memory(model: ModelSpec, shard: int, options: TrainOptions,
                 replicate: int = 1) -> tuple[float, float, float, float]:
    """(params, grads, optimizer, master) bytes on the largest rank."""
    p = options.precision
    slot = sum(u.slot(shard) for u in model.units)
    trainable = sum(stepped_elements(u, shard, replicate, options) for u in model.units)
    tensors = sum(u.tensors for u in model.units)
    return (slot * p.param_bytes, trainable * p.grad_bytes,
            trainable * p.optimizer_bytes + tensors * OPTIMIZER_STEP_BYTES, trainable * p.master_bytes)


def unsharded_memory(model: ModelSpec, shard: int, options: TrainOptions, replicate: int = 1) -> float:
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
    return root * 2 * c + live * c + largest * (c + r) + packed_reduce_memory(model, shard, options, replicate)


def packed_reduce_memory(model: ModelSpec, shard: int, options: TrainOptions, replicate: int) -> float:
    """Replica-sharded optimizer: the largest unit's reduce-scatter input across replicas, R slices (about
    one chunk) in the reduce dtype, plus its copy in the hop dtype when that differs; 0 without it."""
    if not options.shards_optimizer(replicate):
        return 0.0
    r = options.precision.reduce_bytes
    wire = options.replicate_bytes if options.replicate_bytes != r else 0.0
    packed = max(replicate * (u.slice_slot(shard, replicate) + u.tensors) for u in model.units)
    return packed * (r + wire)


def refresh_memory(model: ModelSpec, shard: int, options: TrainOptions, replicate: int) -> float:
    """Replica-sharded optimizer: the all-gathers across replicas after the step (each its own slice and the R
    slices received, in the parameter dtype), at most ``SLICE_GATHERS_IN_FLIGHT`` at once: the largest ones
    bound it; 0 without it."""
    if not options.shards_optimizer(replicate):
        return 0.0
    sizes = sorted(((replicate + 1) * u.slice_slot(shard, replicate) for u in model.units), reverse=True)
    return sum(sizes[:SLICE_GATHERS_IN_FLIGHT]) * options.precision.param_bytes


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
                    profile: ComputeProfile | None = None, replicate: int = 1, tp: int = 1) -> MemoryEstimate:
    """Peak bytes per rank for sharding degree ``shard``; the replicate degree ``replicate`` matters only
    with ``options.shard_optimizer_across_replicas``. With tensor parallel degree ``tp`` every formula
    above applies to the TP-local model (:func:`hsdp.tools.planner.tensor_parallel.local_model`: block
    state, gathered blocks and activations / T, the root whole unless it is TP'd)."""
    if tp > 1:
        model, profile = local_model(model, tp), local_profile(profile, model, tp)
    params, grads, optimizer, master = state_memory(model, shard, options, replicate)
    return MemoryEstimate(params, grads, optimizer, master, unsharded_memory(model, shard, options, replicate),
                          accumulation_memory(model, shard, options), activation_memory(model, options, profile),
                          refresh_memory(model, shard, options, replicate))
