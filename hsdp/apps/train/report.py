"""``hsdp report RUN_DIR``: PNG plots of a training run from its ``metrics.jsonl``.

Four figures in ``RUN_DIR/report/`` (five for an elastic run), one question each, every x axis in whole steps:

  * ``loss.png``: training loss per step, held-out loss at the evaluation steps;
  * ``throughput.png``: tokens/s per step, with the run's median as a line;
  * ``communication.png``: KiB sent per step by rank 0 in the shard group (intra-node) and the replicate
    group (inter-node); below, the step time as a shaded area with the exposed communication (the time rank 0
    waited for collectives instead of computing) as a darker area inside it, and the time inside each
    group's collectives drawn over it;
  * ``training.png``: learning rate, gradient norm (before clipping) and rank 0's peak memory per step, with
    every rank's end-of-run peak from ``summary.json`` when the run has finished;
  * ``membership.png``, only for an elastic run (``parallel.elastic = true``: the records name each step's
    replicas): which replica ids were members at each step, the discarded steps marked, and the global batch
    per step (:mod:`hsdp.apps.train.report_membership`).

What the communication seconds are: each collective's time from issue to completed wait, summed over the
step. Asynchronous collectives run while the rank computes (and while other collectives run), so the sum can
exceed the step; it is not the exposed communication. The exposed part is ``exposed_comm_s``: the time the
host blocked waiting for collectives, which on CPUs (gloo) is the time the rank could not compute. On CUDA
with NCCL the host does not block (the stream waits), so it is not recorded there and the plot omits it:
read it from a ``--profile`` trace, where the ``... wait`` regions are the communication waited for.

Rendered with matplotlib's Agg canvas (a bare ``Figure``, no pyplot state): no display needed, the same
pixels everywhere. The ``*_figure`` functions return the figure so tests can read back what was drawn.
"""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hsdp.apps.train.metrics import JSONL_NAME, read_metrics
from hsdp.apps.train.report_canvas import TALL, figure
from hsdp.apps.train.report_membership import is_elastic, membership_figure
from hsdp.apps.train.rundir import RunDir


@dataclass(frozen=True)
class Series:
    """Steps and values of one metric (records without the metric are skipped)."""

    steps: list[int]
    values: list[float]

    @classmethod
    def of(cls, records: list[dict[str, Any]], name: str, scale: float = 1.0) -> Series:
        rows = [(r["step"], r[name]) for r in records if r.get(name) is not None]
        return cls([s for s, _ in rows], [v * scale for _, v in rows])


def _binary_unit(largest: float) -> tuple[str, float]:
    return ("GiB", 2.0**30) if largest >= 2**30 else ("MiB", 2.0**20)


def loss_figure(records: list[dict[str, Any]]) -> Any:
    fig, ax = figure()
    train, held = Series.of(records, "loss"), Series.of(records, "eval_loss")
    ax.plot(train.steps, train.values, label="train", color="tab:blue", linewidth=1.2)
    if held.steps:
        ax.plot(held.steps, held.values, "o-", label="held-out", color="tab:orange")
    ax.set(title="Loss", xlabel="step", ylabel="cross entropy (nats/token)")
    ax.legend()
    return fig


def throughput_figure(records: list[dict[str, Any]]) -> Any:
    fig, ax = figure()
    tps = Series.of(records, "tokens_per_s")
    ax.plot(tps.steps, tps.values, color="tab:green", linewidth=1.0, label="per step")
    if tps.values:
        median = statistics.median(tps.values)
        ax.axhline(median, color="black", linestyle="--", linewidth=1.0, label=f"median {median:,.0f}")
    ax.set(title="Throughput (all ranks)", xlabel="step", ylabel="tokens/s")
    ax.set_ylim(bottom=0)
    ax.legend()
    return fig


_GROUPS = (("shard", "tab:blue", "intra-node"), ("replicate", "tab:red", "inter-node"))


def communication_figure(records: list[dict[str, Any]]) -> Any:
    fig, (sent_ax, time_ax) = figure(rows=2)
    step = Series.of(records, "step_s")
    # The step as an area: a collective line above it ran (partly) alongside compute or other collectives.
    time_ax.fill_between(step.steps, step.values, color="0.85", step="mid", label="step time")
    exposed = Series.of(records, "exposed_comm_s")
    if exposed.steps:  # measured where waits block the host (CPUs)
        time_ax.fill_between(exposed.steps, exposed.values, color="0.45", step="mid", label="exposed (waited)")
    for group, color, where in _GROUPS:
        sent = Series.of(records, f"{group}_bytes", 1 / 1024)
        secs = Series.of(records, f"{group}_s")
        sent_ax.plot(sent.steps, sent.values, color=color, label=f"{group} ({where})")
        time_ax.plot(secs.steps, secs.values, color=color, label=f"inside {group} collectives")
    sent_ax.set(title="Communication per step (rank 0)", ylabel="KiB sent")
    time_ax.set(title="Step time, exposed communication, and time inside collectives (overlapped or not)",
                xlabel="step", ylabel="seconds")
    time_ax.title.set_fontsize("medium")
    for ax in (sent_ax, time_ax):
        ax.set_ylim(0, ax.get_ylim()[1] * 1.3)  # headroom: the legend must not cover a flat line
        ax.legend(fontsize="small", loc="upper right", ncols=3)
    return fig


def training_figure(records: list[dict[str, Any]], rank_peaks: dict[int, float] | None = None) -> Any:
    """Learning rate, gradient norm and peak memory per step. ``rank_peaks``: each rank's peak bytes at the
    end of the run (``summary.json``), drawn at the last step so the spread across ranks shows."""
    fig, (lr_ax, norm_ax, mem_ax) = figure(rows=3, size=TALL)
    lr, norm = Series.of(records, "lr"), Series.of(records, "grad_norm")
    lr_ax.plot(lr.steps, lr.values, color="tab:purple", label="lr")
    lr_ax.set(title="Learning rate", ylabel="lr")
    norm_ax.plot(norm.steps, norm.values, color="tab:brown", linewidth=1.0, label="grad norm")
    if norm.values and min(norm.values) > 0 and max(norm.values) >= 100 * min(norm.values):
        norm_ax.set_yscale("log")  # early spikes would flatten the rest of the run
    norm_ax.set(title="Gradient norm (before clipping)", ylabel="L2 norm")
    _memory_panel(mem_ax, records, rank_peaks or {})
    return fig


def _memory_panel(ax: Any, records: list[dict[str, Any]], rank_peaks: dict[int, float]) -> None:
    mem = Series.of(records, "mem_bytes")
    unit, scale = _binary_unit(max([*mem.values, *rank_peaks.values(), 0.0]))
    ax.plot(mem.steps, [v / scale for v in mem.values], color="tab:cyan", label="rank 0, peak so far")
    if rank_peaks and mem.steps:
        ranks = sorted(rank_peaks)
        ax.scatter([mem.steps[-1]] * len(ranks), [rank_peaks[r] / scale for r in ranks], color="black",
                   marker="_", s=200, zorder=3, label=f"ranks {ranks[0]}-{ranks[-1]} at the end")
    ax.set(title="Peak memory (CUDA allocator on GPUs, resident set on CPUs)", xlabel="step", ylabel=unit)
    ax.set_ylim(bottom=0)
    ax.legend(fontsize="small", loc="lower right")


def read_rank_peaks(run_dir: str) -> dict[int, float]:
    """Each rank's ``peak_bytes`` from the run's ``summary.json`` (empty while the run has not finished)."""
    path = RunDir(run_dir).summary  # written by rank 0 when the run ends
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        ranks = json.load(f).get("ranks", [])
    return {int(r["rank"]): float(r["peak_bytes"]) for r in ranks if "peak_bytes" in r}


def report_figures(run_dir: str) -> dict[str, Callable[[], Any]]:
    """File name -> a function drawing that figure, in the order ``write_report`` writes them (``membership.png``
    only for an elastic run). ``ValueError`` when the run directory has no metrics yet."""
    records = read_metrics(run_dir)
    if not records:
        raise ValueError(f"{os.path.join(run_dir, JSONL_NAME)} is missing or empty: pass the run directory of "
                         f"an hsdp train run (train.out_dir, e.g. runs/train) that finished at least one step")
    figures = {"loss.png": lambda: loss_figure(records),
               "throughput.png": lambda: throughput_figure(records),
               "communication.png": lambda: communication_figure(records),
               "training.png": lambda: training_figure(records, read_rank_peaks(run_dir))}
    if is_elastic(records):
        figures["membership.png"] = lambda: membership_figure(records)
    return figures


def write_report(run_dir: str) -> list[str]:
    """Write the PNGs of :func:`report_figures` into ``run_dir/report``; returns their paths. ``ValueError``
    when the run directory has no metrics yet."""
    figures = report_figures(run_dir)
    out = RunDir(run_dir).report
    os.makedirs(out, exist_ok=True)
    paths = []
    for name, draw in figures.items():
        fig = draw()
        fig.tight_layout()
        fig.savefig(os.path.join(out, name))
        paths.append(os.path.join(out, name))
    return paths
