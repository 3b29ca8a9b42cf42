"""Rank-grid arithmetic and shard layouts: pure functions, no processes."""

from __future__ import annotations

import pytest
import torch

from hsdp.engine.mesh import default_sharding_degree, grid_position, rank_grid, validate_degree
from hsdp.engine.runtime.layout import ShardLayout


def test_rank_grid_puts_consecutive_ranks_in_one_shard_group() -> None:
    assert rank_grid(8, 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert rank_grid(4, 1) == [[0], [1], [2], [3]]
    assert rank_grid(4, 4) == [[0, 1, 2, 3]]
    assert grid_position(5, 4) == (1, 1)
    assert grid_position(3, 2) == (1, 1)


@pytest.mark.parametrize("world,degree,fix", [(4, 3, "choose one of [1, 2, 4]"), (4, 0, "below 1"),
                                              (2, 4, "use at most 2"), (4, -1, "below 1")])
def test_bad_degrees_name_the_fix(world: int, degree: int, fix: str) -> None:
    with pytest.raises(ValueError, match=fix.replace("[", r"\[").replace("]", r"\]")):
        validate_degree(world, degree)


def test_default_degree_is_ranks_per_node() -> None:
    assert default_sharding_degree(8, {"LOCAL_WORLD_SIZE": "4"}) == 4
    assert default_sharding_degree(2, {"LOCAL_WORLD_SIZE": "4"}) == 2
    with pytest.warns(UserWarning, match="plain replication"):
        assert default_sharding_degree(6, {"LOCAL_WORLD_SIZE": "4"}) == 1  # not a divisor: replicate


@pytest.mark.parametrize("rows,degree", [(3, 4), (16, 4), (17, 4), (17, 2), (1, 2), (5, 4)])
def test_layout_chunks_match_torch_chunk(rows: int, degree: int) -> None:
    full = torch.arange(rows * 3).view(rows, 3)
    expected = list(torch.chunk(full, degree))
    expected += [full[:0]] * (degree - len(expected))
    pieces = [ShardLayout((rows, 3), degree, r).chunk(full) for r in range(degree)]
    for got, want in zip(pieces, expected, strict=True):
        assert torch.equal(got, want)
    layout = ShardLayout((rows, 3), degree, 0)
    assert layout.padded_numel == -(-rows // degree) * 3  # every rank reserves the largest chunk


def test_degree_from_environment_wins_over_ranks_per_node() -> None:
    env = {"LOCAL_WORLD_SIZE": "2", "HSDP_SHARDING_DEGREE": "4"}
    assert default_sharding_degree(8, env) == 4
    assert default_sharding_degree(8, {**env, "HSDP_SHARDING_DEGREE": ""}) == 2  # empty: unset


@pytest.mark.parametrize("value,fix", [("3", "choose one of"), ("two", "not an integer"), ("16", "at most 8")])
def test_bad_degree_in_environment_names_the_fix(value: str, fix: str) -> None:
    with pytest.raises(ValueError, match=fix):
        default_sharding_degree(8, {"HSDP_SHARDING_DEGREE": value})
