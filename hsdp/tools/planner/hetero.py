"""Heterogeneous clusters: node types of different GPUs (``hsdp plan --nodes 2x8:h100,2x8:a100-40gb``).

Per node type (``COUNTxGPUS:GPU``, ranks numbered node-major in the order given, as ``hsdp launch
--nproc-per-node 8,8,4,4`` and torchrun do), the plan proposes:

* the **shard degree by memory**: the smallest degree ``S`` whose peak memory per rank (:mod:`memory`, at the
  larger of the even and the weighted per-rank batch, so both splits fit on the same mesh) stays under the
  GPU's memory less the headroom. Candidates are the divisors of the ranks per node (an 8-GPU node of 80 GB
  may hold two replicas of 4), then whole nodes of that type (``k x GPUs`` with ``k`` dividing its count);
  the mesh is ``hsdp.init_mesh(sharding_degree=[...])``, one degree per replica in rank order;
* **batch weights by speed**: per rank, the GPU's dense bf16 peak over the slowest type's (rounded to three
  significant digits, what the user pastes). The global batch per micro-batch stays the even split's,
  ``micro_batch x world`` sequences, cut by ``hsdp.distributed_sampler``'s largest remainder; a rank left
  without a sequence is refused, naming the ``--micro-batch`` that avoids it;
* the **tokens/s** of that weighted split against the even one: each type's step from the cost model
  (:mod:`cost`) at its ranks' batch (the largest, after rounding), the cluster paced by its slowest type.

Trade-offs: weights follow peak FLOP/s, so a type that is memory- or link-bound at its batch is weighted too
high (``hsdp tune`` measures the ranks instead); each type's step is estimated as a cluster of its own GPUs
with about the whole cluster's rank count, so the inter-node hop spans about all replicas (the replicate
layer reduces each piece of a heterogeneous mesh once: the all-reduce floor); the optimizer is not sharded
across replicas and there is no tensor parallelism. Pure Python, like the rest of the planner.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import Any

from hsdp.tools.planner.cluster import ClusterSpec
from hsdp.tools.planner.cost import estimate_step
from hsdp.tools.planner.memory import MemoryEstimate, estimate_memory
from hsdp.tools.planner.model import ModelSpec
from hsdp.tools.planner.options import TrainOptions
from hsdp.tools.planner.presets import GPU, OPTIMIZER_BYTES_PER_ELEMENT, gpu, gpu_key, gpu_names, intra_link

NODES_SPELLING = "COUNTxGPUS:GPU[,COUNTxGPUS:GPU...], e.g. 2x8:h100,2x8:a100-40gb"
_GROUP = re.compile(r"^(\d+)x(\d+)(?::([A-Za-z0-9._-]+))?$")


@dataclass(frozen=True)
class NodeGroup:
    """``count`` nodes of ``gpus_per_node`` GPUs of the preset ``gpu`` (its canonical name)."""

    count: int
    gpus_per_node: int
    gpu: str

    @property
    def ranks(self) -> int:
        return self.count * self.gpus_per_node

    @property
    def label(self) -> str:
        return f"{self.count}x{self.gpus_per_node}:{self.gpu}"

    @property
    def spec(self) -> GPU:
        return gpu(self.gpu)


def is_node_list(text: str) -> bool:
    """Whether ``--nodes`` is written as node types (``2x8:h100``) rather than a plain count (``16``)."""
    return not text.strip().isdigit()


def parse_node_groups(text: str, default_gpu: str = "h100") -> list[NodeGroup]:
    """``"2x8:h100,2x8:a100-40gb"`` as node groups; a group without ``:GPU`` takes ``default_gpu``.
    ``ValueError`` naming the spelling for a malformed group, a zero count and an unknown GPU preset."""
    groups = []
    for part in (p.strip() for p in text.split(",")):
        match = _GROUP.match(part.lower())
        if not match:
            raise ValueError(f"--nodes {text!r}: {part!r} is not a node type; write {NODES_SPELLING} "
                             f"(or a plain node count with --gpus-per-node and --gpu)")
        count, per_node = int(match.group(1)), int(match.group(2))
        if count < 1 or per_node < 1:
            raise ValueError(f"--nodes {text!r}: {part!r} has {count} nodes of {per_node} GPUs; both must be at "
                             f"least 1 (drop a node type that has none)")
        try:
            key = gpu_key(match.group(3) or default_gpu)
        except ValueError:
            raise ValueError(f"--nodes {text!r}: {part!r}: unknown GPU {match.group(3) or default_gpu!r}: use one "
                             f"of {gpu_names()}") from None
        groups.append(NodeGroup(count, per_node, key))
    return groups


@dataclass(frozen=True)
class SplitEstimate:
    """One node type under one split: its ranks' batch (the largest, after rounding), the smallest shard degree
    that fits it, that degree's peak memory per rank and step time."""

    batch: int  # sequences per rank per micro-batch
    shard: int
    memory: MemoryEstimate
    fits: bool
    step_s: float

    def as_dict(self) -> dict[str, Any]:
        return {"batch": self.batch, "sharding_degree": self.shard, "memory_bytes": self.memory.as_dict(),
                "fits": self.fits, "step_s": self.step_s}


@dataclass(frozen=True)
class TypePlan:
    """One node type: its weight per rank (relative to the slowest type's, 1) and both splits, each on its
    own smallest fitting shard degree."""

    group: NodeGroup
    weight: float
    memory_limit: float
    even: SplitEstimate
    weighted: SplitEstimate

    @property
    def shard(self) -> int:
        """The degree the plan proposes: the weighted split's."""
        return self.weighted.shard

    @property
    def replicas(self) -> int:
        return self.group.ranks // self.shard

    def as_dict(self) -> dict[str, Any]:
        g = self.group
        return {"nodes": g.count, "gpus_per_node": g.gpus_per_node, "gpu": g.gpu, "ranks": g.ranks,
                "weight": self.weight, "memory_limit_bytes": self.memory_limit, "sharding_degree": self.shard,
                "replicas": self.replicas, "even": self.even.as_dict(), "weighted": self.weighted.as_dict()}


@dataclass(frozen=True)
class HeteroPlan:
    """The whole cluster: per type (in rank order), the per-rank weights and batch sizes of the weighted split,
    and the tokens/s of both splits of the same global batch."""

    model: ModelSpec
    options: TrainOptions
    types: tuple[TypePlan, ...]
    rank_weights: tuple[float, ...]
    batch_sizes: tuple[int, ...]  # per rank, per micro-batch, weighted split

    @property
    def world_size(self) -> int:
        return len(self.rank_weights)

    @property
    def global_batch(self) -> int:
        """Sequences per micro-batch over all ranks (the sampler's ``batch_size``)."""
        return sum(self.batch_sizes)

    @property
    def sharding_degrees(self) -> list[int]:
        """One degree per replica, in rank order: ``hsdp.init_mesh(sharding_degree=...)``."""
        return [t.shard for t in self.types for _ in range(t.replicas)]

    @property
    def fits(self) -> bool:
        """Whether every type fits its weighted batch (what the printed lines run)."""
        return all(t.weighted.fits for t in self.types)

    @property
    def even_fits(self) -> bool:
        return all(t.even.fits for t in self.types)

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.options.micro_batches * self.model.seq_len

    @property
    def even_step_s(self) -> float:
        return max(t.even.step_s for t in self.types)

    @property
    def weighted_step_s(self) -> float:
        return max(t.weighted.step_s for t in self.types)

    @property
    def even_tokens_per_s(self) -> float:
        return self.tokens_per_step / self.even_step_s

    @property
    def weighted_tokens_per_s(self) -> float:
        return self.tokens_per_step / self.weighted_step_s

    @property
    def speedup(self) -> float:
        return self.even_step_s / self.weighted_step_s

    def pacing(self, weighted: bool) -> TypePlan:
        """The node type whose step sets the pace of the even (or weighted) split."""
        return max(self.types, key=lambda t: (t.weighted if weighted else t.even).step_s)

    def as_dict(self) -> dict[str, Any]:
        return {"model": {"name": self.model.name, "params": self.model.params, "seq_len": self.model.seq_len,
                          "micro_batch": self.model.micro_batch},
                "micro_batches": self.options.micro_batches, "world_size": self.world_size,
                "node_types": [t.as_dict() for t in self.types], "fits": self.fits, "even_fits": self.even_fits,
                "sharding_degree": self.sharding_degrees, "batch_weights": list(self.rank_weights),
                "batch_sizes": list(self.batch_sizes), "global_batch": self.global_batch,
                "even": {"step_s": self.even_step_s, "tokens_per_s": self.even_tokens_per_s,
                         "paced_by": self.pacing(False).group.label},
                "weighted": {"step_s": self.weighted_step_s, "tokens_per_s": self.weighted_tokens_per_s,
                             "paced_by": self.pacing(True).group.label},
                "speedup": self.speedup}


def speed_weights(groups: list[NodeGroup]) -> list[float]:
    """Per rank (rank order): its GPU's dense peak over the slowest type's, to three significant digits."""
    slowest = min(g.spec.peak_flops for g in groups)
    return [float(f"{g.spec.peak_flops / slowest:.3g}") for g in groups for _ in range(g.ranks)]


def split_sizes(weights: list[float], batch: int) -> list[int]:
    """``batch`` sequences split proportionally to ``weights`` by largest remainder, ties to the lower rank:
    the rule of ``hsdp.data.weighted_sampler.split_sizes`` (the owner; it imports torch, which ``hsdp plan``
    does not; a test holds the two equal), with the weights read as the decimals they print as."""
    exact = [Fraction(str(w)) for w in weights]
    quotas = [batch * w / sum(exact) for w in exact]
    sizes = [math.floor(q) for q in quotas]
    by_remainder = sorted(range(len(exact)), key=lambda r: (-(quotas[r] - sizes[r]), r))
    for r in by_remainder[:batch - sum(sizes)]:
        sizes[r] += 1
    return sizes


def weighted_split(weights: list[float], micro_batch: int) -> list[int]:
    """The sampler's split of ``micro_batch x len(weights)`` sequences; ``ValueError`` naming the
    ``--micro-batch`` that gives every rank one when this one does not."""
    world = len(weights)
    sizes = split_sizes(weights, micro_batch * world)
    if min(sizes) < 1:
        # The lightest rank's quota reaches 1 by sum / min sequences at the latest.
        bound = math.ceil(sum(map(Fraction, map(str, weights))) / Fraction(str(min(weights))))
        need = next(m for m in range(micro_batch + 1, bound + 1) if min(split_sizes(weights, m * world)) >= 1)
        raise ValueError(f"--micro-batch {micro_batch}: a global batch of {micro_batch * world} sequences split "
                         f"by weights {sorted(set(weights))} leaves some rank without a sequence: pass "
                         f"--micro-batch {need} or more (sequences per rank per micro-batch of the even split)")
    return sizes


def at_micro_batch(model: ModelSpec, micro_batch: int) -> ModelSpec:
    """``model`` with ``micro_batch`` sequences per rank: compute and activations scale with the tokens."""
    scale = micro_batch / model.micro_batch
    return replace(model, micro_batch=micro_batch, activation_elements=model.activation_elements * scale,
                   checkpoint_elements=model.checkpoint_elements * scale,
                   root_activation_elements=model.root_activation_elements * scale)


def candidate_degrees(group: NodeGroup) -> list[int]:
    """Shard degrees of one type, smallest first: divisors of its ranks per node, then whole nodes of it."""
    n = group.gpus_per_node
    inside = [d for d in range(1, n + 1) if n % d == 0]
    return inside + [k * n for k in range(2, group.count + 1) if group.count % k == 0]


def type_cluster(group: NodeGroup, world: int, shard: int, inter_bandwidth: float, inter_latency: float,
                 mfu: float) -> ClusterSpec:
    """The cluster one type's step is estimated on: its own GPUs and links, about ``world`` ranks in whole
    replicas (so the inter-node hop spans about every replica of the real cluster)."""
    g, n = group.spec, group.gpus_per_node
    span = max(1, shard // n)  # nodes per replica
    nodes = max(span, round(world / n))
    nodes += -nodes % span
    link = intra_link(g.intra_link)
    return ClusterSpec(nodes, n, g.memory, link.bandwidth, inter_bandwidth, g.peak_flops * mfu,
                       intra_latency=link.latency, inter_latency=inter_latency,
                       optimizer_s_per_element=OPTIMIZER_BYTES_PER_ELEMENT / g.hbm_bandwidth, name=group.gpu)


def _split(model: ModelSpec, group: NodeGroup, options: TrainOptions, batch: int, limit: float,
           cluster_of: Callable[[int], ClusterSpec]) -> SplitEstimate:
    """The smallest degree of ``group`` that fits ``batch`` sequences per rank (the largest one when none does)."""
    spec = at_micro_batch(model, batch)
    estimates = [(s, estimate_memory(spec, s, options)) for s in candidate_degrees(group)]
    fitting = [(s, m) for s, m in estimates if m.total <= limit]
    shard, memory = fitting[0] if fitting else estimates[-1]
    return SplitEstimate(batch, shard, memory, bool(fitting),
                         estimate_step(spec, cluster_of(shard), shard, options).step_s)


def _plan_type(model: ModelSpec, group: NodeGroup, options: TrainOptions, weight: float, sizes: list[int],
               world: int, links: tuple[float, float], mfu: float, headroom: float) -> TypePlan:
    limit = group.spec.memory * (1 - headroom)

    def cluster_of(shard: int) -> ClusterSpec:
        return type_cluster(group, world, shard, *links, mfu)

    return TypePlan(group, weight, limit, _split(model, group, options, model.micro_batch, limit, cluster_of),
                    _split(model, group, options, max(sizes), limit, cluster_of))


def make_hetero_plan(model: ModelSpec, groups: list[NodeGroup], options: TrainOptions, inter_bandwidth: float,
                     inter_latency: float = 10e-6, mfu: float = 0.45, headroom: float = 0.10) -> HeteroPlan:
    """Plan ``groups`` (rank order) for ``model`` at ``model.micro_batch`` sequences per rank per micro-batch
    (the even split; the weighted split cuts the same global batch). ``inter_bandwidth``: bytes/s per node,
    each direction, for every type; ``mfu``: the achieved fraction of each GPU's peak. ``ValueError`` for an
    empty list, the optimizer sharded across replicas, ``headroom`` outside [0, 1) or a ``--micro-batch``
    that leaves a rank of the weighted split empty."""
    if not groups:
        raise ValueError(f"no node types: write {NODES_SPELLING}")
    if not 0 <= headroom < 1:
        raise ValueError(f"headroom={headroom} must be in [0, 1): the fraction of GPU memory kept free")
    if options.shard_optimizer_across_replicas:
        # The engine runs it (runtime/piece_slice.py), but each type's degree is chosen here on its own, and the
        # slices' size depends on every type's choice (the replica count): not estimated yet.
        raise ValueError("a heterogeneous plan does not estimate the optimizer sharded across replicas yet (each "
                         "type's degree is chosen alone, the slices depend on the replica count): pass "
                         "--shard-optimizer-across-replicas off (or auto)")
    weights = speed_weights(groups)
    sizes = weighted_split(weights, model.micro_batch)
    world, types, start = len(weights), [], 0
    for g in groups:
        mine = slice(start, start + g.ranks)
        types.append(_plan_type(model, g, options, weights[start], sizes[mine], world,
                                (inter_bandwidth, inter_latency), mfu, headroom))
        start += g.ranks
    return HeteroPlan(model, options, tuple(types), tuple(weights), tuple(sizes))
