"""`hsdp bench` wiring and the benchmark's job list (the runs themselves are benchmarks, not tests)."""

from __future__ import annotations

import pytest

from hsdp.apps.cli import main
from hsdp.apps.cli.bench import parse_args
from hsdp.tools.bench.driver import combine_repeats, jobs, summarise
from hsdp.tools.bench.report import markdown_table


def test_bench_help_reaches_the_benchmark_parser(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--help"])
    assert exit_info.value.code == 0
    assert "usage: hsdp bench" in capsys.readouterr().out


def test_default_matrix_covers_every_system_network_and_the_extras() -> None:
    todo = jobs(parse_args([]))
    assert len(todo) == 4 * 3 + 4
    assert {n for n, _, _ in todo} == {"1gbit", "200mbit", "loopback"}
    assert ("1gbit", "hsdp", 4) in todo and ("1gbit", "fsdp2-hsdp", 4) in todo
    assert len(jobs(parse_args(["--no-extras", "--no-loopback", "--bandwidths", "1gbit"]))) == 4


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
