"""``hsdp report RUN_DIR``: PNG plots of a training run from its ``metrics.jsonl``.

Three figures in ``RUN_DIR/report/``:

  * ``loss.png``: training loss per step, held-out loss at the evaluation steps;
  * ``throughput.png``: tokens/s per step, with the run's median as a line;
  * ``communication.png``: KiB sent per step by rank 0 in the shard group (intra-node) and the replicate
    group (inter-node), and the seconds spent in each.

Rendered with matplotlib's Agg backend: no display needed, the same pixels everywhere.
"""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass
from typing import Any

from hsdp.apps.train.metrics import JSONL_NAME, read_metrics

_DPI = 100
_SIZE = (8, 4.5)  # inches: 800 x 450 pixels at _DPI


@dataclass(frozen=True)
class Series:
    """Steps and values of one metric (records without the metric are skipped)."""

    steps: list[int]
    values: list[float]

    @classmethod
    def of(cls, records: list[dict[str, Any]], name: str, scale: float = 1.0) -> Series:
        rows = [(r["step"], r[name]) for r in records if r.get(name) is not None]
        return cls([s for s, _ in rows], [v * scale for _, v in rows])


def _figure(rows: int = 1) -> tuple[Any, Any]:
    import matplotlib

    matplotlib.use("Agg")  # headless: never look for a display
    import matplotlib.pyplot as plt

    return plt.subplots(rows, 1, figsize=_SIZE, dpi=_DPI, sharex=True)


def _save(fig: Any, path: str) -> str:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_loss(records: list[dict[str, Any]], path: str) -> str:
    fig, ax = _figure()
    train, held = Series.of(records, "loss"), Series.of(records, "eval_loss")
    ax.plot(train.steps, train.values, label="train", color="tab:blue", linewidth=1.2)
    if held.steps:
        ax.plot(held.steps, held.values, "o-", label="held-out", color="tab:orange")
    ax.set(title="Loss", xlabel="step", ylabel="cross entropy (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, path)


def plot_throughput(records: list[dict[str, Any]], path: str) -> str:
    fig, ax = _figure()
    tps = Series.of(records, "tokens_per_s")
    ax.plot(tps.steps, tps.values, color="tab:green", linewidth=1.0, label="per step")
    if tps.values:
        median = statistics.median(tps.values)
        ax.axhline(median, color="black", linestyle="--", linewidth=1.0, label=f"median {median:,.0f}")
    ax.set(title="Throughput (all ranks)", xlabel="step", ylabel="tokens/s")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, path)


def plot_communication(records: list[dict[str, Any]], path: str) -> str:
    fig, (top, bottom) = _figure(rows=2)
    for group, color, where in (("shard", "tab:blue", "intra-node"), ("replicate", "tab:red", "inter-node")):
        sent = Series.of(records, f"{group}_bytes", 1 / 1024)
        secs = Series.of(records, f"{group}_s")
        top.plot(sent.steps, sent.values, color=color, label=f"{group} ({where})")
        bottom.plot(secs.steps, secs.values, color=color, label=f"{group} ({where})")
    top.set(title="Communication per step (rank 0)", ylabel="KiB sent")
    bottom.set(xlabel="step", ylabel="seconds")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
        ax.set_ylim(0, ax.get_ylim()[1] * 1.3)  # headroom: the legend must not cover a flat line
        ax.legend(fontsize="small", loc="upper right", ncols=2)
    return _save(fig, path)


def write_report(run_dir: str) -> list[str]:
    """Write the three PNGs into ``run_dir/report``; returns their paths. ``ValueError`` when the run
    directory has no metrics yet."""
    records = read_metrics(run_dir)
    if not records:
        raise ValueError(f"{os.path.join(run_dir, JSONL_NAME)} is missing or empty: pass the run directory of "
                         f"an hsdp train run (train.out_dir, e.g. runs/train) that finished at least one step")
    out = os.path.join(run_dir, "report")
    os.makedirs(out, exist_ok=True)
    return [plot_loss(records, os.path.join(out, "loss.png")),
            plot_throughput(records, os.path.join(out, "throughput.png")),
            plot_communication(records, os.path.join(out, "communication.png"))]
