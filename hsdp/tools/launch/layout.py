"""How many ranks each emulated node runs: one count for every node, or one count per node.

``hsdp launch --nproc-per-node 4,2`` emulates a heterogeneous cluster (a node with 4 GPUs next to one with
2). Every node's torchrun agent gets its own ``--nproc-per-node``; torchrun then numbers the ranks
node-major and consecutively (node 0 has ranks 0..3, node 1 ranks 4..5): with the static rendezvous, each
agent publishes its rank count in the store and node 0's agent hands out base ranks by cumulative sum in
node order (``SimpleElasticAgent._assign_worker_ranks``, checked on torch 2.13). Each rank's
``LOCAL_WORLD_SIZE`` is its node's count, ``WORLD_SIZE`` the sum. The one way to break that is torchrun's
``TORCH_ELASTIC_WORKER_IDENTICAL=1`` shortcut (``rank = node * nproc + local``), which assumes equal nodes;
:meth:`NodeLayout.agent_env` turns it off for uneven ones.

The command-line rule (:func:`resolve_nodes`): a list's length is the node count; ``--nodes``, when given
as well, must equal it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

DEFAULT_NODES = 2  # `hsdp launch` without --nodes and with a single count
IDENTICAL_WORKERS = "TORCH_ELASTIC_WORKER_IDENTICAL"  # torchrun's equal-nodes rank shortcut


@dataclass(frozen=True)
class NodeLayout:
    """The ranks of each emulated node: ``nprocs[i]`` ranks on node ``i``, global ranks node-major.

    ``ValueError`` naming the fix for no nodes or a count that is not a positive integer."""

    nprocs: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.nprocs:
            raise ValueError("no nodes: give at least one rank count")
        for i, n in enumerate(self.nprocs):
            # bool is an int to Python, but `True` ranks is a bug, not a count.
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"node {i} has {n!r} ranks: every node needs a whole number of ranks, at least 1")

    @classmethod
    def of(cls, nproc_per_node: int | Sequence[int], nodes: int) -> NodeLayout:
        """``nodes`` nodes of ``nproc_per_node`` ranks each, or the per-node counts ``nproc_per_node``
        (exactly ``nodes`` of them)."""
        if nodes < 1:
            raise ValueError(f"nodes={nodes}: an emulated cluster needs at least 1 node")
        if isinstance(nproc_per_node, int):
            return cls((nproc_per_node,) * nodes)
        try:
            counts = tuple(nproc_per_node)
        except TypeError:
            raise ValueError(f"nproc_per_node={nproc_per_node!r}: give a whole number of ranks, or one per "
                             f"node as a sequence (e.g. (4, 2))") from None
        if len(counts) != nodes:
            raise ValueError(f"nproc_per_node {list(counts)} has {len(counts)} counts for {nodes} nodes: give "
                             f"one count per node, or a single count for all of them")
        return cls(counts)

    @property
    def nodes(self) -> int:
        return len(self.nprocs)

    @property
    def world_size(self) -> int:
        """All ranks of the job (torchrun's ``WORLD_SIZE``)."""
        return sum(self.nprocs)

    @property
    def uniform(self) -> bool:
        """Whether every node runs the same number of ranks."""
        return len(set(self.nprocs)) == 1

    @property
    def nproc_per_node(self) -> int | tuple[int, ...]:
        """The compact spelling: the single count when uniform, else the per-node counts (the traffic JSON's
        ``nproc_per_node``, so reports of uniform runs read as before)."""
        return self.nprocs[0] if self.uniform else self.nprocs

    def ranks(self, node: int) -> range:
        """Global ranks of node ``node``."""
        first = sum(self.nprocs[:node])
        return range(first, first + self.nprocs[node])

    def rank_span(self, node: int) -> str:
        """Node ``node``'s global ranks for people: ``"4-5"``, or ``"3"`` for one rank."""
        r = self.ranks(node)
        return str(r.start) if len(r) == 1 else f"{r.start}-{r[-1]}"

    def agent_env(self) -> dict[str, str]:
        """What every agent of this layout must have in its environment, on top of the job's: torchrun's
        equal-nodes shortcut off when the nodes differ (it would hand out overlapping ranks)."""
        return {} if self.uniform else {IDENTICAL_WORKERS: "0"}

    def describe(self) -> str:
        """``"node 0: ranks 0-3, node 1: ranks 4-5"``."""
        return ", ".join(f"node {i}: rank{'s' if n > 1 else ''} {self.rank_span(i)}"
                         for i, n in enumerate(self.nprocs))


def parse_nproc_per_node(text: str) -> int | tuple[int, ...]:
    """``"2"`` -> ``2``; ``"4,2"`` -> ``(4, 2)``. ``ValueError`` naming the fix for anything but positive
    integers, comma-separated."""
    parts = [p.strip() for p in text.split(",")]
    try:
        counts = tuple(int(p) for p in parts)
    except ValueError:
        raise ValueError(f"--nproc-per-node {text!r}: give a whole number of ranks per node (e.g. 2), or one "
                         f"per node, comma-separated (e.g. 4,2)") from None
    bad = [c for c in counts if c < 1]
    if bad:
        raise ValueError(f"--nproc-per-node {text!r}: {bad[0]} ranks on a node; every node needs at least 1")
    return counts[0] if len(counts) == 1 else counts


def resolve_nodes(nodes: int | None, nproc_per_node: int | tuple[int, ...]) -> int:
    """The node count of ``--nodes`` and ``--nproc-per-node``: a list's length (``--nodes``, if given, must
    equal it), else ``--nodes`` (default :data:`DEFAULT_NODES`)."""
    if isinstance(nproc_per_node, int):
        return DEFAULT_NODES if nodes is None else nodes
    if nodes is not None and nodes != len(nproc_per_node):
        spelled = ",".join(map(str, nproc_per_node))
        raise ValueError(f"--nproc-per-node {spelled} gives {len(nproc_per_node)} counts but --nodes is {nodes}: "
                         f"give one count per node, or drop --nodes (the list's length is the node count)")
    return len(nproc_per_node)
