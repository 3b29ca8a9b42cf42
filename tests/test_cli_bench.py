"""`hsdp bench` wiring and the benchmark's job list (the runs themselves are benchmarks, not tests)."""

from __future__ import annotations

import pytest
import torch

from hsdp.apps.cli import main
from hsdp.apps.cli.bench import parse_args
from hsdp.engine.memory import state_bytes
from hsdp.models import GPT, preset
from hsdp.tools.bench.driver import combine_repeats, jobs, summarise
from hsdp.tools.bench.report import markdown_table
from hsdp.tools.bench.systems import Wrapped
from hsdp.tools.bench.worker import _step_parts


def test_bench_help_reaches_the_benchmark_parser(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--help"])
    assert exit_info.value.code == 0
    assert "usage: hsdp bench" in capsys.readouterr().out


def test_default_matrix_covers_every_system_network_and_the_extras() -> None:
    todo = jobs(parse_args([]))
    assert len(todo) == 5 * 3 + 4
    assert ("1gbit", "hsdp-opt-across-replicas", 1) in todo
    assert {n for n, _, _ in todo} == {"1gbit", "200mbit", "loopback"}
    assert ("1gbit", "hsdp", 4) in todo and ("1gbit", "fsdp2-hsdp", 4) in todo
    assert len(jobs(parse_args(["--no-extras", "--no-loopback", "--bandwidths", "1gbit"]))) == 5


def _run(system: str, step_s: float, peak: float) -> dict:
    return {"network": "1gbit", "system": system, "micro_batches": 1, "median_step_s": step_s, "world": 4,
            "sharding_degree": 2, "params": 1_000_000, "inter_node_bytes_per_step": [[2e6, 2e6], [2e6, 2e6]],
            "peak_rss_mib_per_rank": [900.0] * 4, "peak_tensor_mib_per_rank": [peak] * 4}


def test_repeats_report_the_median_run_and_ratios_against_fsdp2() -> None:
    runs = [_run("hsdp", 2.0, 240.0), _run("fsdp2-hsdp", 3.0, 250.0), _run("hsdp", 1.5, 240.0),
            _run("fsdp2-hsdp", 2.5, 250.0), _run("hsdp", 9.0, 240.0), _run("fsdp2-hsdp", 2.8, 250.0)]
    hsdp, fsdp = summarise(combine_repeats(runs))
    assert hsdp["median_step_s"] == 2.0 and hsdp["repeats_median_step_s"] == [2.0, 1.5, 9.0]
    assert fsdp["median_step_s"] == 2.8 and abs(hsdp["ratio_to_fsdp2_hsdp"] - 2.0 / 2.8) < 1e-12
    assert abs(hsdp["tensor_peak_ratio_to_fsdp2_hsdp"] - 0.96) < 1e-12
    meta = {"date": "d", "command": "hsdp bench --repeat 3", "git": "g", "args": {"repeat": 3}}
    table = markdown_table(meta, [hsdp, fsdp])
    assert "| 1gbit | hsdp | 1 | 2.000 (1.500-9.000) | 0.71 | 240.0 | 0.960 |" in table
    failed = combine_repeats([_run("hsdp", 2.0, 1.0), {"network": "1gbit", "system": "hsdp", "micro_batches": 1,
                                                        "error": "exit 1"}])
    assert failed == [{"network": "1gbit", "system": "hsdp", "micro_batches": 1, "error": "exit 1"}]


def test_state_table_splits_model_state_and_compares_the_optimizer_with_plain_hsdp() -> None:
    def with_state(system: str, step_s: float, optimizer: list[int]) -> dict:
        r = _run(system, step_s, 200.0)
        # Ranks differ (uneven chunks): the table shows the rank holding the most in total.
        r["state_bytes_per_rank"] = [{"params": 2**20, "grads": 2**20, "optimizer": o} for o in optimizer]
        return r

    runs = [with_state("hsdp", 2.0, [4 * 2**20, 4 * 2**20, 3 * 2**20, 4 * 2**20]),
            with_state("hsdp-opt-across-replicas", 2.1, [2**20, 2 * 2**20, 2**20, 2**20])]
    old = _run("fsdp2-hsdp", 2.5, 210.0)  # a result written before the worker measured model state
    plain, sliced, fsdp = summarise([*runs, old])
    assert sliced["state_bytes"] == {"params": 2**20, "grads": 2**20, "optimizer": 2 * 2**20, "total": 4 * 2**20}
    assert sliced["optimizer_bytes_ratio_to_hsdp"] == 0.5 and abs(sliced["ratio_to_hsdp"] - 1.05) < 1e-12
    assert fsdp["state_bytes"] is None and fsdp["optimizer_bytes_ratio_to_hsdp"] is None
    table = markdown_table({"date": "d", "command": "c", "git": "g"}, [plain, sliced, fsdp])
    assert "| hsdp | 1 | 1.00 | 1.00 | 4.00 | 6.00 | 1.000 | 1.000 |" in table
    assert "| hsdp-opt-across-replicas | 1 | 1.00 | 1.00 | 2.00 | 4.00 | 0.500 | 1.050 |" in table
    assert "| fsdp2-hsdp | 1 |" not in table.split("## Model state per rank")[1]
    # Older results without model state get no state table at all.
    assert "## Model state per rank" not in markdown_table({"date": "d", "command": "c", "git": "g"},
                                                            summarise([_run("hsdp", 2.0, 1.0)]))


def test_worker_reads_model_state_while_gradients_and_optimizer_state_both_exist() -> None:
    # One process, no mesh: the measuring point is the worker's, whatever the system wraps.
    torch.manual_seed(0)
    model = GPT(preset("tiny"))
    w = Wrapped(model, torch.optim.AdamW(model.parameters()), lambda last: None)
    x = torch.randint(0, 256, (1, 9))
    seen = []
    parts = _step_parts(w, [(x[:, :-1], x[:, 1:])] * 2, lambda: seen.append(state_bytes(w.model, w.optimizer)))
    [part() for part in parts]
    params = sum(p.numel() * 4 for p in model.parameters())
    # AdamW: two fp32 moments per parameter and a 0-d fp32 step count per tensor.
    assert seen == [type(seen[0])(params, params, 2 * params + 4 * len(list(model.parameters())))]
    assert all(p.grad is None for p in model.parameters())  # zero_grad(set_to_none) still runs after it
