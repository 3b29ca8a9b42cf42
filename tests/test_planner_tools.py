"""The planner's tools: units, presets, recommendation, calibration, `hsdp plan` and `hsdp tune --from-metrics`.

No processes: tuning is exercised on metrics files synthesised from a known cluster, so the test knows the
constants the calibration has to find.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from hsdp.apps.cli import main
from hsdp.tools.planner.calibrate import Measurement, calibrate, leave_one_out
from hsdp.tools.planner.cluster import ClusterSpec
from hsdp.tools.planner.compare import analyse, emulated_cluster
from hsdp.tools.planner.cost import estimate_step
from hsdp.tools.planner.memory import estimate_memory
from hsdp.tools.planner.model import ComputeProfile
from hsdp.tools.planner.options import TrainOptions
from hsdp.tools.planner.plan import make_plan
from hsdp.tools.planner.presets import inter_link, model_preset
from hsdp.tools.planner.render import recommendation_line, tune_rows
from hsdp.tools.planner.tune import TuneRun, launch_command, load_metrics, summarise
from hsdp.tools.quantities import parse_bandwidth, parse_bytes, parse_duration, parse_flops

GiB = 2**30


@pytest.mark.parametrize("text,value", [("450GB/s", 450e9), ("1gbit", 125e6), ("400Gb/s", 50e9),
                                        ("100mbit", 12.5e6), ("25GiB/s", 25 * GiB)])
def test_bandwidth_reads_bits_and_bytes(text: str, value: float) -> None:
    assert parse_bandwidth(text) == pytest.approx(value)


def test_units_refuse_ambiguous_spellings() -> None:
    assert parse_bytes("80GiB") == 80 * GiB and parse_bytes("40GB") == 40e9
    assert parse_duration("5us") == pytest.approx(5e-6) and parse_flops("312TFLOPS") == pytest.approx(312e12)
    with pytest.raises(ValueError, match="bits"):
        parse_bandwidth("450")  # bytes or bits? refused
    with pytest.raises(ValueError, match="end the unit with 'B'"):
        parse_bytes("80Gi")


def test_presets_count_the_published_sizes() -> None:
    assert model_preset("7b").params == pytest.approx(6.74e9, rel=0.01)
    assert model_preset("13b").params == pytest.approx(13.0e9, rel=0.01)
    assert model_preset("70b").params == pytest.approx(69.0e9, rel=0.01)
    assert model_preset("125m").params == pytest.approx(125e6, rel=0.02)
    assert model_preset("gpt2-124m").params == 124475904  # the repo's GPT, counted by torch
    assert inter_link("8xib400").bandwidth == 8 * inter_link("ib400").bandwidth
    with pytest.raises(ValueError, match="use one of"):
        model_preset("7t")


def _h100(nodes: int = 16) -> ClusterSpec:
    return ClusterSpec(nodes, 8, 80 * GiB, 450e9, 50e9, 445e12, 3e-6, 5e-6)


def test_plan_recommends_the_fastest_layout_that_fits() -> None:
    plan = make_plan(model_preset("7b"), _h100(), TrainOptions(micro_batches=4))
    fitting = [e for e in plan.layouts if e.fits]
    assert plan.best is not None and plan.best in fitting
    assert plan.best.step.step_s <= min(e.step.step_s for e in fitting) * 1.01
    assert not plan.layout(1).fits  # DDP: 16 B x 6.7B params does not fit in 80 GiB
    assert plan.best.layout.shard == 8  # shard = node: the hop is the only inter-node traffic
    assert any("Does not fit" in r for r in plan.reasons) and plan.reasons[0].startswith("Recommended")


def test_plan_says_when_nothing_fits_and_rejects_bad_degrees() -> None:
    plan = make_plan(model_preset("70b"), replace(_h100(1), gpu_memory=40 * GiB), TrainOptions())
    assert plan.best is None and plan.reasons[0].startswith("No layout fits")
    with pytest.raises(ValueError, match="choose from"):
        make_plan(model_preset("7b"), _h100(), TrainOptions(), degrees=[3])


def test_activation_checkpointing_trades_compute_for_memory() -> None:
    model = model_preset("13b")
    base = estimate_layout_pair(model, TrainOptions())
    ckpt = estimate_layout_pair(model, TrainOptions(activation_checkpointing=True))
    assert ckpt[0] < base[0] and ckpt[1] > base[1]


def estimate_layout_pair(model, options: TrainOptions) -> tuple[float, float]:
    return (estimate_memory(model, 8, options).total, estimate_step(model, _h100(), 8, options).step_s)


def _truth() -> tuple[ClusterSpec, ComputeProfile]:
    cluster = emulated_cluster(2, 2, "1gbit")
    true = replace(cluster, intra_bandwidth=90e6, inter_bandwidth=110e6, collective_overhead=2.5e-3,
                   host_s_per_intra_byte=1e-9, host_s_per_inter_byte=4e-9)
    return true, ComputeProfile(0.12, 0.2, 1.2e-8)


def test_calibration_recovers_step_times_of_a_known_cluster() -> None:
    true, profile = _truth()
    model = model_preset("small", 128, 2)
    options = TrainOptions()
    data = [Measurement(s, estimate_step(model, true, s, options, profile).step_s) for s in (1, 2, 4)]
    nominal = emulated_cluster(2, 2, "1gbit")
    cal = calibrate(model, nominal, options, data, profile)
    for m in data:
        assert cal.predict(model, m.shard, options) == pytest.approx(m.step_s, rel=0.02)
    for (shard, _), predicted in leave_one_out(model, nominal, options, data, profile).items():
        assert predicted == pytest.approx(data[shard.bit_length() - 1].step_s, rel=0.2)
    with pytest.raises(ValueError, match="at least one"):
        calibrate(model, nominal, options, [], profile)


def _metrics(shard: int, step_s: float, model_name: str = "small", sliced: bool = False) -> dict:
    spec = model_preset(model_name, 128, 2)
    options = TrainOptions(shard_optimizer_across_replicas=sliced)
    return {"format": "hsdp-metrics/1", "world_size": 4, "nproc_per_node": 2, "sharding_degree": shard,
            "micro_batches": 1, "step_s": [step_s * f for f in (0.98, 1.0, 1.03)], "median_step_s": step_s,
            "state_bytes": {"total": estimate_memory(spec, shard, options, replicate=4 // shard).state},
            "inter_node_bytes_per_step": [[1e6, 1e6], [1e6, 1e6]], "backend": "gloo",
            "model": {"name": spec.name, "seq_len": 128, "micro_batch": 2,
                      "units": [{"name": u.name, "shapes": [list(x) for x in u.shapes],
                                 "flops_per_token": u.forward_flops_per_token} for u in spec.units]},
            "profile": {"forward_s": 0.12, "backward_s": 0.2, "optimizer_s_per_element": 1.2e-8},
            "options": {"reshard_after_forward": True, "replicate_dtype": "fp32",
                        "shard_optimizer_across_replicas": sliced}}


def _synthetic_runs(tmp_path: Path, candidates: list[tuple[int, bool]] | None = None) -> Path:
    true, profile = _truth()
    model = model_preset("small", 128, 2)
    runs = tmp_path / "runs"
    runs.mkdir()
    for s, sliced in candidates or [(1, False), (2, False), (4, False)]:
        options = TrainOptions(shard_optimizer_across_replicas=sliced)
        step = estimate_step(model, true, s, options, profile).step_s
        (runs / f"s{s}{'_opt' if sliced else ''}.json").write_text(json.dumps(_metrics(s, step, sliced=sliced)))
    return runs


def test_tune_report_from_metrics_matches_and_recommends_the_fastest(tmp_path: Path) -> None:
    runs = _synthetic_runs(tmp_path)
    measured = summarise(load_metrics([runs]))
    # Only plain runs were measured: compare the plan over the same (the option is compared in the next test).
    report = analyse(measured, emulated_cluster(2, 2, "1gbit"), TrainOptions(), shard_optimizer="off")
    assert all(abs(r.error) < 0.02 for r in report.rows)
    assert report.recommended_shard == report.measured_fastest.shard
    assert all(r.measured_state_bytes == r.predicted_state_bytes for r in report.rows)


def test_tune_measures_the_option_where_r_is_above_one_and_predicts_each_run_with_its_setting(
        tmp_path: Path) -> None:
    auto = TuneRun(nodes=2, nproc_per_node=2)
    assert auto.candidates == [(1, False), (1, True), (2, False), (2, True), (4, False)]
    assert TuneRun(shard_optimizer="off").candidates == [(1, False), (2, False), (4, False)]
    with pytest.raises(ValueError, match="shard_optimizer"):
        TuneRun(shard_optimizer="maybe")
    # Two candidates keep it cheap (no leave-one-out fits): S=2 on 2 x 2 without and with the option.
    candidates = [(2, False), (2, True)]
    measured = summarise(load_metrics([_synthetic_runs(tmp_path, candidates)]))
    assert [m.key for m in measured.measurements] == candidates
    report = analyse(measured, emulated_cluster(2, 2, "1gbit"), TrainOptions())
    assert all(abs(r.error) < 0.02 for r in report.rows)
    assert all(r.measured_state_bytes == r.predicted_state_bytes for r in report.rows)
    plain, sliced = report.rows
    # AdamW in fp32 at R=2: 4 + 12/2 of 16 bytes per parameter, plus padding and `step` scalars.
    assert sliced.predicted_state_bytes == pytest.approx(10 / 16 * plain.predicted_state_bytes, rel=0.01)
    rows = tune_rows(report)
    assert [row[1] for row in rows] == ["1/2", "1/4 (R x S)"]
    assert "; measured fastest S=2" in recommendation_line(report)


def test_hsdp_tune_from_metrics_writes_results(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    runs, out = _synthetic_runs(tmp_path), tmp_path / "results"
    assert main(["tune", "--from-metrics", str(runs), "--out", str(out), "--tag", "t"]) == 0
    text = capsys.readouterr().out
    assert "predicted vs measured" in text and "recommended S=" in text
    md = next(out.glob("tune_*_t.md")).read_text()
    assert "Command: `hsdp tune" in md and next(out.glob("tune_*_t.png")).stat().st_size > 0
    data = json.loads(next(out.glob("tune_*_t.json")).read_text())
    assert len(data["runs"]) == 3 and data["report"]["recommended_shard"] in (1, 2, 4)


def test_hsdp_plan_json_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    args = ["plan", "--model", "7b", "--nodes", "16", "--gpus-per-node", "8", "--gpu-memory", "80GiB",
            "--intra-node-bandwidth", "450GB/s", "--inter-node-bandwidth", "50GB/s",
            "--shard-optimizer-across-replicas", "off"]
    assert main([*args, "--json", "-"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["recommended"] == {"replicate": 16, "shard": 8, "tensor_parallel": 1,
                                   "shard_optimizer_across_replicas": False}
    assert len(plan["layouts"]) == 8
    assert main([*args, "--plot", str(tmp_path / "p.png")]) == 0
    assert "Recommended" in capsys.readouterr().out and (tmp_path / "p.png").stat().st_size > 0
    assert main([*args, "--inter-node-bandwidth", "fast"]) == 2
    assert "neither a link preset nor a rate" in capsys.readouterr().err


def test_tune_launches_each_degree_through_hsdp_launch() -> None:
    run = TuneRun(nodes=2, nproc_per_node=2, bandwidth="100mbit")
    assert run.candidate_degrees == [1, 2, 4]
    cmd = launch_command(run, "stats.json")
    assert cmd[1:4] == ["-m", "hsdp", "launch"] and "--require-emulation" in cmd
    assert cmd[cmd.index("--") + 1:][:2] == ["-m", "hsdp.tools.planner.workload"]
    with pytest.raises(ValueError, match="choose from"):
        TuneRun(degrees=(3,))
    assert math.isinf(emulated_cluster(2, 2, "1gbit").gpu_memory)


def test_hsdp_plan_custom_shape_metrics_file_and_missing_model(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture) -> None:
    assert main(["plan", "--layers", "40", "--hidden", "5120", "--ffn", "13824", "--nodes", "4", "--json", "-"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["model"]["params"] == pytest.approx(model_preset("13b").params, rel=0.01)  # Llama-13B's shape
    runs = _synthetic_runs(tmp_path)
    assert main(["plan", "--metrics", str(runs / "s2.json"), "--nodes", "2", "--gpus-per-node", "2",
                 "--json", "-"]) == 0
    assert json.loads(capsys.readouterr().out)["model"]["params"] == model_preset("small").params
    assert main(["plan", "--nodes", "2"]) == 2
    assert "no model" in capsys.readouterr().err


def test_a_run_that_aborted_after_writing_its_metrics_is_kept_with_a_warning(tmp_path: Path) -> None:
    runs = load_metrics([_synthetic_runs(tmp_path)])
    runs[0]["warning"] = "exit -6 after the metrics were written"
    failed = {"sharding_degree": 4, "error": "exit 1; no metrics"}
    measured = summarise([*runs, failed])
    assert len(measured.measurements) == 3 and measured.warnings and measured.failures


H100_70B = ["plan", "--model", "70b", "--nodes", "64", "--gpus-per-node", "8", "--gpu", "h100",
            "--inter-node-bandwidth", "8xib400", "--micro-batches", "8"]


def test_hsdp_plan_breaks_ties_toward_the_smallest_shard_degree(capsys: pytest.CaptureFixture) -> None:
    # 70B on 64 x 8 H100: S=32..512 fit and all step within 1% of each other; S=64 is 0.01% faster.
    off = ["--shard-optimizer-across-replicas", "off"]
    assert main([*H100_70B, *off, "--activation-checkpointing", "--json", "-"]) == 0
    plan = json.loads(capsys.readouterr().out)
    fitting = [e for e in plan["layouts"] if e["fits"]]
    fastest = min(fitting, key=lambda e: e["step"]["step_s"])
    assert [e["shard"] for e in fitting] == [32, 64, 128, 256, 512] and fastest["shard"] == 64
    assert plan["recommended"] == {"replicate": 16, "shard": 32, "tensor_parallel": 1,
                                   "shard_optimizer_across_replicas": False}  # not 1x512
    assert main([*H100_70B, *off, "--activation-checkpointing"]) == 0
    text = " ".join(capsys.readouterr().out.split())  # undo the terminal's line wrapping
    assert "Recommended: 16x32 (S=32" in text and "8x64 (S=64, HSDP, shard > node) is 0.01% faster" in text
    assert "ties go to the least inter-node traffic (here the smallest shard degree that fits)" in text
    assert "Runner-up: 8x64 (S=64, HSDP, shard > node), tied at -0.01% step time" in text


def test_ties_below_a_node_go_to_the_node_and_on_one_node_to_less_memory() -> None:
    # 7B on 16 x 8 H100 with 8 NICs: S=4..128 all within 1%. S=4 would send more (the hop over 32 replicas)
    # and hold more; S=32 is fastest by 0.3% but sends 6x the bytes: S=8, the node, is the least traffic.
    fast = replace(_h100(), inter_bandwidth=inter_link("8xib400").bandwidth)
    plan = make_plan(model_preset("7b"), fast, TrainOptions(micro_batches=4), shard_optimizer="off")
    ties = [e for e in plan.layouts if e.fits and e.step.step_s <= min(
        x.step.step_s for x in plan.layouts if x.fits) * 1.01]
    assert {e.layout.shard for e in ties} >= {4, 8, 32, 128} and plan.best is not None
    assert plan.best.layout.shard == 8 and "ties go to the least inter-node traffic: " in plan.reasons[0]
    one_node = make_plan(model_preset("7b"), _h100(1), TrainOptions(micro_batches=4))  # R=1: nothing to shard
    assert one_node.best is not None and one_node.best.layout.shard == 8  # nothing crosses: least memory


def test_no_fit_advice_names_only_settings_that_can_still_shrink(capsys: pytest.CaptureFixture) -> None:
    assert main(H100_70B) == 0  # a plan, even though nothing fits without activation checkpointing
    text = " ".join(capsys.readouterr().out.split())
    assert "No layout fits" in text and "--activation-checkpointing" in text
    assert "smaller --micro-batch" not in text and "micro-batch is already 1" in text and "--seq-len" in text
    plan = make_plan(model_preset("70b", micro_batch=2), _h100(1), TrainOptions(activation_checkpointing=True))
    assert plan.best is None and "a smaller --micro-batch (now 2)" in plan.reasons[0]
    assert "--activation-checkpointing" not in plan.reasons[0]  # already on


def test_sizes_without_a_unit_are_refused_with_the_spelling(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(ValueError, match=r"'80GiB'.*'80GB'"):
        parse_bytes("80")
    assert main(["plan", "--model", "7b", "--nodes", "2", "--gpu-memory", "80"]) == 2
    assert "size '80' has no unit: write '80GiB'" in capsys.readouterr().err  # not 80 bytes: every layout NO
    assert main(["tune", "--from-metrics", str(_synthetic_runs(tmp_path)), "--gpu-memory", "24"]) == 2
    assert "write '24GiB'" in capsys.readouterr().err
    assert main(["plan", "--model", "7b", "--nodes", "2", "--inter-node-bandwidth", "1gbit", "--json", "-"]) == 0
    assert json.loads(capsys.readouterr().out)["cluster"]["inter_bandwidth"] == 125e6  # launch's spelling
