"""Output: a plan and a tuning report as rich tables (terminal), JSON, and ``hsdp tune``'s results files."""

from __future__ import annotations

import json
import math
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from hsdp.tools.planner.compare import Row, TuneReport
from hsdp.tools.planner.plan import LayoutEstimate, Plan
from hsdp.tools.planner.tune import candidate_label
from hsdp.tools.quantities import format_bytes, format_seconds
from hsdp.tools.results import results_run

PLAN_COLUMNS = ("layout", "kind", "optimizer state", "state/GPU", "peak/GPU", "fits", "step", "compute",
                "exposed comm", "inter-node GB/node/step", "tokens/s")
# With tensor parallelism in the plan: T, micro-batches per data-parallel rank, TP collectives per step.
TP_COLUMNS = ("T", "micro-batches", "TP comm")
TUNE_COLUMNS = ("S", "optimizer state", "measured s", "runs", "nominal s", "calibrated s", "error", "held-out s",
                "held-out error", "inter-node MB/node/step measured", "predicted", "state bytes measured", "predicted")


def _console(width: int = 170) -> Console:
    # Piped into a file or a log, rich would wrap at 80 columns: the tables are wider than that.
    return Console() if sys.stdout.isatty() else Console(width=width)


def _plan_row(e: LayoutEstimate, best: LayoutEstimate | None) -> list[str]:
    mark = "* " if e is best else ""
    return [f"{mark}{e.layout.label}", e.kind, optimizer_split(e), format_bytes(e.memory.state),
            format_bytes(e.memory.total), "yes" if e.fits else "NO", format_seconds(e.step.step_s),
            format_seconds(e.step.compute_s), format_seconds(e.step.exposed_comm_s),
            f"{e.step.inter_node_bytes / 1e9:.3g}", f"{e.tokens_per_s:,.0f}"]


def optimizer_split(e: LayoutEstimate) -> str:
    """``1/8`` (over the shard group) or ``1/64 (R x S)``: sharded across replicas too."""
    return f"1/{e.optimizer_shards}" + (" (R x S)" if e.shard_optimizer else "")


def has_tp(plan: Plan) -> bool:
    """Whether the plan considered T > 1 (its table then shows the TP columns)."""
    return any(e.layout.tp > 1 for e in plan.layouts)


def plan_columns(plan: Plan) -> tuple[str, ...]:
    return PLAN_COLUMNS[:1] + TP_COLUMNS + PLAN_COLUMNS[1:] if has_tp(plan) else PLAN_COLUMNS


def plan_rows(plan: Plan) -> list[list[str]]:
    rows = [_plan_row(e, plan.best) for e in plan.layouts]
    if not has_tp(plan):
        return rows
    return [[r[0], str(e.layout.tp), str(e.micro_batches),
             format_seconds(e.step.tp_comm_s) if e.layout.tp > 1 else "-", *r[1:]]
            for r, e in zip(rows, plan.layouts, strict=True)]


def print_plan(plan: Plan, console: Console | None = None) -> None:
    """The layout table (``*`` marks the recommendation), then the reasons."""
    console = console or _console(200 if has_tp(plan) else 170)  # the TP columns need room
    limit = "no limit" if math.isinf(plan.memory_limit) else f"{format_bytes(plan.memory_limit)} usable per GPU"
    table = Table(title=f"{plan.model.name} ({plan.model.params / 1e9:.3g}B params) on {plan.cluster.describe()}; "
                        f"{limit}")
    columns = plan_columns(plan)
    left = {"layout", "kind", "optimizer state"}
    for col in columns:
        table.add_column(col, justify="left" if col in left else "right")
    for row in plan_rows(plan):
        table.add_row(*row)
    console.print(table)
    for line in plan.reasons:
        console.print(f"- {line}", highlight=False)


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:+.1%}"


def tune_rows(report: TuneReport) -> list[list[str]]:
    out = []
    for r in report.rows:
        mark = "* " if report.is_recommended(r) else ""
        inter = "n/a" if r.measured_inter_node_bytes is None else f"{r.measured_inter_node_bytes / 1e6:.1f}"
        state = "n/a" if r.measured_state_bytes is None else f"{r.measured_state_bytes:,.0f}"
        runs = "/".join(f"{x:.2f}" for x in sorted(r.run_medians))
        out.append([f"{mark}{r.shard}", _row_split(report, r), f"{r.measured_s:.3f}", runs, f"{r.nominal_s:.3f}",
                    f"{r.calibrated_s:.3f}", _pct(r.error), "n/a" if r.held_out_s is None else f"{r.held_out_s:.3f}",
                    _pct(r.held_out_error), inter, f"{r.predicted_inter_node_bytes / 1e6:.1f}", state,
                    f"{r.predicted_state_bytes:,.0f}"])
    return out


def _row_split(report: TuneReport, r: Row) -> str:
    return f"1/{report.measured.world_size} (R x S)" if r.shard_optimizer else f"1/{r.shard}"


def recommendation_line(report: TuneReport) -> str:
    """``recommended S=2 +opt/R; measured fastest S=2 (recommendation +0.0% vs fastest)``."""
    fastest = report.measured_fastest
    vs = report.recommended_vs_fastest()
    rec = "nothing" if report.recommended_shard is None else candidate_label(report.recommended_shard,
                                                                             report.recommended_shard_optimizer)
    return (f"recommended {rec}; measured fastest {candidate_label(fastest.shard, fastest.shard_optimizer)}"
            + ("" if vs is None else f" (recommendation {vs:+.1%} vs fastest)"))


def constants_line(report: TuneReport) -> str:
    v = report.calibrated.values
    return (f"calibrated: compute x{v.get('compute_scale', 1):.2f} of the profile, intra-node "
            f"{v.get('intra_bandwidth', 0) / 1e6:.0f} MB/s per ring edge, inter-node "
            f"{v.get('inter_bandwidth', 0) / 1e6:.1f} MB/s per node, {v.get('collective_overhead', 0) * 1e3:.2f} ms "
            f"per collective (ring steps x{v.get('latency_scale', 1):.2g}), compute lost per byte sent "
            f"{v.get('host_s_per_intra_byte', 0) * 1e9:.2f} ns inside a node, "
            f"{v.get('host_s_per_inter_byte', 0) * 1e9:.2f} ns to another node")


WEIGHT_SOURCES = {"busy_s_per_rank": "busy seconds (a step less its waits in collectives)",
                  "compute_s_per_rank": "forward+backward seconds of the unwrapped model",
                  "step_s_per_rank": "wall seconds (paced by the slowest rank: about even)"}


def weights_line(report: TuneReport) -> str | None:
    """The batch weights that equalize the ranks' step times, and where they come from (None: no per-rank times)."""
    w = report.weights
    if w is None:
        return None
    rec = report.recommended_shard
    label = "the measured runs" if rec is None else candidate_label(rec, report.recommended_shard_optimizer)
    memory = "" if not w.peak_memory_bytes else \
        f"; peak memory per rank {' / '.join(format_bytes(b) for b in w.peak_memory_bytes)}"
    weights = "[" + ", ".join(f"{x:g}" for x in w.weights) + "]"
    return (f"batch weights per rank, 1 / {WEIGHT_SOURCES[w.source]} at equal batch ({label}, {w.runs} runs; "
            f"per rank {' / '.join(f'{t:.3f}' for t in w.seconds)} s{memory}): {weights}, "
            f"steps {w.expected_speedup:.2f}x as fast if each rank's step scales with its batch; hsdp train: "
            f"parallel.batch_weights = {weights}")


LEGEND = ("measured: median of every measured step of every run; runs: each run's own median; nominal: the "
          "model before calibration; calibrated: constants fitted to all measured layouts; held-out: constants "
          "fitted to the other layouts only. Inter-node bytes: link counters (TCP/IP headers included) against "
          "the predicted payload. State bytes: hsdp.state_bytes on the largest rank against the prediction.")


def print_tune(report: TuneReport, console: Console | None = None) -> None:
    console = console or _console()
    table = Table(title=f"hsdp tune: {report.measured.model.name} on {report.measured.world_size} ranks "
                        f"({report.measured.nproc_per_node} per node), predicted vs measured step time")
    for col in TUNE_COLUMNS:
        table.add_column(col, justify="right")
    for row in tune_rows(report):
        table.add_row(*row)
    console.print(table)
    console.print(LEGEND, style="dim", highlight=False)
    console.print(constants_line(report), highlight=False)
    console.print(recommendation_line(report), highlight=False)
    if weights_line(report):
        console.print(weights_line(report), highlight=False, markup=False)
    for line in report.plan.reasons:
        console.print(f"- {line}", highlight=False)
    for failure in report.measured.failures:
        console.print(f"[red]failed: {failure}[/red]")
    for warning in report.measured.warnings:
        console.print(f"[yellow]warning: {warning}[/yellow]")


def markdown(columns: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def _json_safe(x: Any) -> Any:
    if isinstance(x, float) and (math.isinf(x) or math.isnan(x)):
        return None
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


def dump_json(data: dict[str, Any], target: str) -> None:
    """Write ``data`` as JSON to the file ``target`` (``"-"``: stdout); infinities and NaN become ``null``."""
    text = json.dumps(_json_safe(data), indent=1)
    if target == "-":
        print(text)
    else:
        with open(target, "w") as f:
            f.write(text + "\n")


def write_results(report: TuneReport, out: Path, tag: str, results: list[dict[str, Any]]) -> Path:
    """``tune_<date>[_<tag>]``: JSON (report, command, every run), Markdown (command, tables), PNG."""
    from hsdp.tools.planner.plot import plot_plan

    out.mkdir(parents=True, exist_ok=True)
    command = "hsdp tune " + shlex.join(sys.argv[2:] if sys.argv[1:2] == ["tune"] else sys.argv[1:])
    run = results_run("tune", tag, command)
    name, meta, stamp = run.name, run.meta, run.meta["date"]
    dump_json({"meta": meta, "report": report.as_dict(), "runs": results}, str(out / f"{name}.json"))
    plot_plan(report.plan, out / f"{name}.png", report)
    text = [f"# hsdp tune {stamp}{' (' + tag + ')' if tag else ''}", "", f"Command: `{command}` (git {meta['git']})",
            "", f"{report.measured.model.name}, {report.measured.model.params:,} parameters, "
            f"{report.measured.world_size} ranks ({report.measured.nproc_per_node} per node).", "",
            markdown(TUNE_COLUMNS, tune_rows(report)), LEGEND, "", constants_line(report), "",
            recommendation_line(report)[0].upper() + recommendation_line(report)[1:] + ".", "",
            *([weights_line(report)[0].upper() + weights_line(report)[1:] + ".", ""] if weights_line(report) else []),
            *[f"- {line}" for line in report.plan.reasons], "",
            *[f"Failed run: {x}" for x in report.measured.failures],
            *[f"Warning: {x}" for x in report.measured.warnings], f"![plot]({name}.png)", ""]
    (out / f"{name}.md").write_text("\n".join(text))
    return out / f"{name}.md"
