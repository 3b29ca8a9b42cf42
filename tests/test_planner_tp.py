"""Tensor parallelism in the planner: the R x S x T grid, memory / T, TP traffic on the critical path, and T
picked with S. Pure arithmetic: no processes, no torch. ``P`` parameters of ``b`` bytes."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from hsdp.apps.cli import build_parser, main
from hsdp.apps.cli.plan import build_plan
from hsdp.tools.planner.cluster import ClusterSpec
from hsdp.tools.planner.comm import groups
from hsdp.tools.planner.cost import estimate_step, unit_costs
from hsdp.tools.planner.memory import estimate_memory
from hsdp.tools.planner.model import TransformerShape, transformer, uniform
from hsdp.tools.planner.options import Layout, TrainOptions
from hsdp.tools.planner.plan import estimate_layout, make_plan
from hsdp.tools.planner.tensor_parallel import BLOCK_COLLECTIVES, shard_degrees

P = 64 * 1024 * 1024
B = 4  # fp32


def _cluster(nodes: int = 2, gpus: int = 8, memory: float = math.inf) -> ClusterSpec:
    return ClusterSpec(nodes, gpus, memory, 100e9, 10e9, 1e14)


def _blocks(units: int = 8):
    return uniform("u", P, units, seq_len=128, width=1024)  # all parameters in blocks, hidden 1024


def _decoder(seq_len: int = 4096):
    # Small vocabulary: the blocks hold almost all parameters and activations.
    return transformer("d", TransformerShape(8, 1024, 8, 512, ffn=2816, gated=True, tied=False, bias=False), seq_len)


def test_rank_grid_keeps_tp_ranks_adjacent_and_t1_is_todays() -> None:
    assert groups(16, 2, "shard", tp=2)[:2] == [[0, 2], [1, 3]]  # shard group: ranks T apart
    assert groups(16, 2, "replicate", tp=2)[0] == [0, 4, 8, 12]  # replicate group: S x T apart
    assert groups(16, 4, "shard") == groups(16, 4, "shard", tp=1) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11],
                                                                      [12, 13, 14, 15]]
    assert Layout(2, 2, 2).data_parallel_size == 4 and Layout(2, 2, 2).label == "2x2x2"
    assert Layout(16, 8).label == "16x8" and Layout(16, 8).world_size == 128


def test_t1_rows_of_a_tp_plan_equal_the_plan_without_tp() -> None:
    model, cluster, options = _decoder(1024), _cluster(), TrainOptions(micro_batches=2)
    plain = make_plan(model, cluster, options)
    both = make_plan(model, cluster, options, tensor_parallel=(1, 2, 4))
    assert [e.layout.tp for e in plain.layouts] == [1] * 5  # S = 1..16
    assert [e for e in both.layouts if e.layout.tp == 1] == list(plain.layouts)
    # Inside a node, and over both nodes (S x T = 16: full shard + TP).
    assert {(e.layout.shard, e.layout.tp) for e in both.layouts if e.layout.tp > 1} == {(1, 2), (2, 2), (4, 2),
                                                                                        (8, 2), (1, 4), (2, 4),
                                                                                        (4, 4)}


@pytest.mark.parametrize("shard,tp", [(2, 2), (1, 4), (2, 4), (1, 8)])
def test_memory_per_rank_falls_as_one_over_t_for_a_block_model(shard: int, tp: int) -> None:
    options = TrainOptions()
    one = estimate_memory(_blocks(), shard, options)
    split = estimate_memory(_blocks(), shard, options, tp=tp)
    assert split.state == pytest.approx(one.state / tp, rel=1e-3)
    assert split.state == pytest.approx(16 * P / (shard * tp), rel=1e-3)
    assert split.unsharded == pytest.approx(one.unsharded / tp, rel=1e-3)


def test_activations_fall_by_t_with_sequence_parallel_and_the_root_stays_whole() -> None:
    model = _decoder()
    one, two = (estimate_memory(model, 1, TrainOptions(), tp=t).activations for t in (1, 2))
    root = model.root_activation_elements * TrainOptions().precision.compute_bytes
    assert two == pytest.approx((one - root) / 2 + root, rel=1e-9)
    whole = estimate_memory(replace(model, tensor_parallel_root=True), 1, TrainOptions(), tp=2)
    assert whole.activations == pytest.approx(one / 2, rel=1e-9) and whole.params < estimate_memory(
        model, 1, TrainOptions(), tp=2).params  # a vocabulary-parallel root splits its parameters too


def test_tp_traffic_is_on_the_critical_path_and_counted_inside_the_node() -> None:
    model, cluster, k, t = _blocks(), _cluster(), 2, 2
    options = TrainOptions(micro_batches=k)
    one = estimate_step(model, cluster, 4, options)
    two = estimate_step(model, cluster, 4, options, tp=t)
    assert one.tp_comm_s == 0 and two.tp_comm_s > 0
    # Per block and direction 2 all-gathers + 2 reduce-scatters of the activation; the root one each way.
    activation = model.tokens * model.hidden * B
    collectives = k * (2 * BLOCK_COLLECTIVES * len(model.blocks) + 2)
    per_call = cluster.collective_overhead + (t - 1) * cluster.intra_latency + (t - 1) / t * activation / 100e9
    assert two.tp_comm_s == pytest.approx(collectives * per_call, rel=1e-9)
    assert two.step_s >= two.compute_s + two.tp_comm_s and two.exposed_comm_s >= two.tp_comm_s
    assert two.compute_s == pytest.approx(one.compute_s / t, rel=1e-3)  # block FLOPs / T (no root FLOPs here)
    # Data-parallel bytes: those of the TP-local model (P / T) on the grid without the TP dimension.
    half = estimate_step(uniform("h", P // t, 8, seq_len=128, width=1024), _cluster(2, 8 // t), 4, options)
    assert two.rank_inter_bytes == pytest.approx(half.rank_inter_bytes, rel=1e-6)
    tp_bytes = collectives * (t - 1) / t * activation
    assert two.rank_wire_bytes == pytest.approx(half.rank_wire_bytes + tp_bytes, rel=1e-6)


def test_inter_node_bytes_stay_at_the_floor_per_node_with_tp() -> None:
    # 4 nodes x 8, S=4, T=2: R=4 replicas; every node still sends 2(R-1)/R x P x b per step.
    r = 4
    step = estimate_step(_blocks(), _cluster(4, 8), 4, TrainOptions(), tp=2)
    assert step.inter_node_bytes == pytest.approx(2 * (r - 1) / r * P * B, rel=1e-3)


def test_a_model_that_fits_only_with_tp_gets_tp_recommended() -> None:
    # Long sequences: activations dominate; at T=2 each rank keeps half of them (sequence parallel).
    model, options = _decoder(16384), TrainOptions(sync="every")
    cluster = _cluster(1, 2)
    smallest_t1 = min(estimate_layout(model, cluster, s, options).memory.total for s in (1, 2))
    t2 = estimate_layout(model, cluster, 1, options, tp=2).memory.total
    assert t2 < 0.7 * smallest_t1
    plan = make_plan(model, replace(cluster, gpu_memory=(t2 + smallest_t1) / 2), options, headroom=0.0,
                     tensor_parallel=(1, 2))
    assert not any(e.fits for e in plan.layouts if e.layout.tp == 1)
    assert plan.best is not None and (plan.best.layout.shard, plan.best.layout.tp) == (1, 2)
    assert any(r.startswith("Tensor parallel T=2 (hsdp.init_mesh(sharding_degree=1, tensor_parallel_degree=2)")
               for r in plan.reasons)
    plain = make_plan(model, replace(cluster, gpu_memory=(t2 + smallest_t1) / 2), options, headroom=0.0)
    assert plain.best is None and "--tp auto" in plain.reasons[0]  # the fix is named


def test_invalid_tp_degrees_are_refused_with_the_fix() -> None:
    model, cluster = _blocks(), _cluster(2, 8)
    with pytest.raises(ValueError, match=r"T=3 does not divide the 8 ranks per node.*choose T from \[1, 2, 4, 8\]"):
        estimate_step(model, cluster, 1, TrainOptions(), tp=3)
    with pytest.raises(ValueError, match=r"S x T = 16 x 2 does not divide the world size 16.*choose S from "
                                         r"\[1, 2, 4, 8\]"):
        estimate_layout(model, cluster, 16, TrainOptions(), tp=2)
    with pytest.raises(ValueError, match="choose T from"):
        make_plan(model, cluster, TrainOptions(), tensor_parallel=(3,))
    with pytest.raises(ValueError, match=r"no shard degree of \[16\] gives shard groups inside a node or over whole "
                                         r"nodes at T=2"):
        make_plan(model, cluster, TrainOptions(), degrees=[16], tensor_parallel=(2,))
    with pytest.raises(ValueError, match="hidden size"):
        estimate_step(replace(model, hidden=0), cluster, 1, TrainOptions(), tp=2)


def test_data_parallel_size_is_r_times_s_and_the_global_batch_is_held() -> None:
    model, cluster, k = _decoder(1024), _cluster(2, 8), 3
    plan = make_plan(model, cluster, TrainOptions(micro_batches=k), tensor_parallel=(1, 2, 4, 8))
    for e in plan.layouts:
        assert e.global_batch == model.micro_batch * k * cluster.world_size  # the same for every layout
        per_rank = e.global_batch // e.layout.data_parallel_size  # sequences per data-parallel rank per step
        assert per_rank == model.micro_batch * e.micro_batches == model.micro_batch * k * e.layout.tp
        assert e.tokens_per_s == pytest.approx(e.global_batch * model.seq_len / e.step.step_s)


def test_hsdp_plan_tp_flag_shows_t_and_refuses_bad_values(capsys: pytest.CaptureFixture) -> None:
    args = ["plan", "--model", "7b", "--nodes", "2", "--seq-len", "1024"]
    assert main([*args, "--tp", "auto"]) == 0
    out = capsys.readouterr().out
    assert "┃ T ┃" in out and "2x4x2" in out and "Tensor parallel" in out
    assert main([*args, "--tp", "3"]) == 2
    assert "T=3 does not divide the 8 ranks per node" in capsys.readouterr().err


def test_a_tp_layout_whose_shard_groups_span_two_nodes_is_priced_like_shard_over_nodes() -> None:
    # 4 nodes x 4, S=4, T=2: a replica's S x T = 8 ranks fill 2 nodes, its T shard rings (ranks T apart) cross
    # between them. The same as the TP-local model (P / T) at T = 1 on nodes of 4 / T ranks with 1 / T of the
    # node link ("HSDP, shard > node"): per rank the same bytes leave the node, per node T times as many.
    t, options, model = 2, TrainOptions(sync="every"), _blocks()
    cluster = ClusterSpec(4, 4, math.inf, 100e9, 10e9, 1e14)
    assert estimate_layout(model, cluster, 4, options, tp=t).kind == "HSDP + TP, shard > node"
    spans = estimate_step(model, cluster, 4, options, tp=t)
    per_node = replace(cluster, gpus_per_node=4 // t, inter_bandwidth=cluster.inter_bandwidth / t)
    local = uniform("h", P // t, 8, seq_len=128, width=1024)
    assert estimate_layout(local, per_node, 4, options).kind == "HSDP, shard > node"
    plain = estimate_step(local, per_node, 4, options)
    assert spans.rank_inter_bytes == pytest.approx(plain.rank_inter_bytes, rel=1e-6)
    assert spans.inter_node_bytes == pytest.approx(t * plain.inter_node_bytes, rel=1e-6)
    # Its shard all-gathers hold the node link; with S x T = node (S=2) only the replicate hop does.
    block = unit_costs(model, cluster, 4, options, tp=t)[1]
    assert block.all_gather.link_s > 0 and block.reduce_scatter.link_s > 0
    assert unit_costs(model, cluster, 2, options, tp=t)[1].all_gather.link_s == 0
    assert spans.inter_node_bytes > 1.5 * estimate_step(model, cluster, 2, options, tp=t).inter_node_bytes


def test_layouts_whose_shard_groups_straddle_nodes_partially_are_left_out() -> None:
    cluster = _cluster(3, 8)  # world 24: S x T = 6 or 12 divides it, yet neither divides 8 nor is a multiple of it
    assert shard_degrees(cluster, 2) == [1, 2, 4, 12] and shard_degrees(cluster, 4) == [1, 2, 6]
    with pytest.raises(ValueError, match=r"S x T = 3 x 2 = 6 .*straddle nodes partially: choose S from "
                                         r"\[1, 2, 4, 12\]"):
        estimate_step(_blocks(), cluster, 3, TrainOptions(), tp=2)
    plan = make_plan(_blocks(), cluster, TrainOptions(), tensor_parallel=(2, 4))
    assert [e.layout.label for e in plan.layouts] == ["12x1x2", "6x2x2", "3x4x2", "1x12x2", "6x1x4", "3x2x4",
                                                     "1x6x4"]


def test_70b_on_16_h100_nodes_fits_without_checkpointing_only_with_tp_over_whole_nodes() -> None:
    # docs/planner.md "When tensor parallelism pays". Every T = 1 layout keeps a whole sequence's activations
    # (over 100 GiB); inside a node every T > 1 layout keeps state >= 16 B x P / 8 per GPU: only shard groups
    # spanning nodes fit, and of those the plan picks T=2 over all 128 GPUs (fewest micro-batches and TP
    # collectives; the global batch is held, so T=8 runs 8 micro-batches that each gather across nodes).
    args = ["plan", "--model", "70b", "--nodes", "16", "--gpu", "h100", "--inter-node-bandwidth", "8xib400"]
    plan = build_plan(build_parser().parse_args([*args, "--tp", "auto"]))
    assert not any(e.fits for e in plan.layouts if e.layout.tp == 1)
    assert [e for e in plan.layouts if e.fits] and all(e.layout.shard * e.layout.tp > 8
                                                        for e in plan.layouts if e.fits)
    assert plan.best is not None and plan.best.layout == Layout(1, 64, 2) and plan.best.kind == "full shard + TP"
    assert any("hsdp.init_mesh(sharding_degree=64, tensor_parallel_degree=2, allow_cross_node_shards=True)" in r
               for r in plan.reasons)
    # With activation checkpointing full sharding fits at T = 1 and beats the TP layout with the same memory.
    checkpointed = build_plan(build_parser().parse_args([*args, "--tp", "auto", "--degrees", "64,128",
                                                         "--activation-checkpointing"]))
    assert checkpointed.best is not None and checkpointed.best.layout == Layout(1, 128)
    assert checkpointed.layout(64, tp=2).fits
