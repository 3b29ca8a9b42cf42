"""Replica layouts of different shard degrees (hsdp/engine/replicate/degrees.py): rank placement and the errors a
user gets, before any collective."""

from __future__ import annotations

import pytest

from hsdp.engine.replicate.degrees import (
    check_degrees,
    default_degrees,
    is_regular,
    replica_of_rank,
    replica_starts,
)


def test_replicas_are_consecutive_rank_ranges() -> None:
    assert replica_starts([4, 2, 2]) == [0, 4, 6]
    assert [replica_of_rank(r, [4, 2, 2]) for r in range(8)] == [
        (0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1), (2, 0), (2, 1)]
    assert [replica_of_rank(r, [2, 1]) for r in range(3)] == [(0, 0), (0, 1), (1, 0)]
    with pytest.raises(ValueError, match="outside the 3 ranks"):
        replica_of_rank(3, [2, 1])


def test_valid_layouts() -> None:
    assert check_degrees([2, 1], 3, node_sizes=[2, 1]) == (2, 1)
    assert check_degrees([4, 4, 8], 16, node_sizes=[8, 8]) == (4, 4, 8)  # an 80 GB node split in two replicas
    assert check_degrees([3], 3) == (3,)
    assert default_degrees([4, 2]) == (4, 2)
    assert is_regular((2, 2)) and not is_regular((2, 1))


def test_a_list_that_does_not_cover_the_world_names_the_sum() -> None:
    with pytest.raises(ValueError, match=r"covers 4 ranks but the world has 3.*summing to 3"):
        check_degrees([2, 2], 3)


@pytest.mark.parametrize("bad", [[2, 0], [3, -1], [], [1.5, 1.5], [True, 2]])
def test_zero_negative_or_non_int_degrees(bad: list) -> None:
    with pytest.raises(ValueError, match="positive ints"):
        check_degrees(bad, 3)


def test_a_replica_straddling_nodes_is_refused_unless_allowed() -> None:
    with pytest.raises(ValueError, match=r"replica 0 .*ranks 0\.\.2\) spans nodes 0 and 1.*sharding_degree=\[2, 2\]"
                                         r".*allow_cross_node_shards=True"):
        check_degrees([3, 1], 4, node_sizes=[2, 2])
    assert check_degrees([3, 1], 4, node_sizes=[2, 2], allow_cross_node_shards=True) == (3, 1)


def test_node_sizes_that_disagree_with_the_world() -> None:
    with pytest.raises(ValueError, match="--nproc-per-node"):
        check_degrees([2, 1], 3, node_sizes=[2, 2])
