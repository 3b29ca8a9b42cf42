"""Rank-grid arithmetic and shard layouts: pure functions, no processes."""

from __future__ import annotations

import warnings

import pytest
import torch

from hsdp.engine import mesh as mesh_module
from hsdp.engine.mesh import (
    default_sharding_degree,
    device_type_for,
    grid_position,
    node_crossing_warning,
    rank_grid,
    validate_degree,
)
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


def test_shard_groups_straddling_nodes_warn_with_the_override() -> None:
    # hsdp launch --nodes 2 --nproc-per-node 3 with init_mesh(2): ranks 2 and 3 share a group across nodes.
    text = node_crossing_warning(6, 2, 3)
    assert text is not None and "ranks 2..3 span nodes 0 and 1" in text
    assert "sharding_degree=3" in text and "HSDP_SHARDING_DEGREE=3" in text and "[1, 3, 6]" in text
    assert node_crossing_warning(12, 6, 4) is not None  # a group of 1.5 nodes
    # Within a node, whole nodes (full sharding, S a multiple of the node) or one node: no warning.
    for world, degree, local in [(6, 3, 3), (8, 2, 4), (8, 8, 4), (16, 8, 4), (6, 2, 6), (4, 2, 1)]:
        assert node_crossing_warning(world, degree, local) is None, (world, degree, local)


def test_init_mesh_warns_when_torchruns_nodes_split_a_shard_group(monkeypatch: pytest.MonkeyPatch) -> None:
    # A process group of 2 nodes x 3 ranks, faked: only the checks before the first collective run.
    monkeypatch.setattr(mesh_module.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(mesh_module.dist, "get_world_size", lambda: 6)
    monkeypatch.setattr(mesh_module.dist, "get_backend", lambda: "gloo")
    monkeypatch.setattr(mesh_module, "init_device_mesh", lambda *args, **kwargs: None)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    with pytest.warns(UserWarning, match="Pass sharding_degree=3"):
        mesh_module.init_mesh(2, fault_policy=None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mesh_module.init_mesh(3, fault_policy=None)  # aligned with the nodes: silent


def test_device_type_follows_the_backend_and_the_gpus() -> None:
    # CUDA tensors through NCCL: the plain name, torch's default backend map, or a not-yet-resolved default.
    for backend in ("nccl", "cpu:gloo,cuda:nccl", "undefined", "NCCL"):
        assert device_type_for(backend, cuda_available=True) == "cuda", backend
        assert device_type_for(backend, cuda_available=False) == "cpu", backend
    assert device_type_for("gloo", cuda_available=True) == "cpu"  # an explicit gloo keeps CPU tensors
