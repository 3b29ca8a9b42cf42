"""`hsdp bench` wiring and the benchmark's job list (the runs themselves are benchmarks, not tests)."""

from __future__ import annotations

import pytest

from hsdp.bench.driver import jobs, parse_args
from hsdp.cli import main


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
