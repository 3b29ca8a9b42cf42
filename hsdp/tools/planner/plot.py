"""Memory and step time against shard degree (matplotlib, Agg canvas: no display needed).

Left: peak memory per GPU by kind, stacked, with the usable limit, on a log scale: a layout just under the
limit stays readable next to one ten times over it (the price: on a log axis the stacked segments' heights
are not proportional to their bytes, so read the kinds as an order, the total from the bar's top). Right:
predicted step time split into compute, optimizer and exposed communication; with a tuning report, the
measured step times as points.

Each panel has its own palette (cool colours for memory kinds, warm ones for time parts), so a colour means
one thing in the figure. A layout that does not fit is drawn hatched and faded in both panels, with a grey
tick label; the recommended layout's tick label is bold.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from hsdp.tools.planner.compare import TuneReport
from hsdp.tools.planner.plan import LayoutEstimate, Plan

MEMORY_COLOURS = {"params": "#08306b", "grads": "#2171b5", "optimizer": "#6baed6", "master": "#41ab5d",
                  "unsharded": "#00897b", "accumulation": "#7b1fa2", "activations": "#9e9ac8",
                  "after_step": "#bcbddc"}  # the replica-sharded optimizer's refresh, where it sets the peak
TIME_COLOURS = {"compute": "#e6550d", "optimizer step": "#fdae6b", "exposed comm": "#a50f15"}
_OVER_ALPHA = 0.35  # a layout that does not fit: faded and hatched
_OVER_HATCH = "//"
_OVER_TICK = "0.55"


def _bars(ax: Any, plan: Plan, xs: list[int], parts: dict[str, list[float]], colours: dict[str, str]) -> None:
    """Stack ``parts`` (name -> one value per layout) with one colour per name; unfitting layouts faded."""
    fits = [e.fits for e in plan.layouts]
    bottom = [0.0] * len(xs)
    for name, values in parts.items():
        if not any(values):
            continue
        bars = ax.bar(xs, values, bottom=bottom, color=colours[name], label=name)
        for bar, ok in zip(bars, fits):
            if not ok:
                bar.set(alpha=_OVER_ALPHA, hatch=_OVER_HATCH)
        bottom = [b + v for b, v in zip(bottom, values)]


def _memory_panel(ax: Any, plan: Plan, xs: list[int]) -> None:
    # GiB for real models, MiB for the small ones tuned on CPUs.
    totals = [e.memory.total for e in plan.layouts]
    unit, scale = ("GiB", 2**30) if max(totals) >= 2**30 else ("MiB", 2**20)
    _bars(ax, plan, xs, {p: [getattr(e.memory, p) / scale for e in plan.layouts] for p in MEMORY_COLOURS},
          MEMORY_COLOURS)
    if not math.isinf(plan.memory_limit):
        ax.axhline(plan.memory_limit / scale, color="black", linestyle="--", label="usable memory")
    ax.set_yscale("log")
    # The decade below the smallest bottom segment: every bar's first kind stays visible.
    first = [next((getattr(e.memory, p) for p in MEMORY_COLOURS if getattr(e.memory, p)), e.memory.total)
             for e in plan.layouts]
    top = max([*totals, 0.0 if math.isinf(plan.memory_limit) else plan.memory_limit]) / scale
    ax.set_ylim(10 ** math.floor(math.log10(max(min(first), 1.0) / scale)), top * 30)  # room for the legend
    ax.set(title=f"peak memory per GPU ({unit}, log scale)", xlabel=_xlabel(plan))


def _time_panel(ax: Any, plan: Plan, xs: list[int], report: TuneReport | None) -> None:
    parts = {"compute": [e.step.compute_s for e in plan.layouts],
             "optimizer step": [e.step.optimizer_s for e in plan.layouts],
             "exposed comm": [e.step.exposed_comm_s for e in plan.layouts]}
    _bars(ax, plan, xs, parts, TIME_COLOURS)
    if report is not None:
        measured = {r.shard: r.measured_s for r in report.rows}
        pts = [(x, measured[e.layout.shard]) for x, e in zip(xs, plan.layouts) if e.layout.shard in measured]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "kD", label="measured")
    if plan.best is not None:
        best = plan.layouts.index(plan.best)
        ax.annotate("recommended", (best, plan.best.step.step_s), xytext=(0, 6), textcoords="offset points",
                    ha="center", va="bottom", fontsize=8)
    ax.set(title="step time (s)", xlabel=_xlabel(plan))
    ax.set_ylim(0, ax.get_ylim()[1] * 1.4)  # room for the legend


def _xlabel(plan: Plan) -> str:
    return "shard degree S" + (" (S/T: with tensor parallel degree T)" if any(e.layout.tp > 1 for e in plan.layouts)
                               else "")


def _shard_ticks(ax: Any, layouts: tuple[LayoutEstimate, ...], best: LayoutEstimate | None) -> None:
    # "4/2": S=4 with T=2 (tensor parallelism); a plain "8" is S=8 at T=1.
    ax.set_xticks(range(len(layouts)), [str(e.layout.shard) + (f"/{e.layout.tp}" if e.layout.tp > 1 else "")
                                        for e in layouts])
    for label, e in zip(ax.get_xticklabels(), layouts):
        label.set_color("black" if e.fits else _OVER_TICK)
        if e is best:
            label.set_fontweight("bold")


def _legend(ax: Any, plan: Plan, colours: dict[str, str]) -> None:
    # Handles drawn here rather than taken from the bars: the first bar may be a faded, unfitting one.
    from matplotlib.patches import Patch

    drawn = {c.get_label() for c in ax.containers}
    handles = [Patch(color=colour, label=name) for name, colour in colours.items() if name in drawn]
    handles += [line for line in ax.get_lines() if not line.get_label().startswith("_")]
    if not all(e.fits for e in plan.layouts):
        handles.append(Patch(facecolor="white", edgecolor=_OVER_TICK, hatch=_OVER_HATCH, label="does not fit"))
    ax.legend(handles=handles, fontsize=8, loc="upper right", ncols=2)


def plan_figure(plan: Plan, report: TuneReport | None = None) -> Any:
    """The figure (a matplotlib ``Figure``, memory panel first), for callers that inspect or restyle it."""
    from matplotlib.figure import Figure

    xs = list(range(len(plan.layouts)))
    fig = Figure(figsize=(12, 4.5))
    mem_ax, time_ax = fig.subplots(1, 2)
    _memory_panel(mem_ax, plan, xs)
    _time_panel(time_ax, plan, xs, report)
    for ax, colours in ((mem_ax, MEMORY_COLOURS), (time_ax, TIME_COLOURS)):
        _shard_ticks(ax, plan.layouts, plan.best)
        _legend(ax, plan, colours)
    fig.suptitle(f"{plan.model.name} on {plan.cluster.nodes} x {plan.cluster.gpus_per_node}")
    fig.tight_layout()
    return fig


def plot_plan(plan: Plan, path: str | Path, report: TuneReport | None = None) -> Path:
    """Write the figure to ``path`` (PNG, SVG or PDF by extension) and return it."""
    out = Path(path)
    plan_figure(plan, report).savefig(out, dpi=110)
    return out
