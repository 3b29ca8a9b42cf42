"""Step time of one layout: compute plus the communication that overlap does not hide.

The estimate replays hsdp's schedule (``hsdp/engine/runtime/state.py``) on three timelines: the training thread
(compute, and waits), the shard group's collectives and the replicate group's collectives, each a FIFO as a
process group is. Per micro-batch:

  forward   the root's all-gather, then for each block: wait for its all-gather, issue the next one
            (prefetch), compute; the root's head last;
  backward  the root (kept gathered) first, issuing the last block's all-gather; per block: wait for its
            all-gather, prefetch the next, compute, issue its reduce-scatter; its inter-node hop is issued
            the moment that reduce-scatter ends, off the training thread (the hop stream on GPUs, the hop
            worker thread on CPUs); at the end the root's reduce-scatter, and a wait for every hop;
  step      the optimizer over this rank's ``P / S`` elements.

With the optimizer sharded across replicas (``shard_optimizer_across_replicas``, R > 1) the hop is a
reduce-scatter across replicas of the replica-packed shard (the hop dtype), the step covers ``P / (R x S)``
elements, and the previous step's all-gathers across replicas of the stepped slices (parameter dtype) are
issued at the step's start, in forward order: a unit's forward all-gather waits for its refresh (the
runtime's ``settle``), so they overlap the forward rather than block at the end of the step. Inter-node
bytes: ``(R-1)/R x P x (hop bytes + parameter bytes)``, the all-reduce's ``2(R-1)/R x P x b`` when the
two dtypes agree.

When both kinds of group cross nodes (a shard group spans nodes *and* R > 1), their collectives share
each node's link: a collective that needs the link starts only once the other group's transfer has left
it (bandwidth shared in aggregate, the order simplified). CPU time the collectives take from compute on
CPU-only ranks is the cluster's ``host_s_per_*_byte``, which ``hsdp tune`` calibrates.

With tensor parallel degree ``T > 1`` the schedule runs on the TP-local model (block FLOPs and parameters
/ T, :mod:`hsdp.tools.planner.tensor_parallel`), the groups are those of the ``R x S x T`` grid, and each
unit's TP collectives are added to its forward and backward on the training thread: they sit between the
matmuls, so overlap hides none of them (``StepEstimate.tp_comm_s``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from hsdp.tools.planner.cluster import ClusterSpec
from hsdp.tools.planner.comm import (
    GroupLinks,
    collective_seconds,
    group_links,
    link_seconds,
    node_bytes,
    rank_split_bytes,
)
from hsdp.tools.planner.memory import full_elements, stepped_elements
from hsdp.tools.planner.model import ComputeProfile, ModelSpec, UnitSpec
from hsdp.tools.planner.options import TrainOptions
from hsdp.tools.planner.tensor_parallel import (
    check_layout,
    local_model,
    local_profile,
    tp_collective_s,
    tp_collectives,
    tp_rank_bytes,
)


@dataclass(frozen=True)
class Transfer:
    """One collective: its duration, and how much of it holds the inter-node link."""

    seconds: float = 0.0
    link_s: float = 0.0


@dataclass(frozen=True)
class UnitCost:
    """Seconds of one unit per micro-batch: compute and each collective (0 when the group has one rank)."""

    forward: float
    backward: float
    all_gather: Transfer
    reduce_scatter: Transfer
    hop: Transfer
    reduces: bool = True
    refresh: Transfer = Transfer()  # replica-sharded optimizer: the post-step all-gather across replicas
    tp_forward: float = 0.0  # TP collectives inside the forward: on the training thread, never overlapped
    tp_backward: float = 0.0


@dataclass(frozen=True)
class StepEstimate:
    """One optimizer step on one rank. ``exposed_comm_s`` is what overlap did not hide: ``step_s`` minus
    compute and optimizer. Bytes are per step: ``inter_node_bytes`` sent by the busiest node to other
    nodes (what a link counter shows), ``rank_wire_bytes`` sent by one rank over any link and
    ``rank_inter_bytes`` the part of it that leaves the node (an average rank). ``tp_comm_s``: the
    tensor-parallel collectives' seconds, part of ``exposed_comm_s`` (0 at T = 1)."""

    step_s: float
    compute_s: float
    optimizer_s: float
    exposed_comm_s: float
    comm_busy_s: float
    inter_node_bytes: float
    rank_wire_bytes: float
    rank_inter_bytes: float
    collectives: int
    tp_comm_s: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


@dataclass(frozen=True)
class _Links:
    shard: GroupLinks
    replicate: GroupLinks


def _compute_split(model: ModelSpec, cluster: ClusterSpec, profile: ComputeProfile | None) -> list[tuple[float, float]]:
    """(forward, backward) seconds of each unit per micro-batch: FLOPs / rate, or the profile split by FLOPs."""
    flops = [u.forward_flops_per_token * model.tokens for u in model.units]
    total = sum(flops) or 1.0
    if profile is not None:
        return [(profile.forward_s * f / total, profile.backward_s * f / total) for f in flops]
    return [(f / cluster.compute_rate, 2 * f / cluster.compute_rate) for f in flops]


def _replicas(cluster: ClusterSpec, shard: int, tp: int) -> int:
    return cluster.world_size // (shard * tp)


def _hop(links: GroupLinks, cluster: ClusterSpec, u: UnitSpec, shard: int, options: TrainOptions,
         tp: int = 1) -> tuple[str, float]:
    replicas = _replicas(cluster, shard, tp)
    if options.shards_optimizer(replicas):
        # R slices padded alike, each followed by the flags (every replica needs them).
        packed = replicas * (u.slice_slot(shard, replicas) + u.tensors)
        return "replica_reduce_scatter", packed * options.replicate_bytes
    elements = u.trainable_slot(shard) + u.tensors  # the reduced shard plus a "has gradient" flag per tensor
    if options.replicate_dtype == "int8":
        return "all_gather", links.size * elements * options.replicate_bytes
    return "all_reduce", elements * options.replicate_bytes


def _transfer(links: GroupLinks, cluster: ClusterSpec, op: str, nbytes: float) -> Transfer:
    return Transfer(collective_seconds(links, cluster, op, nbytes), link_seconds(links, cluster, op, nbytes))


def _refresh(cluster: ClusterSpec, u: UnitSpec, shard: int, options: TrainOptions,
             tp: int = 1) -> tuple[str, float] | None:
    """The all-gather across replicas of the stepped slices, in the parameter dtype (None: no such step)."""
    replicas = _replicas(cluster, shard, tp)
    if not options.shards_optimizer(replicas) or not u.tensors:
        return None
    return "all_gather", replicas * u.slice_slot(shard, replicas) * options.precision.param_bytes


def _scatter_bytes(u: UnitSpec, shard: int, reduce_bytes: int) -> float:
    return shard * (u.trainable_slot(shard) + u.tensors) * reduce_bytes


def unit_costs(model: ModelSpec, cluster: ClusterSpec, shard: int, options: TrainOptions,
               profile: ComputeProfile | None = None, tp: int = 1) -> list[UnitCost]:
    """Each unit's compute and collectives per micro-batch, on the TP-local model when ``tp > 1``."""
    if tp > 1:
        check_layout(cluster, shard, tp)
        model, profile = local_model(model, tp), local_profile(profile, model, tp)
    return _unit_costs(model, cluster, shard, options, profile, tp)


def _unit_costs(model: ModelSpec, cluster: ClusterSpec, shard: int, options: TrainOptions,
                profile: ComputeProfile | None, tp: int) -> list[UnitCost]:
    """``model`` is already TP-local."""
    links = _Links(group_links(cluster, shard, "shard", tp), group_links(cluster, shard, "replicate", tp))
    p = options.precision
    tp_s = tp_collective_s(model, cluster, options, tp)
    out = []
    for u, (fwd, bwd) in zip(model.units, _compute_split(model, cluster, profile), strict=True):
        if options.activation_checkpointing and u is not model.root:
            bwd += fwd  # the block's forward runs again inside its backward
        # A unit without parameters gathers nothing; one without trainable ones reduces nothing.
        gather = _transfer(links.shard, cluster, "all_gather", full_elements(u, shard) * p.compute_bytes) \
            if u.numel else Transfer()
        scatter = _transfer(links.shard, cluster, "reduce_scatter", _scatter_bytes(u, shard, p.reduce_bytes))
        hop = _transfer(links.replicate, cluster, *_hop(links.replicate, cluster, u, shard, options, tp))
        refresh = _refresh(cluster, u, shard, options, tp)
        tp_fwd, tp_bwd = tp_collectives(model, options, u) if tp > 1 else (0, 0)
        out.append(UnitCost(fwd, bwd, gather, scatter, hop, u.tensors > 0,
                            _transfer(links.replicate, cluster, *refresh) if refresh else Transfer(),
                            tp_fwd * tp_s, tp_bwd * tp_s))
    return out


class _Timeline:
    """The training thread and one FIFO per process group; times in seconds from the step's start."""

    def __init__(self) -> None:
        self.cpu = 0.0
        self.free = {"shard": 0.0, "replicate": 0.0}
        self.link_free = 0.0  # when the inter-node link is next free of the *other* group's transfers
        self.link_group = ""
        self.busy = 0.0

    def issue(self, group: str, t: Transfer, at: float | None = None) -> float:
        """Queue ``t`` on ``group``'s FIFO, issued by the training thread (now) or at time ``at`` by another
        issuer (the hop stream or worker); returns when it ends."""
        start = max(self.free[group], self.cpu if at is None else at)
        if t.link_s > 0:
            if self.link_group != group:
                start = max(start, self.link_free)
            self.link_free, self.link_group = start + t.link_s, group
        self.free[group] = start + t.seconds
        self.busy += t.seconds
        return self.free[group]

    def wait(self, end: float) -> None:
        self.cpu = max(self.cpu, end)


def _forward(tl: _Timeline, costs: list[UnitCost], options: TrainOptions,
             refreshed: dict[int, float] | None = None) -> None:
    """``refreshed``: when each unit's refresh all-gather ends (replica-sharded optimizer, first
    micro-batch): the runtime waits for it on the training thread before gathering the unit."""
    ready = refreshed or {}

    def gather(i: int) -> float:
        tl.wait(ready.get(i, 0.0))
        return tl.issue("shard", costs[i].all_gather)

    gathered: dict[int, float] = {0: gather(0)}
    for i in range(1, len(costs)):
        if i not in gathered:
            gathered[i] = gather(i)
        tl.wait(gathered[i])
        if options.prefetch and i + 1 < len(costs):
            gathered[i + 1] = gather(i + 1)
        tl.cpu += costs[i].forward + costs[i].tp_forward
    tl.cpu += costs[0].forward + costs[0].tp_forward  # the root's head and loss, after the blocks


def _backward(tl: _Timeline, costs: list[UnitCost], options: TrainOptions, micro_batch: int) -> None:
    order = list(range(len(costs) - 1, 0, -1))  # blocks in reverse; the root runs first and stays gathered
    regather = options.reshard_after_forward
    gathered: dict[int, float] = {}
    if regather and options.prefetch and order:
        gathered[order[0]] = tl.issue("shard", costs[order[0]].all_gather)
    tl.cpu += costs[0].backward + costs[0].tp_backward
    hopped: list[float] = []  # when each unit's inter-node hop ends
    sync = options.syncs_replicas(micro_batch)

    def reduce(unit: int) -> None:
        if not costs[unit].reduces:
            return
        scattered = tl.issue("shard", costs[unit].reduce_scatter)
        # Chained behind its own reduce-scatter, off the training thread (hop stream / hop worker).
        hopped.append(tl.issue("replicate", costs[unit].hop, at=scattered) if sync else scattered)

    for j, i in enumerate(order):
        if regather:
            if i not in gathered:
                gathered[i] = tl.issue("shard", costs[i].all_gather)
            tl.wait(gathered[i])
            if options.prefetch and j + 1 < len(order):
                gathered[order[j + 1]] = tl.issue("shard", costs[order[j + 1]].all_gather)
        tl.cpu += costs[i].backward + costs[i].tp_backward
        if options.reduces_shards(micro_batch):
            reduce(i)
    if options.reduces_shards(micro_batch):
        reduce(0)  # the root's gradients: reduced by the end-of-backward callback
        for end in hopped:
            tl.wait(end)


@dataclass(frozen=True)
class _Traffic:
    node: float  # bytes the busiest node sends to other nodes
    rank_intra: float  # bytes an average rank sends inside its node
    rank_inter: float  # ... and to other nodes
    calls: int


def _traffic(model: ModelSpec, cluster: ClusterSpec, shard: int, options: TrainOptions, tp: int = 1) -> _Traffic:
    """Bytes and collective calls of one optimizer step (``model`` TP-local)."""
    sl, rl = group_links(cluster, shard, "shard", tp), group_links(cluster, shard, "replicate", tp)
    p, k = options.precision, options.micro_batches
    node = intra = inter = 0.0
    calls = 0
    syncs = sum(options.syncs_replicas(m) for m in range(k))
    reduces = sum(options.reduces_shards(m) for m in range(k))
    for u in model.units:
        gathers = k * (1 + (options.reshard_after_forward and u is not model.root)) if u.numel else 0
        ops = [("all_gather", full_elements(u, shard) * p.compute_bytes, gathers, sl),
               ("reduce_scatter", _scatter_bytes(u, shard, p.reduce_bytes), reduces if u.tensors else 0, sl),
               (*_hop(rl, cluster, u, shard, options, tp), syncs if u.tensors else 0, rl)]
        refresh = _refresh(cluster, u, shard, options, tp)
        if refresh:
            ops.append((*refresh, 1, rl))  # once per optimizer step
        for op, nbytes, count, links in ops:
            if links.size > 1:
                node += count * node_bytes(links, cluster, op, nbytes)
                a, b = rank_split_bytes(links, cluster, op, nbytes)
                intra, inter, calls = intra + count * a, inter + count * b, calls + count
        if tp > 1:  # inside the node, every micro-batch
            n = k * sum(tp_collectives(model, options, u))
            intra, calls = intra + n * tp_rank_bytes(model, cluster, options, tp), calls + n
    return _Traffic(node, intra, inter, calls)


def estimate_step(model: ModelSpec, cluster: ClusterSpec, shard: int, options: TrainOptions,
                  profile: ComputeProfile | None = None, tp: int = 1) -> StepEstimate:
    """Seconds and bytes of one optimizer step with sharding degree ``shard`` (a divisor of the world) and
    tensor parallel degree ``tp`` (``ValueError`` naming the fix when ``(shard, tp)`` is not a layout of
    ``cluster``). ``options.micro_batches`` are per data-parallel rank, each of ``model.micro_batch``
    sequences, read by all ``tp`` ranks of the TP group."""
    if tp > 1:
        check_layout(cluster, shard, tp)
        model, profile = local_model(model, tp), local_profile(profile, model, tp)
    costs = _unit_costs(model, cluster, shard, options, profile, tp)
    tl = _Timeline()
    # Steady state: the previous step's refresh all-gathers start when this step does, in forward order.
    refreshed = {i: tl.issue("replicate", c.refresh) for i, c in enumerate(costs) if c.refresh.seconds}
    for m in range(options.micro_batches):
        _forward(tl, costs, options, refreshed if m == 0 else None)
        _backward(tl, costs, options, m)
    per_element = profile.optimizer_s_per_element if profile is not None else cluster.optimizer_s_per_element
    replicas = _replicas(cluster, shard, tp)
    optimizer = per_element * sum(stepped_elements(u, shard, replicas, options) for u in model.units)
    compute = options.micro_batches * sum(c.forward + c.backward for c in costs)
    tp_s = options.micro_batches * sum(c.tp_forward + c.tp_backward for c in costs)
    t = _traffic(model, cluster, shard, options, tp)
    # Host time per byte sent is spent on the same cores as compute: added, never overlapped.
    host = cluster.host_s_per_intra_byte * t.rank_intra + cluster.host_s_per_inter_byte * t.rank_inter
    step = tl.cpu + optimizer + host
    return StepEstimate(step, compute, optimizer, max(0.0, step - compute - optimizer), tl.busy + tp_s, t.node,
                        t.rank_intra + t.rank_inter, t.rank_inter, t.calls, tp_s)
