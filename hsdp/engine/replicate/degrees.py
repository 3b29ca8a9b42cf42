"""Replicas of different shard degrees: which ranks form which replica, checked before any collective.

``init_mesh(sharding_degree=[4, 2, 2])`` lays replicas out in rank order: replica ``q`` is the ``d_q``
consecutive ranks after the previous replicas' (torchrun numbers a node's ranks consecutively, so a replica
that fits a node stays inside it). Without a list, on a cluster whose nodes have different rank counts, the
default is one replica per node, sharded over its ranks (:func:`default_degrees`). An 80 GB node may also be
split into several replicas (``[4, 4, 8]``: one 8 x 80 GB node as two replicas of 4, one 8 x 40 GB node as
one replica of 8), which keeps every replica inside a node.

Pure arithmetic; the node sizes are given (``hsdp launch`` knows them, torchrun ranks learn them from each
other's ``LOCAL_WORLD_SIZE`` at ``init_mesh``). Every error is a ``ValueError`` naming the fix, raised on
every rank before any collective (``docs/design/replicate_layer.md``, step 2).
"""

from __future__ import annotations

from collections.abc import Sequence

from hsdp.engine.replicate.pieces import validate_degrees


def replica_starts(degrees: Sequence[int]) -> list[int]:
    """First global rank of every replica (replicas occupy consecutive rank ranges, in order)."""
    starts, at = [], 0
    for d in degrees:
        starts.append(at)
        at += d
    return starts


def replica_of_rank(rank: int, degrees: Sequence[int]) -> tuple[int, int]:
    """``(replica index, shard rank inside it)`` of a global rank."""
    for q, (start, d) in enumerate(zip(replica_starts(degrees), degrees, strict=True)):
        if start <= rank < start + d:
            return q, rank - start
    raise ValueError(f"rank {rank} is outside the {sum(degrees)} ranks of sharding_degree={list(degrees)}")


def check_degrees(degrees: Sequence[int], world_size: int, node_sizes: Sequence[int] | None = None,
                  allow_cross_node_shards: bool = False) -> tuple[int, ...]:
    """``degrees`` as a tuple, validated against the world (their sum) and, with ``node_sizes`` (ranks per node,
    in node order), against the nodes: a replica holding ranks of two nodes would all-gather and reduce-scatter
    over the slow link, so it is refused unless ``allow_cross_node_shards``."""
    degrees = tuple(degrees)
    validate_degrees(degrees)
    if sum(degrees) != world_size:
        raise ValueError(f"sharding_degree={list(degrees)} covers {sum(degrees)} ranks but the world has {world_size}:"
                         f" give one degree per replica, summing to {world_size} (e.g. one entry per node: the "
                         f"node's rank count)")
    if node_sizes is None or allow_cross_node_shards:
        return degrees
    if sum(node_sizes) != world_size:
        raise ValueError(f"the nodes' rank counts {list(node_sizes)} sum to {sum(node_sizes)}, not the world size "
                         f"{world_size}: check --nproc-per-node on every node")
    node_of = [n for n, size in enumerate(node_sizes) for _ in range(size)]
    for q, (start, d) in enumerate(zip(replica_starts(degrees), degrees, strict=True)):
        first, last = node_of[start], node_of[start + d - 1]
        if first != last:
            raise ValueError(
                f"replica {q} of sharding_degree={list(degrees)} (ranks {start}..{start + d - 1}) spans nodes "
                f"{first} and {last} (ranks per node {list(node_sizes)}): its all-gathers and reduce-scatters would "
                f"cross the slow link. Split each node into whole replicas (e.g. sharding_degree="
                f"{list(node_sizes)}), or pass allow_cross_node_shards=True to init_mesh if you mean it")
    return degrees


def default_degrees(node_sizes: Sequence[int]) -> tuple[int, ...]:
    """One replica per node, sharded over its ranks: the default when nodes differ in size."""
    return tuple(node_sizes)


def is_regular(degrees: Sequence[int]) -> bool:
    """Whether every replica has the same degree (a ``DeviceMesh`` grid describes it)."""
    return len(set(degrees)) == 1
