"""``hsdp plan --nodes 2x8:h100,2x8:a100-40gb``: per node type the smallest shard degree that fits, batch weights
by peak speed, the sampler's split of the same global batch, tokens/s weighted against even from the cost model,
and the lines to paste (Python, and TOML that ``hsdp train``'s configuration reads back)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from hsdp.apps.cli import main
from hsdp.tools.planner.cost import estimate_step
from hsdp.tools.planner.hetero import (
    NodeGroup,
    at_micro_batch,
    candidate_degrees,
    make_hetero_plan,
    parse_node_groups,
    split_sizes,
    type_cluster,
)
from hsdp.tools.planner.hetero_render import paste_lines, weights_expression
from hsdp.tools.planner.memory import estimate_memory
from hsdp.tools.planner.options import TrainOptions, precision
from hsdp.tools.planner.presets import GPUS, model_preset

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

BF16_AC = TrainOptions(precision("bf16"), activation_checkpointing=True)
MIXED = "2x8:h100,2x8:a100-40gb"


def test_node_types_parse_with_aliases_and_a_default_gpu() -> None:
    assert parse_node_groups(MIXED) == [NodeGroup(2, 8, "h100"), NodeGroup(2, 8, "a100-40")]
    assert parse_node_groups("4x8:H100, 1x4", default_gpu="l40s") == [NodeGroup(4, 8, "h100"), NodeGroup(1, 4, "l40s")]
    assert candidate_degrees(NodeGroup(4, 8, "h100")) == [1, 2, 4, 8, 16, 32]  # inside a node, then whole nodes
    assert candidate_degrees(NodeGroup(3, 4, "a40")) == [1, 2, 4, 12]


@pytest.mark.parametrize(("text", "needle"), [
    ("2x8:h100,0x8:a40", "'0x8:a40' has 0 nodes of 8 GPUs"),
    ("2x0:h100", "both must be at least 1"),
    ("2x8:a100-4", "unknown GPU 'a100-4': use one of ['a100-40', 'a100-40gb'"),
    ("2x8h100", "write COUNTxGPUS:GPU"),
    ("8:h100", "write COUNTxGPUS:GPU"),
])
def test_bad_node_spellings_name_the_fix(text: str, needle: str) -> None:
    with pytest.raises(ValueError) as e:
        parse_node_groups(text)
    assert needle in str(e.value)


def test_split_is_the_samplers_largest_remainder() -> None:
    from hsdp.data.weighted_sampler import split_sizes as sampler_split

    for weights, batch in [([3.17] * 16 + [1.0] * 16, 128), ([2.73] * 8 + [1.0] * 4, 48), ([1, 2, 3], 7),
                           ([0.1, 0.2, 0.7], 10), ([1.0] * 5, 13), ([4.5, 1.0], 2)]:
        assert split_sizes([float(w) for w in weights], batch) == sampler_split(weights, batch), (weights, batch)


def test_each_type_takes_the_smallest_degree_that_fits_and_weights_follow_peak_speed() -> None:
    model = model_preset("13b", micro_batch=4)
    plan = make_hetero_plan(model, parse_node_groups(MIXED), BF16_AC, 50e9)
    h100, a100 = plan.types
    assert plan.rank_weights == tuple([round(GPUS["h100"].peak_flops / GPUS["a100-40"].peak_flops, 2)] * 16
                                      + [1.0] * 16)
    assert plan.batch_sizes == tuple([6] * 16 + [2] * 16) and plan.global_batch == 4 * 32
    for t in plan.types:
        for split in (t.even, t.weighted):
            degrees = candidate_degrees(t.group)
            smaller = degrees[:degrees.index(split.shard)]
            spec = at_micro_batch(model, split.batch)
            assert split.fits and split.memory.total <= t.memory_limit
            assert all(estimate_memory(spec, s, BF16_AC).total > t.memory_limit for s in smaller), (t.group, split)
    # An 8 x 80 GB node holds two replicas of 4 at 6 sequences per rank; the 40 GB A100s need 8 at 2.
    assert (h100.weighted.shard, a100.weighted.shard) == (4, 8)
    assert plan.sharding_degrees == [4, 4, 4, 4, 8, 8]
    # Tokens/s: the cost model's step per type at its batch, the cluster paced by the slowest type.
    for t in plan.types:
        cluster = type_cluster(t.group, 32, t.weighted.shard, 50e9, 10e-6, 0.45)
        assert t.weighted.step_s == estimate_step(at_micro_batch(model, t.weighted.batch), cluster, t.weighted.shard,
                                                  BF16_AC).step_s
    assert plan.even_step_s == a100.even.step_s > h100.even.step_s  # the even split waits for the A100s
    assert plan.weighted_tokens_per_s == pytest.approx(128 * 4096 / max(h100.weighted.step_s, a100.weighted.step_s))
    assert 1.5 < plan.speedup < 3.17  # weighted is faster, never beyond the speed ratio


def test_one_gpu_type_gives_even_weights_and_no_speedup() -> None:
    plan = make_hetero_plan(model_preset("1.3b", micro_batch=2), parse_node_groups("1x8:h100,1x4:h100"), BF16_AC, 50e9)
    assert set(plan.rank_weights) == {1.0} and set(plan.batch_sizes) == {2} and plan.speedup == pytest.approx(1.0)


def test_activations_scale_with_the_micro_batch() -> None:
    one, four = model_preset("7b", micro_batch=1), model_preset("7b", micro_batch=4)
    scaled = at_micro_batch(one, 4)
    assert scaled.activation_elements == pytest.approx(four.activation_elements)
    assert scaled.checkpoint_elements == pytest.approx(four.checkpoint_elements) and scaled.tokens == four.tokens


def test_a_batch_too_small_to_weight_names_the_micro_batch() -> None:
    with pytest.raises(ValueError, match="pass --micro-batch 2 or more"):
        make_hetero_plan(model_preset("7b"), parse_node_groups(MIXED), BF16_AC, 50e9)


def test_paste_lines_are_python_and_toml_that_hsdp_train_reads() -> None:
    from hsdp.apps.train.config_io import build_config

    plan = make_hetero_plan(model_preset("13b", micro_batch=4), parse_node_groups(MIXED), BF16_AC, 50e9)
    lines = paste_lines(plan)
    assert lines["python"][0] == "mesh = hsdp.init_mesh(sharding_degree=[4, 4, 4, 4, 8, 8])"
    assert "weights=[3.17] * 16 + [1.0] * 16, batch_size=128, model=model)" in lines["python"][1]
    assert eval(weights_expression(plan.rank_weights)) == list(plan.rank_weights)
    table = tomllib.loads("\n".join(lines["toml"]))
    assert table["parallel"]["batch_weights"] == list(plan.rank_weights)
    config = build_config({**table, "parallel": {**table["parallel"], "nodes": 4, "nproc_per_node": 8}})
    assert config.parallel.sharding_degree == (4, 4, 4, 4, 8, 8)
    assert config.parallel.batch_weights == plan.rank_weights and config.train.batch_size == 4


def test_cli_prints_the_plan_and_its_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "hetero.json"
    assert main(["plan", "--model", "13b", "--nodes", MIXED, "--micro-batch", "4", "--precision", "bf16",
                 "--activation-checkpointing", "--inter-node-bandwidth", "50GB/s", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "hsdp.init_mesh(sharding_degree=[4, 4, 4, 4, 8, 8])" in text and "batch_weights = [3.17, " in text
    assert "paced by the 2x8:a100-40 ranks" in text
    data = json.loads(out.read_text())
    assert data["sharding_degree"] == [4, 4, 4, 4, 8, 8] and data["global_batch"] == 128
    assert data["weighted"]["tokens_per_s"] > data["even"]["tokens_per_s"] and data["paste"]["toml"][0] == "[parallel]"
    assert [t["weighted"]["sharding_degree"] for t in data["node_types"]] == [4, 8]


def test_cli_one_type_is_the_uniform_plan_and_bad_options_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", "7b", "--nodes", "2x8:a40", "--json", "-"]) == 0
    typed = json.loads(capsys.readouterr().out)
    assert main(["plan", "--model", "7b", "--nodes", "2", "--gpus-per-node", "8", "--gpu", "a40", "--json", "-"]) == 0
    assert json.loads(capsys.readouterr().out) == typed
    for extra, needle in [(["--gpu-memory", "40GiB"], "does not take --gpu-memory"), (["--tp", "2"], "--tp"),
                          (["--gpus-per-node", "4"], "--gpus-per-node"), ([], "pass --micro-batch 2")]:
        assert main(["plan", "--model", "7b", "--nodes", MIXED, *extra]) == 2
        assert needle in capsys.readouterr().err
    assert main(["plan", "--model", "7b", "--nodes", "2x8:a40", "--gpus-per-node", "4"]) == 2
    assert "drop one" in capsys.readouterr().err
    assert main(["plan", "--model", "7b", "--nodes", "two"]) == 2
    assert "COUNTxGPUS:GPU" in capsys.readouterr().err
