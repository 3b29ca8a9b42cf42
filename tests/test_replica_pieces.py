"""The common partition of replicas' chunk boundaries (hsdp/engine/replicate/pieces.py): every element is
reduced exactly once, over exactly the ranks that hold it, checked against torch.chunk itself."""

from __future__ import annotations

import pytest
import torch

from hsdp.engine.replicate.pieces import (
    global_ranks,
    offset_in_chunk,
    pieces,
    pieces_of_rank,
    position_groups,
)

DEGREES = [(2, 1), (4, 2, 2), (2, 2), (3, 2), (8, 4), (1,), (4, 3, 1)]


@pytest.mark.parametrize("degrees", DEGREES)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 7, 8, 12, 13])
def test_pieces_cover_each_row_once_and_lie_in_one_chunk_per_replica(rows: int, degrees: tuple[int, ...]) -> None:
    ps = pieces(rows, degrees)
    covered = [r for p in ps for r in range(p.start, p.stop)]
    assert covered == list(range(rows))  # every row once, in order
    index = torch.arange(rows)
    for q, d in enumerate(degrees):
        chunks = torch.chunk(index, d)
        for p in ps:
            holder = p.holders[q]
            chunk = chunks[holder].tolist()
            assert set(range(p.start, p.stop)) <= set(chunk), (rows, degrees, p, q)
            off = offset_in_chunk(p, rows, d, holder)
            assert chunk[off: off + p.rows] == list(range(p.start, p.stop))
        # A rank's pieces are exactly its chunk's rows.
        for s in range(d):
            mine = [r for p in pieces_of_rank(rows, degrees, q, s) for r in range(p.start, p.stop)]
            assert mine == (chunks[s].tolist() if s < len(chunks) else [])


def test_regular_degrees_give_one_piece_per_chunk_held_by_the_same_shard_rank() -> None:
    assert [(p.start, p.stop, p.holders) for p in pieces(8, (4, 4))] == [
        (0, 2, (0, 0)), (2, 4, (1, 1)), (4, 6, (2, 2)), (6, 8, (3, 3))]


def test_two_plus_one() -> None:
    # [2, 1]: replica 0 ranks 0, 1 hold rows 0-2, 3-4; replica 1 (rank 2) holds all five.
    assert [(p.start, p.stop, p.holders) for p in pieces(5, (2, 1))] == [(0, 3, (0, 0)), (3, 5, (1, 0))]
    assert [global_ranks(p.holders, (2, 1)) for p in pieces(5, (2, 1))] == [(0, 2), (1, 2)]


@pytest.mark.parametrize("degrees", DEGREES)
def test_position_groups_take_one_rank_per_replica_and_cover_every_rank(degrees: tuple[int, ...]) -> None:
    groups = position_groups(degrees)
    ranks = {r for g in groups for r in global_ranks(g, degrees)}
    assert ranks == set(range(sum(degrees)))
    for g in groups:
        assert all(0 <= h < d for h, d in zip(g, degrees, strict=True))
    assert len(groups) == max(degrees) or len(set(degrees)) > 1


@pytest.mark.parametrize("bad", [(), (2, 0), (2, -1), (2.0, 1), (True, 1)])
def test_bad_degrees_name_the_fix(bad: tuple) -> None:
    with pytest.raises(ValueError, match="sharding_degree=\\[4, 2, 2\\]"):
        pieces(4, bad)


@pytest.mark.parametrize("degrees", [(8, 4), (8, 8, 4), (4, 2, 2), (3, 2)])
def test_holder_tuples_stay_few(degrees: tuple[int, ...]) -> None:
    """Distinct holder tuples over many shapes stay within twice the sum of the degrees, far below their product
    (one process group each)."""
    tuples = {p.holders for rows in range(1, 600) for p in pieces(rows, degrees)}
    assert len(tuples) <= 2 * sum(degrees), (degrees, len(tuples))
