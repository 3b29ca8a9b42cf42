"""The one result file of ``benchmarks/gpu_check.sh``: ``<out>/gpu_check_<date>.{json,md}``.

Gathers what the check's steps left behind: the CUDA tests' JUnit XML (passed / failed / skipped counts, every
test's outcome and seconds), the fake-process-group mesh test's peak memory of hsdp against FSDP2
(``fake_mesh_memory.json``, written by ``tests/test_cuda_mesh.py`` into ``$HSDP_GPU_CHECK_DIR``), and
``benchmarks/gpu_smoke.py``'s JSON (hsdp against FSDP2 on the ~1B GPT: tokens/s, step time, peak memory),
with the exact commands that made them. A step that did not finish (a timeout, a crash) is reported as
missing, never left out silently. Standard library only: it runs even where torch is broken.
"""

from __future__ import annotations

import argparse
import datetime
import json
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="folder for gpu_check_<date>.{json,md}")
    p.add_argument("--command", required=True, help="the gpu_check.sh command line")
    p.add_argument("--device", default="", help="the GPU and torch, as the check printed them")
    p.add_argument("--exit-code", type=int, required=True, help="the check's exit code")
    p.add_argument("--junit", type=Path, help="the CUDA tests' JUnit XML")
    p.add_argument("--pytest-command", default="")
    p.add_argument("--pytest-rc", type=int)
    p.add_argument("--memory", type=Path, help="fake_mesh_memory.json of tests/test_cuda_mesh.py")
    p.add_argument("--smoke-dir", type=Path, help="where gpu_smoke.py wrote its JSON")
    p.add_argument("--smoke-command", default="")
    p.add_argument("--smoke-rc", type=int)
    return p.parse_args(argv)


def cuda_tests(junit: Path | None, command: str, rc: int | None) -> dict[str, Any]:
    """Counts and per-test outcomes from pytest's JUnit XML (``None`` counts: pytest wrote none)."""
    out: dict[str, Any] = {"command": command, "exit_code": rc, "counts": None, "seconds": None, "tests": []}
    if junit is None or not junit.is_file():
        out["note"] = "no JUnit XML: pytest did not finish (timeout or crash), see the check's log"
        return out
    root = ET.parse(junit).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    out["counts"] = counts
    out["seconds"] = round(sum(float(s.get("time", 0)) for s in suites), 1)
    for case in root.iter("testcase"):
        outcome, message = "passed", None
        for tag in ("failure", "error", "skipped"):
            found = case.find(tag)
            if found is not None:
                outcome, message = tag, (found.get("message") or "")[:500]
                break
        row = {"name": f"{case.get('classname', '')}::{case.get('name', '')}", "outcome": outcome,
               "seconds": round(float(case.get("time", 0)), 2)}
        if message is not None:
            row["message"] = message
        out["tests"].append(row)
    return out


def smoke(folder: Path | None, command: str, rc: int | None) -> dict[str, Any]:
    """gpu_smoke.py's newest JSON in ``folder``, with hsdp / FSDP2 ratios."""
    out: dict[str, Any] = {"command": command, "exit_code": rc}
    files = sorted(folder.glob("gpu_smoke_*.json"), key=lambda f: f.stat().st_mtime) if folder else []
    if not files:
        out["note"] = "no gpu_smoke JSON: the run did not finish (timeout or crash), see the check's log"
        return out
    data = json.loads(files[-1].read_text())
    timing = data.get("timing", {})
    h, f = timing.get("hsdp", {}), timing.get("fsdp2", {})
    ratios = {}
    for key in ("tokens_per_s", "median_step_ms", "peak_mem_gib"):
        if h.get(key) and f.get(key):
            ratios[key] = round(h[key] / f[key], 4)
    out.update({k: data.get(k) for k in ("passed", "max_rel_loss_diff", "rtol", "config", "environment",
                                         "method")})
    out.update({"smoke_command": data.get("command"), "timing": timing, "hsdp_over_fsdp2": ratios,
                "losses": {k: v.get("losses") for k, v in data.get("runs", {}).items()}})
    return out


def markdown(r: dict[str, Any]) -> str:
    verdict = "PASS" if r["passed"] else f"FAIL (exit {r['exit_code']})"
    lines = [f"# GPU check, {r['date']}", "", f"Command: `{r['command']}`", "", f"Device: {r['device']}", "",
             f"**{verdict}**", "", "## CUDA tests", "", f"Command: `{r['cuda_tests']['command']}`", ""]
    t = r["cuda_tests"]
    if t["counts"] is None:
        lines += [t.get("note", ""), ""]
    else:
        c = t["counts"]
        lines += [f"{c['passed']} passed, {c['failures']} failed, {c['errors']} errors, {c['skipped']} skipped "
                  f"of {c['tests']} in {t['seconds']} s (exit {t['exit_code']}).", ""]
        lines += [f"- {x['outcome'].upper()} `{x['name']}`: {x.get('message', '')}" for x in t["tests"]
                  if x["outcome"] != "passed"]
        lines += ["", "| test | outcome | s |", "|---|---|---:|"]
        lines += [f"| `{x['name']}` | {x['outcome']} | {x['seconds']} |" for x in t["tests"]]
        lines.append("")
    m = r["fake_mesh_memory"]
    lines += ["## Peak memory on a fake 2 x 4 mesh (hsdp vs FSDP2)", ""]
    if m is None:
        lines += ["Not measured (the test did not run to its end).", ""]
    else:
        lines += [f"{m['mesh']}, model `{m['model']}`, {m['steps']} AdamW steps: hsdp {m['hsdp_peak_mib']} MiB, "
                  f"FSDP2 {m['fsdp2_peak_mib']} MiB, ratio **{m['ratio']}** (limit {m['limit']}).", ""]
    s = r["hsdp_vs_fsdp2"]
    lines += ["## hsdp vs FSDP2 on one GPU (gpu_smoke.py)", "", f"Command: `{s.get('smoke_command') or s['command']}`",
              ""]
    if "timing" not in s:
        lines += [s.get("note", ""), ""]
    else:
        cfg = s.get("config") or {}
        lines += ["Config: " + ", ".join(f"{k}={v}" for k, v in cfg.items()), "",
                  f"Losses agree: {s['passed']} (largest relative difference {s['max_rel_loss_diff']:.2e}, "
                  f"tolerance {s['rtol']:.0e}).", "", "| | hsdp | FSDP2 | hsdp / FSDP2 |", "|---|---:|---:|---:|"]
        for key in ("tokens_per_s", "median_step_ms", "peak_mem_gib"):
            lines.append(f"| {key} | {s['timing']['hsdp'].get(key)} | {s['timing']['fsdp2'].get(key)} | "
                         f"{s['hsdp_over_fsdp2'].get(key, '')} |")
        lines += ["", "Method: " + str(s.get("method")), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[Path]:
    a = parse_args(argv)
    memory = json.loads(a.memory.read_text()) if a.memory and a.memory.is_file() else None
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).date().isoformat(),
        "command": a.command, "device": a.device, "exit_code": a.exit_code, "passed": a.exit_code == 0,
        "cuda_tests": cuda_tests(a.junit, a.pytest_command, a.pytest_rc),
        "fake_mesh_memory": memory,
        "hsdp_vs_fsdp2": smoke(a.smoke_dir, a.smoke_command, a.smoke_rc),
    }
    a.out.mkdir(parents=True, exist_ok=True)
    paths = [a.out / f"gpu_check_{result['date']}.json", a.out / f"gpu_check_{result['date']}.md"]
    paths[0].write_text(json.dumps(result, indent=2) + "\n")
    paths[1].write_text(markdown(result))
    for path in paths:
        print(f"wrote {path}")
    return paths


if __name__ == "__main__":
    main()
