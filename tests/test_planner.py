"""The cost model against the closed forms (anchors): inter-node bytes per node and state bytes per rank.

Pure arithmetic: no processes, no torch. ``P`` parameters of ``b`` bytes, ``N`` nodes, ``k`` micro-batches.
"""

from __future__ import annotations

import math

import pytest

from hsdp.tools.planner.cluster import ClusterSpec, valid_degrees
from hsdp.tools.planner.comm import group_links, wire_factor
from hsdp.tools.planner.cost import estimate_step
from hsdp.tools.planner.memory import estimate_memory
from hsdp.tools.planner.model import ComputeProfile, uniform
from hsdp.tools.planner.options import PRECISIONS, TrainOptions, precision

P = 64 * 1024 * 1024  # divisible by every degree below: no padding
B = 4  # fp32 on the wire


def _cluster(nodes: int, gpus: int, rs_factor: float = 1.0, **kw: float) -> ClusterSpec:
    return ClusterSpec(nodes, gpus, math.inf, 100e9, 10e9, 1e14, reduce_scatter_factor=rs_factor, **kw)


def _model(root_fraction: float = 0.0, units: int = 8):
    return uniform("u", P, units, seq_len=128, root_fraction=root_fraction, width=1024)


def _inter(nodes: int, gpus: int, shard: int, k: int = 1, sync: str = "deferred", root: float = 0.0,
           rs_factor: float = 1.0) -> float:
    options = TrainOptions(micro_batches=k, sync=sync)
    return estimate_step(_model(root), _cluster(nodes, gpus, rs_factor), shard, options).inter_node_bytes


@pytest.mark.parametrize("n", [2, 4, 8])
def test_ddp_sends_2_n_minus_1_over_n_model_bytes_per_node(n: int) -> None:
    assert _inter(n, 1, 1) == pytest.approx(2 * (n - 1) / n * P * B, rel=1e-6)


@pytest.mark.parametrize("n,k", [(2, 1), (4, 1), (4, 3), (8, 2)])
def test_full_shard_sends_3k_n_minus_1_over_n_model_bytes_per_node(n: int, k: int) -> None:
    # Forward all-gather, backward all-gather, reduce-scatter: each (N-1)/N of the model, every micro-batch.
    assert _inter(n, 1, n, k) == pytest.approx(3 * k * (n - 1) / n * P * B, rel=1e-6)


def test_full_shard_root_is_not_gathered_again_in_backward() -> None:
    n, k, root = 4, 2, 0.25
    expected = (3 * k * (n - 1) / n * P - k * (n - 1) / n * root * P) * B
    assert _inter(n, 1, n, k, root=root) == pytest.approx(expected, rel=1e-4)


@pytest.mark.parametrize("nodes,gpus,k", [(2, 8, 1), (4, 8, 4), (16, 8, 8), (3, 2, 2)])
def test_hsdp_sends_2_r_minus_1_over_r_once_per_step(nodes: int, gpus: int, k: int) -> None:
    r = nodes
    floor = 2 * (r - 1) / r * P * B
    assert _inter(nodes, gpus, gpus, k) == pytest.approx(floor, rel=1e-3)  # flags: one element per tensor
    assert _inter(nodes, gpus, gpus, k, sync="every") == pytest.approx(k * floor, rel=1e-3)
    assert _inter(nodes, gpus, gpus, k, sync="local") == pytest.approx(floor, rel=1e-3)


def test_ddp_ring_over_all_ranks_crosses_each_node_once() -> None:
    # Measured on the emulated 2 x 2 cluster: 1.5 x model bytes per node (anchors: DDP 177 MB for 118 MB).
    assert _inter(2, 2, 1) == pytest.approx(2 * 3 / 4 * P * B, rel=1e-6)


def test_gloo_reduce_scatter_is_an_all_reduce_on_the_wire() -> None:
    # Measured: full shard on 2 x 2 at 1 Gbit/s sends 2.99 x model bytes per node (0.75 + 0.75 + 1.5).
    assert _inter(2, 2, 4, rs_factor=2.0) == pytest.approx(3.0 * P * B, rel=1e-6)
    assert _inter(2, 2, 4) == pytest.approx(2.25 * P * B, rel=1e-6)


def test_bf16_and_int8_hops_shrink_the_inter_node_bytes() -> None:
    cluster, model = _cluster(4, 8), _model()
    fp32 = estimate_step(model, cluster, 8, TrainOptions()).inter_node_bytes
    bf16 = estimate_step(model, cluster, 8, TrainOptions(replicate_dtype="bf16")).inter_node_bytes
    int8 = estimate_step(model, cluster, 8, TrainOptions(replicate_dtype="int8")).inter_node_bytes
    assert bf16 == pytest.approx(fp32 / 2, rel=1e-3)
    # Int8ErrorFeedbackHop: x n x (1 + 4/256) per rank against 2(R-1)/R x n x 4.
    assert int8 == pytest.approx(fp32 * (3 * (1 + 4 / 256)) / (2 * 3 / 4 * 4), rel=1e-3)


@pytest.mark.parametrize("name", sorted(PRECISIONS))
@pytest.mark.parametrize("nodes,gpus,shard", [(4, 8, 1), (4, 8, 8), (4, 8, 32), (2, 4, 2)])
def test_state_is_16p_over_s(name: str, nodes: int, gpus: int, shard: int) -> None:
    model = _model()
    m = estimate_memory(model, shard, TrainOptions(precision(name)))
    step_scalars = 4 * sum(u.tensors for u in model.units)  # AdamW's `step`, one fp32 scalar per tensor
    assert m.state - step_scalars == 16 * P / shard
    if shard == nodes * gpus:
        assert m.state - step_scalars == 16 * P / (nodes * gpus)  # full sharding: 16P/N


def test_padding_counts_ceil_rows_per_rank() -> None:
    from hsdp.tools.planner.model import ModelSpec, UnitSpec

    spec = ModelSpec("odd", (UnitSpec("root", ((3, 5), (17, 16))),))
    assert spec.units[0].slot(4) == 1 * 5 + 5 * 16  # ceil(3/4)=1 row, ceil(17/4)=5 rows
    m = estimate_memory(spec, 4, TrainOptions())
    assert m.params == 4 * (5 + 80)


def test_memory_grows_with_accumulation_mode_and_no_resharding() -> None:
    model = _model(0.1)
    base = estimate_memory(model, 8, TrainOptions(micro_batches=4))
    local = estimate_memory(model, 8, TrainOptions(micro_batches=4, sync="local"))
    keep = estimate_memory(model, 8, TrainOptions(reshard_after_forward=False))
    assert base.accumulation == pytest.approx(4 * P / 8, rel=1e-3)  # fp32 partial sums of the shard
    assert local.accumulation == pytest.approx(4 * P, rel=1e-3)  # fp32 unsharded sums
    assert keep.unsharded > estimate_memory(model, 8, TrainOptions()).unsharded


def test_step_is_compute_plus_optimizer_on_infinitely_fast_links() -> None:
    cluster = ClusterSpec(2, 4, math.inf, 1e30, 1e30, 1e14, 0, 0, 0, optimizer_s_per_element=1e-9)
    model = _model()
    for shard in valid_degrees(8):
        s = estimate_step(model, cluster, shard, TrainOptions())
        assert s.compute_s == pytest.approx(3 * model.forward_flops() / 1e14)
        assert s.step_s == pytest.approx(s.compute_s + 1e-9 * P / shard, rel=1e-6)


def test_overlap_hides_the_hop_behind_backward_when_compute_dominates() -> None:
    cluster, model = _cluster(4, 8), _model()
    slow_compute = ClusterSpec(4, 8, math.inf, 100e9, 10e9, 1e11)
    s = estimate_step(model, slow_compute, 8, TrainOptions())
    # Hidden except the ends: the first all-gather, the last reduce-scatter and hops (about 2 of 9 units).
    assert s.exposed_comm_s < 0.25 * s.comm_busy_s
    fast = estimate_step(model, cluster, 8, TrainOptions())
    assert fast.exposed_comm_s > 0.5 * fast.comm_busy_s  # comm-bound: mostly exposed


def test_profile_replaces_flops_and_slower_links_cost_more() -> None:
    profile = ComputeProfile(0.1, 0.2, 1e-9)
    model = _model()
    fast = estimate_step(model, _cluster(2, 2), 1, TrainOptions(), profile)
    assert fast.compute_s == pytest.approx(0.3)
    slow = ClusterSpec(2, 2, math.inf, 100e9, 10e6, 1e14)
    assert estimate_step(model, slow, 1, TrainOptions(), profile).step_s > fast.step_s


def test_ring_links() -> None:
    cluster = _cluster(4, 2)
    shard = group_links(cluster, 4, "shard")  # [0..3], [4..7]: 2 nodes per group, 1 edge out of each
    assert (shard.size, shard.crosses_nodes, shard.has_intra, shard.node_out_edges) == (4, True, True, 1)
    rep = group_links(cluster, 2, "replicate")  # {0,2,4,6}, {1,3,5,7}: every edge crosses
    assert (rep.size, rep.crosses_nodes, rep.has_intra, rep.node_out_edges) == (4, True, False, 2)
    assert not group_links(cluster, 2, "shard").crosses_nodes
    assert wire_factor("reduce_scatter", 4, 2.0) == wire_factor("all_reduce", 4)


@pytest.mark.parametrize("bad", [dict(nodes=0), dict(gpu_memory=0), dict(inter_bandwidth=-1.0),
                                 dict(reduce_scatter_factor=3.0), dict(host_s_per_inter_byte=-1.0)])
def test_bad_cluster_names_the_field(bad: dict) -> None:
    base = dict(nodes=2, gpus_per_node=2, gpu_memory=1.0, intra_bandwidth=1.0, inter_bandwidth=1.0, compute_rate=1.0)
    with pytest.raises(ValueError, match=next(iter(bad))):
        ClusterSpec(**{**base, **bad})


def test_bad_options_name_the_fix() -> None:
    with pytest.raises(ValueError, match="choose one of"):
        TrainOptions(sync="sometimes")
    with pytest.raises(ValueError, match="at least 1"):
        TrainOptions(micro_batches=0)
    with pytest.raises(ValueError, match="choose one of"):
        precision("fp8")
