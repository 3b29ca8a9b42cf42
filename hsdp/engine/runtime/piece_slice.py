"""The optimizer sharded across replicas of different shard degrees: each replica's slice of every piece.

On a grid (``replica_slice.py``) shard rank ``s`` of every replica holds the same chunk, and the replicas split it
``torch.chunk``-wise. Across replicas of different degrees a chunk is cut into *pieces* (``replicate/pieces.py``),
each held by one rank per replica (its holders), and every piece is reduced over its holders alone
(``piece_plan.py``). Slicing follows the pieces: the rows of a piece are split ``torch.chunk``-wise over the R
replicas, ``ceil(rows / R)`` each (the last ones fewer or none), and the holder in replica ``q`` reduces and steps
part ``q``. A rank's slice of a parameter is then its part of each piece it holds, in row order: not one run of
rows of its chunk but one per piece, so its values live in a buffer of their own (``ShardedParam.opt_local``),
copied out of the chunk before each step; the all-gather after the step writes every holder's part, this rank's
included, back into the chunk. Optimizer state and reduced gradients per rank fall by R for the rows it holds.

Wire layout of a bucket (the pieces of one holder tuple, in parameter and row order): ``(R, width)``, row ``q``
part ``q`` of every piece padded to ``ceil(rows / R)`` rows, then (position groups only) the tail every rank needs
whole: 0-d parameters, the flags, the weight slots. Every holder builds the same layout from the same pieces.

Pure arithmetic and copies: the collectives are in ``piece_scatter.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hsdp.engine.replicate.fixed import Holders
from hsdp.engine.replicate.pieces import chunk_rows, pieces_of_rank
from hsdp.engine.runtime.layout import ShardLayout


@dataclass(frozen=True)
class SlicePiece:
    """One piece of this rank's chunk: its holders and its rows ``[start, start + rows)`` of the chunk."""

    holders: Holders
    start: int
    rows: int

    def part(self, replica: int, replicas: int) -> tuple[int, int]:
        """``(first row inside the piece, rows)`` of replica ``replica``'s part (``torch.chunk``)."""
        step = self.padded_rows(replicas)
        first = min(replica * step, self.rows)
        return first, min(step, self.rows - first)

    def padded_rows(self, replicas: int) -> int:
        """Rows every replica's part takes on the wire."""
        return -(-self.rows // replicas)


@dataclass(frozen=True)
class PieceSliceLayout:
    """This rank's slice of one parameter on a heterogeneous mesh: its part of each piece of its chunk."""

    shard: ShardLayout
    replicas: int
    replica_rank: int
    pieces: tuple[SlicePiece, ...]

    @property
    def replicated(self) -> bool:
        """A 0-d parameter: whole on every rank, its gradient averaged exactly, stepped alike everywhere."""
        return self.shard.replicated

    @property
    def runs(self) -> list[tuple[int, int]]:
        """``(first row in the chunk, rows)`` of this replica's part of each piece, in row order."""
        out = []
        for piece in self.pieces:
            first, rows = piece.part(self.replica_rank, self.replicas)
            out.append((piece.start + first, rows))
        return out

    def run_offsets(self) -> list[int]:
        """Where each piece's run starts in the slice, in rows."""
        offsets, at = [], 0
        for _, rows in self.runs:
            offsets.append(at)
            at += rows
        return offsets

    def local_rows(self) -> int:
        return 1 if self.replicated else sum(rows for _, rows in self.runs)

    @property
    def local_shape(self) -> tuple[int, ...]:
        shape = self.shard.global_shape
        return shape if self.replicated else (self.local_rows(), *shape[1:])

    @property
    def local_numel(self) -> int:
        return 1 if self.replicated else self.local_rows() * self.shard.row_numel

    @property
    def padded_numel(self) -> int:
        """Elements of the parameter in the reduced output: its slice, unpadded (the output is rebuilt per bucket)."""
        return self.local_numel

    def of_chunk(self, chunk: torch.Tensor) -> torch.Tensor:
        """This replica's slice of a tensor shaped like the shard chunk: a copy (a 0-d value: itself)."""
        if self.replicated:
            return chunk
        rows = [chunk.narrow(0, first, n) for first, n in self.runs]
        return torch.cat(rows) if rows else chunk.new_empty((0, *chunk.shape[1:]))

    def into_chunk(self, values: torch.Tensor, chunk: torch.Tensor) -> None:
        """Write a slice (shaped like :attr:`local_shape`) back into its rows of ``chunk``."""
        if self.replicated:
            chunk.copy_(values)
            return
        for (first, n), at in zip(self.runs, self.run_offsets(), strict=True):
            chunk.narrow(0, first, n).copy_(values.narrow(0, at, n))


def piece_slice(shard: ShardLayout, degrees: tuple[int, ...], replica: int) -> PieceSliceLayout:
    """Rank ``shard.shard_rank`` of replica ``replica``'s slice of a parameter of ``shard``'s layout."""
    if shard.replicated:
        return PieceSliceLayout(shard, len(degrees), replica, ())
    first = shard.shard_rank * chunk_rows(shard.rows, shard.sharding_degree)
    pieces = tuple(SlicePiece(p.holders, p.start - first, p.rows)
                   for p in pieces_of_rank(shard.rows, degrees, replica, shard.shard_rank))
    return PieceSliceLayout(shard, len(degrees), replica, pieces)


Entry = tuple[int, SlicePiece, int]  # (parameter index, piece, the piece's run offset in the slice, in rows)


def buckets(slices: list[PieceSliceLayout]) -> dict[Holders, list[Entry]]:
    """The pieces of a unit's slices by holder tuple, in parameter and row order: one collective each."""
    out: dict[Holders, list[Entry]] = {}
    for i, s in enumerate(slices):
        for piece, at in zip(s.pieces, s.run_offsets(), strict=True):
            out.setdefault(piece.holders, []).append((i, piece, at))
    return out


def bucket_width(entries: list[Entry], slices: list[PieceSliceLayout]) -> int:
    """Elements per replica of a bucket's pieces on the wire (tail excluded)."""
    return sum(piece.padded_rows(slices[i].replicas) * slices[i].shard.row_numel for i, piece, _ in entries)


def pack_bucket(entries: list[Entry], slices: list[PieceSliceLayout], chunks: list[torch.Tensor],
                out: torch.Tensor) -> None:
    """Part ``q`` of every piece of ``chunks`` (shaped like their shard chunks) into row ``q`` of ``out`` ``(R,
    >= width)``; ``out``'s padding must be zero."""
    at = 0
    for i, piece, _ in entries:
        s, chunk = slices[i], chunks[i]
        rn = s.shard.row_numel
        flat = chunk.reshape(chunk.shape[0], rn)
        for q in range(s.replicas):
            first, n = piece.part(q, s.replicas)
            out[q, at: at + n * rn] = flat[piece.start + first: piece.start + first + n].reshape(-1)
        at += piece.padded_rows(s.replicas) * rn


def unpack_bucket(received: torch.Tensor, entries: list[Entry], slices: list[PieceSliceLayout],
                  chunks: list[torch.Tensor]) -> None:
    """The inverse of :func:`pack_bucket` for an all-gathered ``received`` ``(R, >= width)``: every replica's part
    of each piece back into its rows of the chunks."""
    at = 0
    for i, piece, _ in entries:
        s, chunk = slices[i], chunks[i]
        rn = s.shard.row_numel
        flat = chunk.view(chunk.shape[0], rn)
        for q in range(s.replicas):
            first, n = piece.part(q, s.replicas)
            flat[piece.start + first: piece.start + first + n] = received[q, at: at + n * rn].view(n, rn)
        at += piece.padded_rows(s.replicas) * rn


def own_part_offsets(entries: list[Entry], slices: list[PieceSliceLayout], slice_offsets: list[int]) -> \
        list[tuple[int, int, int]]:
    """``(offset in the bucket row, offset in the unit's slices, elements)`` of this replica's part of each piece:
    where the reduced bucket lands in the slices laid back to back (``slice_offsets``: each parameter's first
    element there)."""
    out, at = [], 0
    for i, piece, run_at in entries:
        s = slices[i]
        rn = s.shard.row_numel
        _, n = piece.part(s.replica_rank, s.replicas)
        out.append((at, slice_offsets[i] + run_at * rn, n * rn))
        at += piece.padded_rows(s.replicas) * rn
    return out
