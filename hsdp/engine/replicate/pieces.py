"""Which rows of a parameter are reduced together across replicas of different shard degrees.

Replica ``q`` of shard degree ``d_q`` splits a parameter of ``rows`` rows into ``torch.chunk`` dim-0 chunks of
``c_q = ceil(rows / d_q)`` rows (``layout.py``). When the degrees differ, the chunks of two replicas do not line
up, so "the rank holding the same shard on the other node" is not one rank. The inter-node reduction then works
on *pieces*: the finest common partition of every replica's chunk boundaries. Each piece ``[start, stop)`` lies
inside exactly one chunk of every replica, so it is held by one rank per replica (its *holders*), and reducing
every piece once over its holders reduces every element exactly once: inter-node bytes stay at the all-reduce
floor whatever the degrees. Pieces with the same holders are reduced in one collective (one process group per
distinct holder tuple).

On a regular mesh (every degree equal) the pieces are the chunks themselves and the holders of chunk ``s`` are
shard rank ``s`` of every replica: the ``"replicate"`` groups, today's hop.

A 0-d parameter (replicated in the shard group) and per-unit values every rank needs (the "has gradient" flags,
the batch-weight slots) are not split: they go through the *position groups* ``G_j = (j mod d_q for each
replica q)``, ``j < max(d)``; every rank is in at least one (a rank of a smaller replica in several, with the
same values in each).

Pure arithmetic: no processes, no tensors (``docs/design/replicate_layer.md``, step 2).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Piece:
    """Rows ``[start, stop)`` of one parameter and, per replica, the shard rank that holds them."""

    start: int
    stop: int
    holders: tuple[int, ...]

    @property
    def rows(self) -> int:
        return self.stop - self.start


def chunk_rows(rows: int, degree: int) -> int:
    """Rows per rank of ``torch.chunk(rows, degree)`` (the last ranks may hold fewer, or none)."""
    return -(-rows // degree)


def validate_degrees(degrees: tuple[int, ...]) -> None:
    """``ValueError`` naming the fix when ``degrees`` is not a non-empty tuple of positive ints."""
    if not degrees or any(not isinstance(d, int) or isinstance(d, bool) or d < 1 for d in degrees):
        raise ValueError(f"replica shard degrees must be positive ints, one per replica, got {degrees!r}: "
                         f"e.g. sharding_degree=[4, 2, 2] for one replica of 4 ranks and two of 2")


def pieces(rows: int, degrees: tuple[int, ...]) -> list[Piece]:
    """The finest common partition of ``rows`` rows under every replica's chunking, in row order."""
    validate_degrees(degrees)
    if rows < 1:
        return []
    sizes = [chunk_rows(rows, d) for d in degrees]
    cuts = sorted({min(k * c, rows) for c, d in zip(sizes, degrees, strict=True) for k in range(d + 1)})
    return [Piece(a, b, tuple(a // c for c in sizes)) for a, b in itertools.pairwise(cuts) if b > a]


def pieces_of_rank(rows: int, degrees: tuple[int, ...], replica: int, shard_rank: int) -> list[Piece]:
    """The pieces rank ``shard_rank`` of replica ``replica`` holds (its chunk's rows, cut at every boundary)."""
    return [p for p in pieces(rows, degrees) if p.holders[replica] == shard_rank]


def offset_in_chunk(piece: Piece, rows: int, degree: int, shard_rank: int) -> int:
    """First row of ``piece`` inside the chunk of ``shard_rank`` (of a replica of ``degree``) that holds it."""
    return piece.start - shard_rank * chunk_rows(rows, degree)


def position_groups(degrees: tuple[int, ...]) -> list[tuple[int, ...]]:
    """The holder tuples ``G_j = (j mod d_q, ...)``, ``j < max(d)``: one rank per replica, every rank in one or
    more (used for what every rank needs whole: 0-d parameters, flags, batch weights)."""
    validate_degrees(degrees)
    return sorted({tuple(j % d for d in degrees) for j in range(max(degrees))})


def holder_tuples(rows: Iterable[int], degrees: tuple[int, ...]) -> set[tuple[int, ...]]:
    """Every holder tuple over ``degrees`` that parameters of ``rows`` rows are reduced over, on any rank: their
    pieces' and the position groups (the groups to create)."""
    tuples = set(position_groups(degrees))
    for n in rows:
        tuples.update(p.holders for p in pieces(n, degrees))
    return tuples


def global_ranks(holders: tuple[int, ...], degrees: tuple[int, ...], tp_degree: int = 1,
                 tp_rank: int = 0) -> tuple[int, ...]:
    """Global ranks of a holder tuple: replicas occupy consecutive rank ranges in order. With tensor parallelism
    of degree ``T`` every data-parallel position is ``T`` adjacent ranks, and a holder tuple names the ranks of one
    tp coordinate ``tp_rank``: they hold the same tensor-parallel piece of every parameter."""
    starts = [sum(degrees[:q]) for q in range(len(degrees))]
    return tuple((s + h) * tp_degree + tp_rank for s, h in zip(starts, holders, strict=True))
