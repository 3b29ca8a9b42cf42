"""One layout's estimate: what ``make_plan`` computes per candidate and the renderers and reasons read."""

from __future__ import annotations

from dataclasses import dataclass

from hsdp.tools.planner.cost import StepEstimate
from hsdp.tools.planner.memory import MemoryEstimate
from hsdp.tools.planner.options import Layout


@dataclass(frozen=True)
class LayoutEstimate:
    """One layout's predicted memory per rank and step; ``tokens_per_s`` is for the whole cluster."""

    layout: Layout
    kind: str
    memory: MemoryEstimate
    step: StepEstimate
    fits: bool
    tokens_per_s: float
    shard_optimizer: bool = False  # shard_optimizer_across_replicas in effect (R > 1)
    micro_batches: int = 1  # per data-parallel rank and step: T x the plan's at T > 1 (global batch held)
    global_batch: int = 0  # sequences per optimizer step over all R x S data-parallel ranks

    @property
    def optimizer_shards(self) -> int:
        """How many ranks split the optimizer state: S, or R x S with the option."""
        return self.layout.world_size if self.shard_optimizer else self.layout.shard

    def as_dict(self) -> dict[str, object]:
        return {"replicate": self.layout.replicate, "shard": self.layout.shard, "tensor_parallel": self.layout.tp,
                "kind": self.kind, "micro_batches": self.micro_batches, "global_batch": self.global_batch,
                "shard_optimizer_across_replicas": self.shard_optimizer, "fits": self.fits,
                "tokens_per_s": self.tokens_per_s, "memory_bytes": self.memory.as_dict(), "step": self.step.as_dict()}
