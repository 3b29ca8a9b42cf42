"""Rank-grid arithmetic and shard layouts: pure functions, no processes."""

from __future__ import annotations

import warnings

import pytest
import torch

from hsdp.engine import mesh_init
from hsdp.engine.mesh_layout import (
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
    monkeypatch.setattr(mesh_init.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(mesh_init.dist, "get_world_size", lambda: 6)
    monkeypatch.setattr(mesh_init.dist, "get_backend", lambda: "gloo")
    monkeypatch.setattr(mesh_init, "init_device_mesh", lambda *args, **kwargs: None)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    with pytest.warns(UserWarning, match="Pass sharding_degree=3"):
        mesh_init.init_mesh(2, fault_policy=None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mesh_init.init_mesh(3, fault_policy=None)  # aligned with the nodes: silent


def test_device_type_follows_the_backend_and_the_gpus() -> None:
    # CUDA tensors through NCCL: the plain name, torch's default backend map, or a not-yet-resolved default.
    for backend in ("nccl", "cpu:gloo,cuda:nccl", "undefined", "NCCL"):
        assert device_type_for(backend, cuda_available=True) == "cuda", backend
        assert device_type_for(backend, cuda_available=False) == "cpu", backend
    assert device_type_for("gloo", cuda_available=True) == "cpu"  # an explicit gloo keeps CPU tensors


# ---------------------------------------------------------------------------------------------------------
# Tensor parallelism: the (R, S, T) shape and its validation (pure).
# ---------------------------------------------------------------------------------------------------------
def test_mesh_shape_with_tensor_parallelism() -> None:
    from hsdp.engine.mesh_layout import mesh_shape

    node4 = {"LOCAL_WORLD_SIZE": "4"}
    assert mesh_shape(8, 2, 2, env=node4) == (2, 2, 2)
    assert mesh_shape(8, None, 2, env=node4) == (2, 2, 2)  # default S: ranks per node / T
    assert mesh_shape(8, None, 4, env=node4) == (2, 1, 4)
    assert mesh_shape(8, None, None, env=node4) == (2, 4)  # no tp dim: today's 2-D mesh
    assert mesh_shape(8, 4, 2, allow_cross_node_shards=True, env=node4) == (1, 4, 2)


@pytest.mark.parametrize("s,t,fix", [(2, 3, r"does not divide the 4 ranks per node: .*choose one of \[1, 2, 4\]"),
                                     (4, 2, "use sharding_degree=2, or pass allow_cross_node_shards=True"),
                                     (2, 0, "tensor_parallel_degree must be an int >= 1"),
                                     (3, 2, "not divisible by sharding_degree=3")])
def test_bad_tensor_parallel_degrees_name_the_fix(s: int, t: int, fix: str) -> None:
    from hsdp.engine.mesh_layout import mesh_shape

    with pytest.raises(ValueError, match=fix):
        mesh_shape(8, s, t, env={"LOCAL_WORLD_SIZE": "4"})


def test_tp_layout_is_chunks_of_the_tp_piece_uneven_included() -> None:
    """A rank holds torch.chunk over S of its torch.chunk over T (even and uneven row counts), which is what
    DTensor's (_StridedShard(0, T), Shard(0)) placements on the ("shard", "tp") mesh describe (DCP round trips
    across layouts in test_tensor_parallel.py depend on the two agreeing)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    from hsdp.engine.runtime.layout import TPSplit

    for rows in (8, 7, 5, 3):
        full = torch.arange(rows * 2).view(rows, 2)
        for t in range(2):
            for s in range(2):
                layout = ShardLayout(tuple(torch.chunk(full, 2)[t].shape), 2, s, TPSplit(Shard(0), (rows, 2), 2, t))
                assert layout.placements == (_StridedShard(0, split_factor=2), Shard(0))
                piece = torch.chunk(full, 2)[t]
                want = torch.chunk(piece, 2)[s] if s < len(torch.chunk(piece, 2)) else piece[:0]
                assert torch.equal(layout.chunk_of_full(full), want)
                assert layout.dtensor_shape == (rows, 2)
    col = ShardLayout((4, 1), 2, 0, TPSplit(Shard(1), (4, 2), 2, 1))
    assert col.placements == (Shard(0), Shard(1))
    assert torch.equal(col.chunk_of_full(torch.arange(8).view(4, 2)), torch.tensor([[1], [3]]))


def test_hsdp_initialised_nccl_group_binds_the_local_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    assert mesh_init.process_group_kwargs(False, {"LOCAL_RANK": "3"}) == {"backend": "gloo"}
    assert mesh_init.process_group_kwargs(True, {}) == {"backend": "nccl"}
    assert mesh_init.process_group_kwargs(True, {"LOCAL_RANK": "3"}) == {
        "backend": "nccl", "device_id": torch.device("cuda", 3)}
    # The wiring, without a GPU: what init_process_group and set_device receive.
    calls: list[tuple[str, object]] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", d)))
    monkeypatch.setattr(mesh_init.dist, "init_process_group", lambda **kw: calls.append(("init", kw)))
    torchrun = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1", "LOCAL_RANK": "1"}
    for key, value in torchrun.items():
        monkeypatch.setenv(key, value)
    mesh_init._init_process_group(mesh_init.DEFAULT_TIMEOUT)
    assert calls == [("set_device", torch.device("cuda", 1)),
                     ("init", {"timeout": mesh_init.DEFAULT_TIMEOUT, "backend": "nccl",
                               "device_id": torch.device("cuda", 1)})]
