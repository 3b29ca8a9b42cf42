"""``benchmarks/gpu_check_report.py``, the one result file of ``benchmarks/gpu_check.sh``, on made-up inputs:
it runs once per GPU check, where a crash would lose the run's numbers, so it is checked here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REPORT = ROOT / "benchmarks" / "gpu_check_report.py"

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="0" failures="1" skipped="1" tests="3" time="12.5">
<testcase classname="tests.test_cuda" name="test_ok" time="1.25"/>
<testcase classname="tests.test_cuda_races" name="test_bad[fp32]" time="2.0">
  <failure message="AssertionError: delayed streams changed the result">trace</failure></testcase>
<testcase classname="tests.test_cuda_mesh" name="test_skip" time="0.0">
  <skipped type="pytest.skip" message="needs a CUDA device and NCCL">skip</skipped></testcase>
</testsuite></testsuites>
"""

SMOKE = {
    "date": "2026-12-02", "command": "torchrun --standalone --nproc-per-node 1 benchmarks/gpu_smoke.py --preset gpt-1b",
    "environment": {"torch": "2.13.0"}, "config": {"preset": "gpt-1b", "precision": "mixed-bf16"},
    "passed": True, "max_rel_loss_diff": 1e-3, "rtol": 2e-2, "method": "same everything",
    "timing": {"hsdp": {"median_step_ms": 100.0, "tokens_per_s": 80000.0, "peak_mem_gib": 20.0},
               "fsdp2": {"median_step_ms": 110.0, "tokens_per_s": 72000.0, "peak_mem_gib": 21.0}},
    "runs": {"hsdp": {"losses": [10.0, 9.0]}, "fsdp2": {"losses": [10.0, 9.0]}},
}
MEMORY = {"mesh": "2x4 (fake process group, rank 0)", "model": "--dim 1024", "steps": 3, "hsdp_peak_mib": 500.0,
          "fsdp2_peak_mib": 480.0, "ratio": 1.0417, "limit": 1.1}


def _report(tmp: Path, *extra: str) -> tuple[dict, str]:
    out = tmp / "results"
    subprocess.run([sys.executable, str(REPORT), "--out", str(out), "--command", "bash benchmarks/gpu_check.sh",
                    "--device", "1 x H200", *extra], check=True, capture_output=True, text=True, timeout=60)
    (json_path,) = out.glob("gpu_check_*.json")
    return json.loads(json_path.read_text()), json_path.with_suffix(".md").read_text()


def test_the_report_counts_the_tests_and_puts_hsdp_next_to_fsdp2(tmp_path: Path) -> None:
    (tmp_path / "pytest.xml").write_text(JUNIT)
    (tmp_path / "smoke").mkdir()
    (tmp_path / "smoke" / "gpu_smoke_2026-12-02.json").write_text(json.dumps(SMOKE))
    (tmp_path / "memory.json").write_text(json.dumps(MEMORY))
    data, md = _report(tmp_path, "--exit-code", "1", "--junit", str(tmp_path / "pytest.xml"), "--pytest-rc", "1",
                       "--pytest-command", "python -m pytest -m cuda tests/", "--memory", str(tmp_path / "memory.json"),
                       "--smoke-dir", str(tmp_path / "smoke"), "--smoke-rc", "0")
    assert not data["passed"] and data["exit_code"] == 1
    tests = data["cuda_tests"]
    assert tests["counts"] == {"tests": 3, "failures": 1, "errors": 0, "skipped": 1, "passed": 1}
    assert [t["outcome"] for t in tests["tests"]] == ["passed", "failure", "skipped"]
    assert tests["tests"][1]["message"].startswith("AssertionError: delayed streams")
    assert data["fake_mesh_memory"] == MEMORY
    smoke = data["hsdp_vs_fsdp2"]
    assert smoke["hsdp_over_fsdp2"] == {"tokens_per_s": round(80000 / 72000, 4), "median_step_ms": round(100 / 110, 4),
                                        "peak_mem_gib": round(20 / 21, 4)}
    assert smoke["smoke_command"] == SMOKE["command"] and smoke["losses"]["hsdp"] == [10.0, 9.0]
    assert "**FAIL (exit 1)**" in md and "1 passed, 1 failed, 0 errors, 1 skipped of 3" in md
    assert "ratio **1.0417**" in md and "| tokens_per_s | 80000.0 | 72000.0 | 1.1111 |" in md


def test_a_step_that_did_not_finish_is_reported_missing(tmp_path: Path) -> None:
    data, md = _report(tmp_path, "--exit-code", "124", "--junit", str(tmp_path / "absent.xml"), "--pytest-rc", "124",
                       "--memory", str(tmp_path / "absent.json"), "--smoke-dir", str(tmp_path / "absent"))
    assert data["cuda_tests"]["counts"] is None and "did not finish" in data["cuda_tests"]["note"]
    assert data["fake_mesh_memory"] is None and "did not finish" in data["hsdp_vs_fsdp2"]["note"]
    assert "**FAIL (exit 124)**" in md and "Not measured" in md
