"""How long one collective takes in a layout, and how many bytes it pushes through each node's link.

Ring model, the algorithm NCCL and gloo use for large buffers: a group of ``n`` ranks in rank order forms a
ring; for a buffer of ``B`` bytes (all-gather output, reduce-scatter input, all-reduce buffer) every rank
sends its successor ``(n-1)/n * B`` (all-gather, ring reduce-scatter) or ``2(n-1)/n * B`` (all-reduce, and
gloo's reduce-scatter, which is an all-reduce). All groups of one kind run at once, so every ring edge that
leaves a node shares that node's inter-node bandwidth with the other groups' edges leaving it. Time:

    overhead + steps x latency + max(edge bytes / intra bandwidth, edges out of a node x edge bytes / inter bandwidth)

Consequences, the closed forms of the tests: HSDP with ``S`` = ranks per node has ``S`` replicate rings,
one edge each out of every node, so a node sends ``2(R-1)/R x P x b`` per step; DDP with one rank per node
sends ``2(N-1)/N x P x b``; a ring over all ``W = N x G`` ranks crosses each node boundary once.
"""

from __future__ import annotations

from dataclasses import dataclass

from hsdp.tools.planner.cluster import ClusterSpec

# "replica_reduce_scatter": hsdp's reduce-scatter across replicas (the replica-sharded optimizer's hop), at the
# ring's bytes on every backend: NCCL's is a ring, and on gloo hsdp runs it as an all-to-all plus a local sum
# where gloo's own reduce-scatter (``reduce_scatter_factor``) is an all-reduce.
OPS = ("all_gather", "reduce_scatter", "all_reduce", "replica_reduce_scatter")


@dataclass(frozen=True)
class GroupLinks:
    """The rings of one kind of group (every shard group, or every replicate group) in one layout.

    ``node_out_edges``: the most ring edges that leave one node, over all groups of the kind together;
    ``crossing_fraction``: the share of all ring edges that leave their node (what an average rank sends
    over the inter-node link).
    """

    size: int
    crosses_nodes: bool
    has_intra: bool
    node_out_edges: int
    crossing_fraction: float = 0.0


def groups(world_size: int, shard: int, kind: str, tp: int = 1) -> list[list[int]]:
    """Ranks of every group of ``kind`` on the (replicate, shard, tp) grid, rank ``(r x S + s) x T + t``:
    TP groups are ``T`` adjacent ranks, shard groups ranks ``T`` apart, replicate groups ``S x T`` apart
    (with ``tp=1``: consecutive shard groups, strided replicate groups)."""
    replicate = world_size // (shard * tp)
    if kind == "shard":
        return [[(r * shard + i) * tp + t for i in range(shard)] for r in range(replicate) for t in range(tp)]
    if kind == "replicate":
        return [[(r * shard + j) * tp + t for r in range(replicate)] for j in range(shard) for t in range(tp)]
    raise ValueError(f"group kind {kind!r}: use 'shard' or 'replicate'")


def group_links(cluster: ClusterSpec, shard: int, kind: str, tp: int = 1) -> GroupLinks:
    """Count the ring edges of ``kind``'s groups that stay in a node and that leave one."""
    g = cluster.gpus_per_node
    members = groups(cluster.world_size, shard, kind, tp)
    size = len(members[0])
    out_edges = [0] * cluster.nodes
    has_intra = False
    if size > 1:
        for ranks in members:
            for a, b in zip(ranks, ranks[1:] + ranks[:1]):
                if a // g != b // g:
                    out_edges[a // g] += 1
                else:
                    has_intra = True
    edges = len(members) * size if size > 1 else 1
    return GroupLinks(size, max(out_edges) > 0, has_intra, max(out_edges), sum(out_edges) / edges)


def wire_factor(op: str, n: int, reduce_scatter_factor: float = 1.0) -> float:
    """Bytes each rank sends per byte of buffer, for a ring of ``n``."""
    if n <= 1:
        return 0.0
    base = (n - 1) / n
    factors = {"all_gather": base, "reduce_scatter": reduce_scatter_factor * base, "all_reduce": 2 * base,
               "replica_reduce_scatter": base}
    if op not in factors:
        raise ValueError(f"collective {op!r}: use one of {OPS}")
    return factors[op]


def ring_steps(op: str, n: int, reduce_scatter_factor: float = 1.0) -> float:
    return wire_factor(op, n, reduce_scatter_factor) * n


def node_bytes(links: GroupLinks, cluster: ClusterSpec, op: str, nbytes: float) -> float:
    """Bytes the busiest node sends to other nodes for one collective of ``nbytes`` (all groups at once)."""
    if not links.crosses_nodes:
        return 0.0
    return links.node_out_edges * wire_factor(op, links.size, cluster.reduce_scatter_factor) * nbytes


def rank_bytes(links: GroupLinks, cluster: ClusterSpec, op: str, nbytes: float) -> float:
    """Bytes one rank sends to its ring neighbour for one collective of ``nbytes``."""
    return wire_factor(op, links.size, cluster.reduce_scatter_factor) * nbytes


def rank_split_bytes(links: GroupLinks, cluster: ClusterSpec, op: str, nbytes: float) -> tuple[float, float]:
    """(inside the node, to another node): bytes an average rank sends for one collective."""
    sent = rank_bytes(links, cluster, op, nbytes)
    return sent * (1 - links.crossing_fraction), sent * links.crossing_fraction


def link_seconds(links: GroupLinks, cluster: ClusterSpec, op: str, nbytes: float) -> float:
    """How long one collective occupies the busiest node's inter-node link (0 when it stays in nodes)."""
    if links.size <= 1 or not links.crosses_nodes:
        return 0.0
    return node_bytes(links, cluster, op, nbytes) / cluster.inter_bandwidth


def collective_seconds(links: GroupLinks, cluster: ClusterSpec, op: str, nbytes: float) -> float:
    """Duration of one collective of ``nbytes`` on every group of the kind at once (0 for a group of 1:
    the engine makes that a local copy, counted as compute)."""
    if links.size <= 1:
        return 0.0
    edge = rank_bytes(links, cluster, op, nbytes)
    intra = edge / cluster.intra_bandwidth if links.has_intra else 0.0
    inter = links.node_out_edges * edge / cluster.inter_bandwidth if links.crosses_nodes else 0.0
    latency = cluster.inter_latency if links.crosses_nodes else cluster.intra_latency
    steps = ring_steps(op, links.size, cluster.reduce_scatter_factor)
    return cluster.collective_overhead + steps * latency + max(intra, inter)
