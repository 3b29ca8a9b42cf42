"""DiLoCo in the plan (``hsdp plan --diloco-every H``): per layout, the inner step, the sync step and their mean.

Under ``ShardedModel(replica_sync=hsdp.DiLoCo(every=H))`` (``hsdp/engine/replica_sync.py``):

  inner step  the layout's step without the inter-node hop (``TrainOptions(inter_node_hop=False)``): the
              reduce-scatter inside the node is the gradient's last reduction. What still crosses nodes is the
              shard groups' traffic when they span nodes (nothing for shard groups inside a node);
  sync        after every H-th inner step, on the training thread, overlapping nothing: per unit with parameters
              one all-reduce over the replicate group of the rank's flat shard (``UnitSpec.slot``: padding and
              frozen parameters included) in the wire dtype, back to back on the group's FIFO; then the outer step
              over the rank's elements, costed at the inner optimizer's seconds per element (the pseudo-gradient,
              a Nesterov SGD step and the copy back are a few element-wise passes, as AdamW's are), plus the host
              time per byte sent (CPU ranks);
  mean step   inner + sync / H, and tokens/s from it.

Streaming DiLoCo (``fragments=F, delay=tau``): the units with parameters are split into F contiguous fragments of
about equal parameter count (the engine's rule, :func:`split_fragments`), each synced once every H steps at its
own step. With ``delay`` 0 that step waits for the fragment's all-reduces; with ``delay`` tau they run behind the
next tau inner steps and the landing step waits only for what is left, ``max(0, transfer - tau x inner step)``
(the link and the group are assumed free meanwhile: with shard groups spanning nodes they are not, and the
overlap is optimistic). The outer step over the fragment's elements runs on the landing step. The sync step shown
is the slowest such step; the mean adds every fragment's cost once per H steps.

Inter-node bytes of the busiest node per step: the inner step's plus one sync's over H. With shard groups inside a
node (S replicate rings, each leaving every node once) a sync sends ``2(R-1)/R x P x w``, the model in the wire
dtype ``w``: ``2(R-1)/R x P x w / H`` per step, against plain HSDP's ``2(R-1)/R x P x b`` every step. The int8
wire (``DiLoCo(wire_dtype=torch.int8)``, error feedback) sends int8 blocks with one fp32 scale per 256, ``w = 1 +
4/256``: at R = 2 an all-gather of both replicas' blocks, from R = 3 a reduce-scatter and an all-gather in int8
(``Int8ErrorFeedbackHop(two_stage=True)``), ``2(R-1)/R x P x (1 + 4/256)`` per sync either way, about a quarter
of fp32's. Memory per
rank: the layout's without the optimizer sharded across replicas (DiLoCo refuses it) plus the global copy (fp32,
4 B per flat-shard element) and the outer momentum (4 B more when the outer optimizer has momentum).

Not DDP's math: the replicas drift apart for H steps and the update is the outer optimizer's, so the plan says
nothing about the loss at equal tokens (measure that: ``benchmarks/diloco_slow_links.py``).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace

from hsdp.tools.planner.cluster import ClusterSpec
from hsdp.tools.planner.comm import collective_seconds, group_links, link_seconds, node_bytes, rank_split_bytes
from hsdp.tools.planner.cost import StepEstimate, estimate_step
from hsdp.tools.planner.estimate import LayoutEstimate
from hsdp.tools.planner.memory import estimate_memory
from hsdp.tools.planner.model import ComputeProfile, ModelSpec, UnitSpec
from hsdp.tools.planner.options import TrainOptions
from hsdp.tools.planner.tensor_parallel import local_model

# Bytes per element of the sync's buffer: DiLoCo(wire_dtype=None) is fp32, torch.bfloat16 halves it, torch.int8
# sends one byte per element and one fp32 scale per block of 256 (see sync_collective).
WIRE_BYTES = {"fp32": 4.0, "bf16": 2.0, "int8": 1.0 + 4.0 / 256}
GLOBAL_COPY_BYTES = 4  # the fp32 global copy per flat-shard element
MOMENTUM_BYTES = 4  # the outer SGD's momentum buffer per element (0 without momentum)


@dataclass(frozen=True)
class DiLoCoOptions:
    """``every``: H, inner steps per sync; ``wire_dtype``: the pseudo-gradient's dtype across nodes (``fp32``,
    ``bf16`` or ``int8``); ``outer_momentum``: whether the outer optimizer keeps a momentum buffer (memory only);
    ``fragments``, ``delay``: Streaming DiLoCo's F and tau (``hsdp.DiLoCo``'s, with its rules)."""

    every: int
    wire_dtype: str = "fp32"
    outer_momentum: bool = True
    fragments: int = 1
    delay: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise ValueError(f"--diloco-every {self.every!r}: give the inner steps between syncs, an integer >= 1 "
                             f"(the DiLoCo paper uses 500, torchft 40)")
        if self.wire_dtype not in WIRE_BYTES:
            raise ValueError(f"--diloco-wire-dtype {self.wire_dtype!r}: choose one of {sorted(WIRE_BYTES)}")
        if not 1 <= self.fragments <= self.every:
            raise ValueError(f"--diloco-fragments {self.fragments}: each fragment syncs at its own step of the "
                             f"{self.every}: use 1 to {self.every} (--diloco-every)")
        if not 0 <= self.delay < self.every:
            raise ValueError(f"--diloco-delay {self.delay}: a fragment's update must land before its next sync: use "
                             f"0 to {self.every - 1} (--diloco-every - 1)")

    @property
    def wire_bytes(self) -> float:
        return WIRE_BYTES[self.wire_dtype]

    def sync_collective(self, elements: float, replicas: int) -> tuple[str, float]:
        """The collective that syncs ``elements`` of a rank's flat shard over ``replicas`` and its buffer's bytes:
        an all-reduce in the wire dtype, or (int8, 2 replicas) an all-gather of both replicas' blocks and scales
        (from 3 replicas int8 is a reduce-scatter and an all-gather: an all-reduce's bytes and steps)."""
        if self.wire_dtype == "int8" and replicas <= 2:
            return "all_gather", replicas * elements * self.wire_bytes
        return "all_reduce", elements * self.wire_bytes

    @property
    def state_bytes(self) -> int:
        """Bytes per flat-shard element DiLoCo adds on every rank: the global copy and the outer momentum."""
        return GLOBAL_COPY_BYTES + (MOMENTUM_BYTES if self.outer_momentum else 0)


@dataclass(frozen=True)
class SyncCost:
    """One fragment's sync on one rank (the whole model's with one fragment): ``comm_s`` its all-reduces take
    back to back, ``link_s`` of them the busiest node's inter-node link is busy, ``node_bytes`` that node sends to
    other nodes, ``rank_inter_bytes`` an average rank sends to other nodes, ``outer_s`` the outer step and the
    host's time per byte sent (what no overlap hides)."""

    comm_s: float
    link_s: float
    node_bytes: float
    rank_inter_bytes: float
    outer_s: float = 0.0

    @property
    def seconds(self) -> float:
        """What the sync adds to the step that waits for it at once (``delay`` 0)."""
        return self.comm_s + self.outer_s

    def wait_s(self, delay: int, inner_step_s: float) -> float:
        """What it adds to its landing step when its all-reduces run behind ``delay`` inner steps."""
        return max(0.0, self.comm_s - delay * inner_step_s) + self.outer_s


@dataclass(frozen=True)
class DiLoCoEstimate:
    """One layout under DiLoCo next to its plain estimate (``plain``, the variant the plan uses)."""

    plain: LayoutEstimate
    inner: StepEstimate
    syncs: tuple[SyncCost, ...]  # one per fragment, each once every H steps
    every: int
    delay: int
    state_bytes: float  # model state per rank, DiLoCo's global copy and momentum included
    memory_total: float
    fits: bool
    tokens_per_step: float

    @property
    def waits(self) -> list[float]:
        """What each fragment's sync adds to the step that lands it."""
        return [s.wait_s(self.delay, self.inner.step_s) for s in self.syncs]

    @property
    def sync_step_s(self) -> float:
        """The slowest step: an inner step, then the largest fragment's wait and outer step (with one fragment
        and no delay: the H-th step, the whole sync)."""
        return self.inner.step_s + max(self.waits)

    @property
    def mean_step_s(self) -> float:
        return self.inner.step_s + sum(self.waits) / self.every

    @property
    def exposed_comm_s(self) -> float:
        """Per mean step: the inner step's exposed communication plus the syncs' waits (their share)."""
        return self.inner.exposed_comm_s + sum(self.waits) / self.every

    @property
    def sync_bytes(self) -> float:
        """Bytes the busiest node sends to other nodes for one sync of every fragment (the model, once per H)."""
        return sum(s.node_bytes for s in self.syncs)

    @property
    def sync_link_s(self) -> float:
        """The largest fragment's time on the busiest node's inter-node link."""
        return max(s.link_s for s in self.syncs)

    @property
    def inter_node_bytes(self) -> float:
        """Bytes the busiest node sends to other nodes per step, the syncs amortized over H."""
        return self.inner.inter_node_bytes + self.sync_bytes / self.every

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.mean_step_s

    @property
    def speedup(self) -> float:
        """Tokens/s against the plain layout's (not a statement about the loss)."""
        return self.tokens_per_s / self.plain.tokens_per_s

    def as_dict(self) -> dict[str, object]:
        layout = self.plain.layout
        return {"replicate": layout.replicate, "shard": layout.shard, "tensor_parallel": layout.tp,
                "every": self.every, "fragments": len(self.syncs), "delay": self.delay,
                "inner_step_s": self.inner.step_s, "fragment_waits_s": self.waits, "sync_link_s": self.sync_link_s,
                "sync_step_s": self.sync_step_s, "mean_step_s": self.mean_step_s, "exposed_comm_s": self.exposed_comm_s,
                "inter_node_bytes_per_sync": self.sync_bytes,
                "inter_node_bytes_per_fragment": [s.node_bytes for s in self.syncs],
                "inter_node_bytes_per_step": self.inter_node_bytes, "state_bytes": self.state_bytes,
                "memory_total_bytes": self.memory_total, "fits": self.fits, "tokens_per_s": self.tokens_per_s,
                "plain_step_s": self.plain.step.step_s, "plain_inter_node_bytes_per_step":
                    self.plain.step.inter_node_bytes, "plain_tokens_per_s": self.plain.tokens_per_s,
                "speedup": self.speedup}


def split_fragments(sizes: list[int], count: int) -> list[range]:
    """``count`` contiguous, non-empty runs of the indices of ``sizes`` with about equal sums, as the engine cuts
    the units into fragments (``hsdp/engine/optim/outer_step.py``): cut ``k`` where the running sum is nearest
    ``k / count`` of the total."""
    total, cuts = sum(sizes), [0]
    running = list(itertools.accumulate(sizes))
    for k in range(1, count):
        candidates = range(cuts[-1] + 1, len(sizes) - (count - k) + 1)  # leave one unit for each later run
        cuts.append(min(candidates, key=lambda i: abs(running[i - 1] - k * total / count)))
    cuts.append(len(sizes))
    return [range(a, b) for a, b in itertools.pairwise(cuts)]


def sync_costs(model: ModelSpec, cluster: ClusterSpec, shard: int, diloco: DiLoCoOptions,
               profile: ComputeProfile | None = None, tp: int = 1) -> tuple[SyncCost, ...]:
    """Each fragment's sync on layout ``(shard, tp)``: its all-reduces (one per unit with parameters) and its outer
    step. ``ValueError`` when there are more fragments than units with parameters."""
    units = [u for u in local_model(model, tp).units if u.numel]
    if diloco.fragments > len(units):
        raise ValueError(f"--diloco-fragments {diloco.fragments}: {model.name} has {len(units)} units with "
                         f"parameters and each fragment needs one: use at most {len(units)}")
    # Cut by the units' full parameter counts, as the engine does (the same at any degree).
    full = [u.numel for u in model.units if u.numel]
    return tuple(_sync_cost([units[i] for i in run], cluster, shard, diloco, profile, tp)
                 for run in split_fragments(full, diloco.fragments))


def _sync_cost(units: list[UnitSpec], cluster: ClusterSpec, shard: int, diloco: DiLoCoOptions,
               profile: ComputeProfile | None, tp: int) -> SyncCost:
    links = group_links(cluster, shard, "replicate", tp)
    comm = link_s = node = intra = inter = 0.0
    for u in units:
        op, nbytes = diloco.sync_collective(u.slot(shard), links.size)
        comm += collective_seconds(links, cluster, op, nbytes)
        link_s += link_seconds(links, cluster, op, nbytes)
        node += node_bytes(links, cluster, op, nbytes)
        a, b = rank_split_bytes(links, cluster, op, nbytes)
        intra, inter = intra + a, inter + b
    per_element = profile.optimizer_s_per_element if profile is not None else cluster.optimizer_s_per_element
    host = cluster.host_s_per_intra_byte * intra + cluster.host_s_per_inter_byte * inter
    return SyncCost(comm, link_s, node, inter, per_element * sum(u.slot(shard) for u in units) + host)


def estimate_diloco(plain: LayoutEstimate, model: ModelSpec, cluster: ClusterSpec, options: TrainOptions,
                    diloco: DiLoCoOptions, profile: ComputeProfile | None = None,
                    memory_limit: float = math.inf) -> DiLoCoEstimate:
    """Layout ``plain`` under DiLoCo: the inner step (no hop, the optimizer not sharded across replicas, the
    plain layout's micro-batches), one sync, the memory DiLoCo adds (see the module docstring)."""
    layout = plain.layout
    run = replace(options, micro_batches=plain.micro_batches, shard_optimizer_across_replicas=False,
                  inter_node_hop=False)
    inner = estimate_step(model, cluster, layout.shard, run, profile, layout.tp)
    memory = estimate_memory(model, layout.shard, run, profile, layout.replicate, layout.tp)
    extra = diloco.state_bytes * sum(u.slot(layout.shard) for u in local_model(model, layout.tp).units)
    total = memory.total + extra
    return DiLoCoEstimate(plain, inner, sync_costs(model, cluster, layout.shard, diloco, profile, layout.tp),
                          diloco.every, diloco.delay, memory.state + extra, total, total <= memory_limit,
                          plain.global_batch * model.seq_len)


def diloco_estimates(layouts: tuple[LayoutEstimate, ...], model: ModelSpec, cluster: ClusterSpec,
                     options: TrainOptions, diloco: DiLoCoOptions, profile: ComputeProfile | None = None,
                     memory_limit: float = math.inf) -> tuple[DiLoCoEstimate, ...]:
    """Every layout with more than one replica (with one there is nothing to sync) under DiLoCo."""
    return tuple(estimate_diloco(e, model, cluster, options, diloco, profile, memory_limit)
                 for e in layouts if e.layout.replicate > 1)
