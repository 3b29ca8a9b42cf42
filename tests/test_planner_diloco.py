"""The planner's DiLoCo estimate (``hsdp plan --diloco-every H``) against the closed forms, and the CLI's output.

Pure arithmetic and in-process ``hsdp plan``: no processes. ``P`` parameters (no padding at these degrees), ``R``
replicas, ``S`` = ranks per node, wire bytes ``w``: a sync sends ``2(R-1)/R x P x w`` per node, ``/ H`` per step.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from hsdp.apps.cli import main
from hsdp.tools.planner.cluster import ClusterSpec
from hsdp.tools.planner.cost import estimate_step
from hsdp.tools.planner.diloco import DiLoCoOptions, diloco_estimates, estimate_diloco, split_fragments, sync_costs
from hsdp.tools.planner.memory import estimate_memory
from hsdp.tools.planner.model import ModelSpec, uniform
from hsdp.tools.planner.options import TrainOptions
from hsdp.tools.planner.plan import estimate_layout, make_plan

P = 64 * 1024 * 1024


def _cluster(nodes: int, gpus: int, **kw: float) -> ClusterSpec:
    return ClusterSpec(nodes, gpus, math.inf, 100e9, 10e9, 1e14, **kw)


def _model() -> ModelSpec:
    return uniform("u", P, 8, seq_len=128, width=1024)


@pytest.mark.parametrize("nodes,gpus,every,wire,w", [(2, 8, 40, "fp32", 4), (4, 8, 10, "bf16", 2),
                                                     (16, 8, 1, "fp32", 4), (3, 2, 7, "bf16", 2)])
def test_a_sync_sends_the_model_once_and_a_step_one_hth_of_it(nodes: int, gpus: int, every: int, wire: str,
                                                              w: int) -> None:
    cluster, model = _cluster(nodes, gpus), _model()
    plain = estimate_layout(model, cluster, gpus, TrainOptions())
    d = estimate_diloco(plain, model, cluster, TrainOptions(), DiLoCoOptions(every, wire))
    r = nodes
    (sync,) = d.syncs
    assert sync.node_bytes == d.sync_bytes == pytest.approx(2 * (r - 1) / r * P * w, rel=1e-12)
    assert d.inter_node_bytes == pytest.approx(2 * (r - 1) / r * P * w / every, rel=1e-12)
    assert d.inner.inter_node_bytes == 0  # shard groups inside a node: nothing else crosses
    # Plain HSDP's fp32 hop every step: the same model bytes (plus one flag per tensor).
    assert plain.step.inter_node_bytes == pytest.approx(2 * (r - 1) / r * P * 4, rel=1e-5)
    assert d.mean_step_s == pytest.approx(d.inner.step_s + sync.seconds / every, rel=1e-12)
    assert d.sync_step_s == pytest.approx(d.inner.step_s + sync.seconds, rel=1e-12)
    assert d.tokens_per_s == pytest.approx(plain.global_batch * model.seq_len / d.mean_step_s, rel=1e-12)


@pytest.mark.parametrize("nodes", [2, 4])
def test_the_int8_wire_sends_int8_blocks_at_the_all_reduce_floor(nodes: int, capsys: pytest.CaptureFixture) -> None:
    # DiLoCo(wire_dtype=torch.int8): int8 blocks and one fp32 scale per 256; R = 2 all-gathers them, from R = 3 a
    # reduce-scatter and an all-gather: 2(R-1)/R x P x (1 + 4/256) either way, a quarter of fp32's whatever R.
    cluster, model, r = _cluster(nodes, 8), _model(), nodes
    plain = estimate_layout(model, cluster, 8, TrainOptions())
    d = estimate_diloco(plain, model, cluster, TrainOptions(), DiLoCoOptions(10, "int8"))
    fp32 = estimate_diloco(plain, model, cluster, TrainOptions(), DiLoCoOptions(10))
    assert d.sync_bytes == pytest.approx(2 * (r - 1) / r * P * (1 + 4 / 256), rel=1e-12)
    assert d.sync_bytes / fp32.sync_bytes == pytest.approx((1 + 4 / 256) / 4, rel=1e-12)  # 0.254
    assert main(["plan", "--model", "7b", "--nodes", str(nodes), "--inter-node-bandwidth", "10Gbit/s",
                 "--degrees", "8", "--diloco-every", "40", "--diloco-wire-dtype", "int8"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "(int8 pseudo-gradients)" in text and "all-gathered: 2(R-1)/R x P x (1 + 4/256)" in text
    assert "DiLoCo(every=40, wire_dtype=torch.int8)" in text and "parallel.diloco_wire_dtype=int8" in text


def test_the_sync_takes_its_bytes_over_the_link_and_the_outer_step() -> None:
    # No latency or per-call overhead: the all-reduces' time is the node's bytes over its inter-node rate, all of
    # it on the link; the outer step costs the optimizer's seconds per element over the rank's P / S elements.
    bare = {"intra_latency": 0.0, "inter_latency": 0.0, "collective_overhead": 0.0}
    cluster, model, r, s = _cluster(4, 8, optimizer_s_per_element=0.0, **bare), _model(), 4, 8
    (sync,) = sync_costs(model, cluster, s, DiLoCoOptions(5))
    assert sync.seconds == pytest.approx(2 * (r - 1) / r * P * 4 / 10e9, rel=1e-12)
    assert sync.link_s == pytest.approx(sync.seconds, rel=1e-12)
    slow_optimizer = replace(cluster, optimizer_s_per_element=1e-9)
    assert sync_costs(model, slow_optimizer, s, DiLoCoOptions(5))[0].seconds == pytest.approx(
        sync.seconds + 1e-9 * P / s, rel=1e-9)


def test_the_inner_step_is_the_step_without_the_hop() -> None:
    cluster, model, options = _cluster(4, 8), _model(), TrainOptions(micro_batches=3)
    plain = estimate_layout(model, cluster, 8, options)
    d = estimate_diloco(plain, model, cluster, options, DiLoCoOptions(40))
    hopless = estimate_step(model, cluster, 8, replace(options, inter_node_hop=False))
    assert d.inner == hopless and d.inner.step_s < plain.step.step_s
    hops = sum(1 for u in model.units if u.tensors)  # the hop of each unit with gradients, once per step (deferred)
    assert d.inner.collectives == plain.step.collectives - hops
    # Shard groups spanning nodes: their traffic still crosses every inner step.
    wide = estimate_diloco(estimate_layout(model, cluster, 16, options), model, cluster, options, DiLoCoOptions(40))
    assert wide.inner.inter_node_bytes > 0


def test_memory_adds_the_global_copy_and_the_outer_momentum() -> None:
    cluster, model = _cluster(4, 8), _model()
    sliced = TrainOptions(shard_optimizer_across_replicas=True)
    plain = estimate_layout(model, cluster, 8, sliced)  # DiLoCo refuses the option: its state is the plain one's
    state = estimate_memory(model, 8, TrainOptions(), replicate=4).state
    assert estimate_diloco(plain, model, cluster, sliced, DiLoCoOptions(40)).state_bytes == pytest.approx(
        state + 8 * P / 8)
    no_momentum = DiLoCoOptions(40, outer_momentum=False)
    assert estimate_diloco(plain, model, cluster, sliced, no_momentum).state_bytes == pytest.approx(state + 4 * P / 8)
    limit = estimate_memory(model, 8, TrainOptions(), replicate=4).total + 6 * P / 8  # plain fits, DiLoCo does not
    assert not estimate_diloco(plain, model, cluster, sliced, DiLoCoOptions(40), memory_limit=limit).fits


def test_only_layouts_with_replicas_are_estimated_and_bad_options_refused() -> None:
    cluster, model = _cluster(4, 8), _model()
    plan = make_plan(model, cluster, TrainOptions(), degrees=[8, 16, 32])
    estimates = diloco_estimates(plan.layouts, model, cluster, plan.options, DiLoCoOptions(4))
    assert [d.plain.layout.label for d in estimates] == ["4x8", "2x16"]  # 1x32 has nothing to sync
    with pytest.raises(ValueError, match="--diloco-every 0: give the inner steps between syncs"):
        DiLoCoOptions(0)
    with pytest.raises(ValueError, match="--diloco-wire-dtype 'fp16': choose one of"):
        DiLoCoOptions(4, "fp16")
    with pytest.raises(ValueError, match="turn shard_optimizer_across_replicas off"):
        TrainOptions(shard_optimizer_across_replicas=True, inter_node_hop=False)


ARGS = ["plan", "--model", "7b", "--nodes", "4", "--inter-node-bandwidth", "10Gbit/s", "--precision", "fp32",
        "--degrees", "4,8,32"]


def test_plan_prints_diloco_next_to_plain_hsdp(capsys: pytest.CaptureFixture) -> None:
    assert main([*ARGS, "--diloco-every", "40", "--diloco-wire-dtype", "bf16"]) == 0
    out = capsys.readouterr().out
    text = " ".join(out.split())
    assert "DiLoCo every H=40 steps (bf16 pseudo-gradients) next to plain HSDP: not DDP's math" in text
    assert "DiLoCo is not DDP's math" in text and "compare the held-out loss at equal tokens" in text
    rows = [line for line in out.splitlines() if line.startswith("│") and "x" in line.split("│")[1]]
    diloco = [r for r in rows if r.count("│") == 15]  # the DiLoCo table's rows (14 columns; the plan's 11)
    assert [r.split("│")[1].strip() for r in diloco] == ["8x4", "* 4x8"]  # 1x32: one replica, no row
    assert "On the recommended 4x8" in text and "hsdp train parallel.replica_sync=diloco parallel.diloco_every=40 " \
                                                "parallel.diloco_wire_dtype=bf16" in text
    assert "replica_sync=hsdp.DiLoCo(every=40, wire_dtype=torch.bfloat16)" in text
    assert main([*ARGS, "--diloco-every", "40", "--diloco-wire-dtype", "bf16", "--json", "-"]) == 0
    plan = json.loads(capsys.readouterr().out)
    d = plan["diloco"]
    assert (d["every"], d["wire_dtype"], "not DDP's math" in d["note"]) == (40, "bf16", True)
    params = plan["model"]["params"]
    s8 = next(e for e in d["layouts"] if e["shard"] == 8)
    # Padded rows: a little over the closed form.
    assert 2 * 3 / 4 * params * 2 <= s8["inter_node_bytes_per_sync"] < 1.001 * 2 * 3 / 4 * params * 2
    assert s8["inter_node_bytes_per_step"] == pytest.approx(s8["inter_node_bytes_per_sync"] / 40)
    assert s8["speedup"] > 1 and s8["mean_step_s"] < s8["plain_step_s"]


def test_plan_refuses_bad_diloco_flags(capsys: pytest.CaptureFixture) -> None:
    assert main([*ARGS, "--diloco-every", "0"]) == 2
    assert "--diloco-every 0: give the inner steps between syncs" in capsys.readouterr().err
    assert main(["plan", "--model", "7b", "--nodes", "2x8:h100,2x8:a100-40gb", "--diloco-every", "4"]) == 2
    assert "does not take --diloco-every" in capsys.readouterr().err


def test_streaming_splits_the_sync_and_hides_it_behind_the_delay() -> None:
    model, r, s = _model(), 4, 8  # eight equal blocks with parameters (the root has none)
    assert split_fragments([4, 4, 4, 4], 2) == [range(0, 2), range(2, 4)]
    assert split_fragments([1, 1, 6], 2) == [range(0, 2), range(2, 3)]
    cluster = _cluster(r, 8)
    plain = estimate_layout(model, cluster, s, TrainOptions())
    whole = estimate_diloco(plain, model, cluster, TrainOptions(), DiLoCoOptions(8))
    four = estimate_diloco(plain, model, cluster, TrainOptions(), DiLoCoOptions(8, fragments=4))
    assert [f.node_bytes for f in four.syncs] == pytest.approx([2 * (r - 1) / r * P * 4 / 4] * 4, rel=1e-12)
    assert four.sync_bytes == pytest.approx(whole.sync_bytes, rel=1e-12)
    assert four.inter_node_bytes == pytest.approx(whole.inter_node_bytes, rel=1e-12)  # the same bytes per H
    assert four.sync_step_s < whole.sync_step_s  # a quarter of the model at a time
    assert four.waits == pytest.approx([f.comm_s + f.outer_s for f in four.syncs], rel=1e-12)
    # Behind tau inner steps only what is left of the transfer is waited for (here nothing on the fast link).
    fast_cluster = replace(cluster, inter_bandwidth=1e13)
    fast_plain = estimate_layout(model, fast_cluster, s, TrainOptions())
    fast = estimate_diloco(fast_plain, model, fast_cluster, TrainOptions(), DiLoCoOptions(8, fragments=4, delay=1))
    assert all(0 < f.comm_s < fast.inner.step_s for f in fast.syncs)
    assert fast.waits == pytest.approx([f.outer_s for f in fast.syncs], rel=1e-12)
    slow_cluster = replace(cluster, inter_bandwidth=0.125e9)  # 1 Gbit/s per node: the transfer outlasts a step
    slow_plain = estimate_layout(model, slow_cluster, s, TrainOptions())
    slow = estimate_diloco(slow_plain, model, slow_cluster, TrainOptions(), DiLoCoOptions(8, fragments=4, delay=1))
    assert all(f.comm_s > slow.inner.step_s for f in slow.syncs)
    assert slow.waits == pytest.approx([f.comm_s - slow.inner.step_s + f.outer_s for f in slow.syncs], rel=1e-12)
    assert slow.mean_step_s == pytest.approx(slow.inner.step_s + sum(slow.waits) / 8, rel=1e-12)
    with pytest.raises(ValueError, match="has 8 units with parameters and each fragment needs one: use at most 8"):
        sync_costs(model, cluster, s, DiLoCoOptions(16, fragments=9))
    with pytest.raises(ValueError, match="--diloco-fragments 9: each fragment syncs at its own step of the 8"):
        DiLoCoOptions(8, fragments=9)
    with pytest.raises(ValueError, match="--diloco-delay 8: a fragment's update must land before its next sync"):
        DiLoCoOptions(8, delay=8)


def test_plan_prints_streaming_settings(capsys: pytest.CaptureFixture) -> None:
    assert main([*ARGS, "--diloco-every", "40", "--diloco-fragments", "4", "--diloco-delay", "2"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "DiLoCo every H=40 steps (fp32 pseudo-gradients, 4 fragments, delay 2)" in text
    assert "each of the 4 fragments' syncs adds at most" in text and "after running behind 2 inner steps" in text
    assert "hsdp.DiLoCo(every=40, fragments=4, delay=2)" in text
    assert "parallel.diloco_fragments=4 parallel.diloco_delay=2" in text
    assert main([*ARGS, "--diloco-fragments", "4"]) == 2
    assert "--diloco-fragments is read only with --diloco-every H" in capsys.readouterr().err
