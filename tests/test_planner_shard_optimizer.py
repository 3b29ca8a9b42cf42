"""The planner with ``shard_optimizer_across_replicas``: closed forms for memory, inter-node bytes and the
optimizer step, the int8 hop's reduce-scatter, and when the recommendation uses the option.

Pure arithmetic and in-process ``hsdp plan``: no processes. ``P`` parameters, ``R`` replicas, ``S`` shards.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from hsdp.apps.cli import main
from hsdp.tools.planner.cluster import ClusterSpec
from hsdp.tools.planner.cost import estimate_step
from hsdp.tools.planner.memory import estimate_memory
from hsdp.tools.planner.model import ModelSpec, UnitSpec, uniform
from hsdp.tools.planner.options import PRECISIONS, TrainOptions
from hsdp.tools.planner.plan import make_plan

P = 64 * 1024 * 1024  # divisible by every degree below: no padding
SLICED = TrainOptions(shard_optimizer_across_replicas=True)


def _cluster(nodes: int, gpus: int, **kw: float) -> ClusterSpec:
    return ClusterSpec(nodes, gpus, math.inf, 100e9, 10e9, 1e14, **kw)


def _model() -> ModelSpec:
    return uniform("u", P, 8, seq_len=128, width=1024)


@pytest.mark.parametrize("nodes,gpus", [(2, 8), (4, 8), (16, 8), (3, 2)])
def test_state_falls_to_params_over_s_plus_the_rest_over_r_x_s(nodes: int, gpus: int) -> None:
    r, s = nodes, gpus
    tensors = sum(u.tensors for u in _model().units)
    plain = estimate_memory(_model(), s, TrainOptions(), replicate=r)
    sliced = estimate_memory(_model(), s, SLICED, replicate=r)
    assert plain.state == 16 * P / s + 4 * tensors  # AdamW's `step` scalar per tensor
    # R=3 does not divide the rows: a slice is ceil(rows / R) rows, a little padding.
    assert sliced.params == 4 * P / s and sliced.grads == pytest.approx(4 * P / (r * s), rel=1e-3)
    assert sliced.optimizer == pytest.approx(8 * P / (r * s) + 4 * tensors, rel=1e-3)
    # After the step two units' all-gathers across replicas are in flight (of the 8 equal blocks: a quarter of
    # the model), each (R + 1) slices, fp32.
    assert sliced.refresh == pytest.approx((r + 1) * 4 * (P / 4) / (r * s), rel=1e-3)
    assert estimate_memory(_model(), s, SLICED, replicate=1) == estimate_memory(_model(), s, TrainOptions())


def test_slices_count_both_paddings_on_the_largest_rank() -> None:
    # 5 rows on S=2: chunks of 3; on R=2 slices of ceil(3/2) = 2 rows, as the engine's replica_slice.py pads.
    model = ModelSpec("odd", (UnitSpec("root", ((5, 7),)),))
    m = estimate_memory(model, 2, replace(SLICED, precision=PRECISIONS["bf16-master"]), replicate=2)
    assert (m.params, m.grads, m.master, m.optimizer) == (3 * 7 * 2, 2 * 7 * 2, 2 * 7 * 4, 2 * 7 * 8 + 4)


@pytest.mark.parametrize("nodes,gpus,k", [(2, 8, 1), (4, 8, 4), (3, 2, 2)])
def test_inter_node_bytes_stay_at_the_all_reduce_floor_in_fp32(nodes: int, gpus: int, k: int) -> None:
    r = nodes
    floor = 2 * (r - 1) / r * P * 4
    step = estimate_step(_model(), _cluster(nodes, gpus), gpus, replace(SLICED, micro_batches=k))
    assert step.inter_node_bytes == pytest.approx(floor, rel=1e-3)  # reduce-scatter + all-gather, once per step


def test_bf16_hop_pays_the_all_gather_in_the_parameter_dtype() -> None:
    # bf16 compute and reductions over fp32 shards: the reduce-scatter is bf16, the refresh fp32.
    r, k, cluster = 4, 3, _cluster(4, 8)
    bf16 = TrainOptions(PRECISIONS["bf16"], micro_batches=k)
    plain = estimate_step(_model(), cluster, 8, bf16).inter_node_bytes
    sliced = estimate_step(_model(), cluster, 8, replace(bf16, shard_optimizer_across_replicas=True))
    assert plain == pytest.approx(2 * (r - 1) / r * P * 2, rel=1e-3)
    assert sliced.inter_node_bytes == pytest.approx((r - 1) / r * P * (2 + 4), rel=1e-3)
    every = estimate_step(_model(), cluster, 8, replace(bf16, shard_optimizer_across_replicas=True, sync="every"))
    assert every.inter_node_bytes == pytest.approx((r - 1) / r * P * (k * 2 + 4), rel=1e-3)


def test_optimizer_step_is_one_rth_and_r_1_changes_nothing() -> None:
    cluster = _cluster(4, 8, optimizer_s_per_element=1e-9)
    plain = estimate_step(_model(), cluster, 8, TrainOptions())
    sliced = estimate_step(_model(), cluster, 8, SLICED)
    assert sliced.optimizer_s == pytest.approx(plain.optimizer_s / 4)
    one = _cluster(1, 8, optimizer_s_per_element=1e-9)
    assert estimate_step(_model(), one, 8, SLICED) == estimate_step(_model(), one, 8, TrainOptions())


def test_int8_hop_reduce_scatters_int8_blocks_with_the_option() -> None:
    # The int8 hop's reduce-scatter is an all-to-all of int8 blocks, one fp32 scale per 256, whatever R (its
    # all-gathering form grows with R); the refresh after the step is the fp32 parameters'.
    r, cluster = 4, replace(_cluster(4, 8), gpu_memory=80 * 2**30)
    int8 = TrainOptions(replicate_dtype="int8", shard_optimizer_across_replicas=True)
    step = estimate_step(_model(), cluster, 8, int8)
    assert step.inter_node_bytes == pytest.approx((r - 1) / r * P * (1 + 4 / 256 + 4), rel=1e-3)
    plan = make_plan(_model(), cluster, TrainOptions(replicate_dtype="int8"), shard_optimizer="on")
    assert all(e.shard_optimizer for e in plan.layouts if e.layout.replicate > 1)


H100_70B = ["plan", "--model", "70b", "--nodes", "64", "--gpus-per-node", "8", "--gpu", "h100",
            "--inter-node-bandwidth", "8xib400", "--activation-checkpointing", "--degrees", "4,8,32,64"]


def test_plan_uses_the_option_when_it_lets_the_node_layout_fit(capsys: pytest.CaptureFixture) -> None:
    # 70B, one micro-batch: S=8 holds 128 GiB of state without the option, 34 GiB with it; it then ties the
    # fastest with less inter-node traffic than the layouts whose shard groups span nodes.
    assert main([*H100_70B, "--json", "-"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["recommended"] == {"replicate": 64, "shard": 8, "tensor_parallel": 1,
                                   "shard_optimizer_across_replicas": True}
    s8 = next(e for e in plan["layouts"] if e["shard"] == 8)
    plain = next(e for e in plan["alternatives"] if e["shard"] == 8)
    assert s8["fits"] and not plain["fits"] and not plain["shard_optimizer_across_replicas"]
    assert s8["memory_bytes"]["state"] < 0.3 * plain["memory_bytes"]["state"]
    assert main(H100_70B) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "Recommended: 64x8 (S=8, HSDP, shard = node, optimizer sharded across replicas)" in text
    assert "1/512 (R x S)" in text and "parallel.shard_optimizer_across_replicas = true" in text
    assert "without it this layout needs 143.6 GiB, over the 72.0 GiB usable" in text
    assert main([*H100_70B, "--shard-optimizer-across-replicas", "off", "--json", "-"]) == 0
    off = json.loads(capsys.readouterr().out)
    assert off["recommended"]["shard"] > 8 and not off["alternatives"]


def test_ties_go_to_the_plainer_setting(capsys: pytest.CaptureFixture) -> None:
    # 7B on 16 x 8 at 50 GB/s: the option fits everywhere but, with the bf16 hop, sends 1.5x the bytes.
    args = ["plan", "--model", "7b", "--nodes", "16", "--gpu-memory", "80GiB", "--inter-node-bandwidth", "50GB/s",
            "--micro-batches", "4"]
    assert main([*args, "--json", "-"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["recommended"] == {"replicate": 16, "shard": 8, "tensor_parallel": 1,
                                   "shard_optimizer_across_replicas": False}
    sliced = next(e for e in plan["alternatives"] if e["shard"] == 8)
    assert sliced["fits"] and sliced["step"]["inter_node_bytes"] > 1.4 * plan["layouts"][3]["step"]["inter_node_bytes"]
    assert any("would give model state" in r and "not used: slower here" in r for r in plan["reasons"])
