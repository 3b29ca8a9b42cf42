"""Memory and step time against shard degree (matplotlib, Agg backend: no display needed).

Left: peak memory per GPU by kind, stacked, with the usable limit. Right: predicted step time split into
compute, optimizer and exposed communication; with a tuning report, the measured step times as points.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from hsdp.tools.planner.compare import TuneReport
from hsdp.tools.planner.plan import Plan

_MEMORY_PARTS = ("params", "grads", "optimizer", "master", "unsharded", "accumulation", "activations")


def _memory_panel(ax: Any, plan: Plan, xs: list[int]) -> None:
    # GiB for real models, MiB for the small ones tuned on CPUs.
    unit, scale = ("GiB", 2**30) if max(e.memory.total for e in plan.layouts) >= 2**30 else ("MiB", 2**20)
    bottom = [0.0] * len(xs)
    for part in _MEMORY_PARTS:
        values = [getattr(e.memory, part) / scale for e in plan.layouts]
        if any(values):
            ax.bar(xs, values, bottom=bottom, label=part)
            bottom = [b + v for b, v in zip(bottom, values)]
    if not math.isinf(plan.memory_limit):
        ax.axhline(plan.memory_limit / scale, color="black", linestyle="--", label="usable memory")
    ax.set(title=f"peak memory per GPU ({unit})", xlabel="shard degree S")


def _time_panel(ax: Any, plan: Plan, xs: list[int], report: TuneReport | None) -> None:
    parts = {"compute": [e.step.compute_s for e in plan.layouts],
             "optimizer": [e.step.optimizer_s for e in plan.layouts],
             "exposed comm": [e.step.exposed_comm_s for e in plan.layouts]}
    bottom = [0.0] * len(xs)
    for name, values in parts.items():
        ax.bar(xs, values, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, values)]
    if report is not None:
        measured = {r.shard: r.measured_s for r in report.rows}
        pts = [(x, measured[e.layout.shard]) for x, e in zip(xs, plan.layouts) if e.layout.shard in measured]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "kD", label="measured")
    if plan.best is not None:
        best = plan.layouts.index(plan.best)
        ax.annotate("recommended", (best, plan.best.step.step_s), xytext=(0, 6), textcoords="offset points",
                    ha="center", va="bottom", fontsize=8)
    ax.set(title="step time (s)", xlabel="shard degree S")


def plot_plan(plan: Plan, path: str | Path, report: TuneReport | None = None) -> Path:
    """Write the figure to ``path`` (PNG, SVG or PDF by extension) and return it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [str(e.layout.shard) for e in plan.layouts]
    xs = list(range(len(labels)))
    fig, (mem_ax, time_ax) = plt.subplots(1, 2, figsize=(12, 4.5))
    _memory_panel(mem_ax, plan, xs)
    _time_panel(time_ax, plan, xs, report)
    for ax in (mem_ax, time_ax):
        ax.set_xticks(xs, labels)
        ax.legend(fontsize=8)
    fig.suptitle(f"{plan.model.name} on {plan.cluster.nodes} x {plan.cluster.gpus_per_node}")
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
