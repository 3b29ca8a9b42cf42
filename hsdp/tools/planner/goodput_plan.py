"""``hsdp plan --node-mtbf``: each layout's goodput under each recovery, and the table that shows it.

A layout decides what one node's failure takes down: with ``S x T`` ranks per replica at least a node, one
replica; below a node, the ``gpus_per_node / (S x T)`` replicas that share it. Its step time (the plan's
estimate) is the step an elastic failure discards; under DiLoCo a phase is ``H`` inner steps and a sync blocks
what the DiLoCo estimate says it adds. Checkpoint-restart costs every layout the same (the whole job restarts),
at the given checkpoint interval or, by default, Young's for the given save time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hsdp.tools.planner.diloco import DiLoCoEstimate
from hsdp.tools.planner.estimate import LayoutEstimate
from hsdp.tools.planner.goodput import (
    CheckpointRestart,
    ElasticDiLoCo,
    ElasticReplicas,
    Failures,
    goodput,
    young_interval,
)
from hsdp.tools.quantities import format_seconds

if TYPE_CHECKING:
    from rich.console import Console

GOODPUT_COLUMNS = ("layout", "replicas", "down per node failure", "checkpoint-restart", "elastic replicas",
                   "elastic DiLoCo")


@dataclass(frozen=True)
class RecoveryTimes:
    """What recovering costs on this cluster: ``node_mtbf_s`` per node; a restart of the whole job
    (``restart_s``), a checkpoint save that blocks ``save_s`` every ``checkpoint_every_s`` (``None``: Young's
    interval); an elastic replica's rejoin (``rejoin_s``) and the survivors' stall (``stall_s``)."""

    node_mtbf_s: float
    restart_s: float = 600.0
    save_s: float = 30.0
    checkpoint_every_s: float | None = None
    rejoin_s: float = 120.0
    stall_s: float = 3.0


@dataclass(frozen=True)
class LayoutGoodput:
    """One layout's goodput per recovery (``None`` where a recovery does not apply: one replica, no DiLoCo)."""

    estimate: LayoutEstimate
    per_failure: int
    checkpoint_restart: float
    elastic: float | None
    elastic_diloco: float | None

    def as_dict(self) -> dict[str, object]:
        return {"replicate": self.estimate.layout.replicate, "shard": self.estimate.layout.shard,
                "tensor_parallel": self.estimate.layout.tp, "replicas_down_per_node_failure": self.per_failure,
                "checkpoint_restart": self.checkpoint_restart, "elastic_replicas": self.elastic,
                "elastic_diloco": self.elastic_diloco}


def checkpoint_policy(times: RecoveryTimes, failures: Failures) -> CheckpointRestart:
    every = times.checkpoint_every_s or young_interval(max(times.save_s, 1e-3), failures)
    return CheckpointRestart(every, times.save_s, times.restart_s)


def layout_goodput(estimates: Sequence[LayoutEstimate], nodes: int, gpus_per_node: int, times: RecoveryTimes,
                   diloco: Sequence[DiLoCoEstimate] | None = None) -> list[LayoutGoodput]:
    """Each layout's goodput (module docstring); ``diloco``: the plan's DiLoCo estimates, by layout."""
    failures = Failures(nodes, times.node_mtbf_s)
    restart = goodput(failures, checkpoint_policy(times, failures)).fraction
    by_layout = {d.plain.layout: d for d in diloco or ()}
    rows = []
    for e in estimates:
        replicas, ranks = e.layout.replicate, e.layout.shard * e.layout.tp
        per_failure = min(replicas, max(1, gpus_per_node // ranks))
        elastic = phased = None
        if replicas > 1:
            elastic = goodput(failures, ElasticReplicas(replicas, times.stall_s, e.step.step_s, times.rejoin_s,
                                                        per_failure)).fraction
            d = by_layout.get(e.layout)
            if d is not None:
                phase = d.every * d.inner.step_s
                phased = goodput(failures, ElasticDiLoCo(replicas, phase, sum(d.waits), times.stall_s,
                                                         times.rejoin_s, per_failure)).fraction
        rows.append(LayoutGoodput(e, per_failure, restart, elastic, phased))
    return rows


def goodput_title(times: RecoveryTimes, nodes: int) -> str:
    failures = Failures(nodes, times.node_mtbf_s)
    every = checkpoint_policy(times, failures).interval_s
    return (f"Goodput (fraction of wall time that trains) with a node failing every {_span(times.node_mtbf_s)} "
            f"({nodes} nodes: one failure every {_span(1 / failures.rate)}); restart {_span(times.restart_s)}, "
            f"a checkpoint every {_span(every)} blocking {_span(times.save_s)}; elastic: stall "
            f"{_span(times.stall_s)}, rejoin {_span(times.rejoin_s)}")


def goodput_rows(rows: Sequence[LayoutGoodput], best: LayoutEstimate | None) -> list[list[str]]:
    def pct(x: float | None) -> str:
        return "-" if x is None else f"{x:.2%}"

    return [[f"{'* ' if r.estimate is best else ''}{r.estimate.layout.label}", str(r.estimate.layout.replicate),
             str(r.per_failure), pct(r.checkpoint_restart), pct(r.elastic), pct(r.elastic_diloco)] for r in rows]


def _span(seconds: float) -> str:
    if seconds < 120:
        return format_seconds(seconds)
    return f"{seconds / 60:.0f} min" if seconds < 7200 else f"{seconds / 3600:,.1f} h"


def goodput_lines(rows: Sequence[LayoutGoodput], best: LayoutEstimate | None) -> list[str]:
    """The sentences under the table: what the recommended layout gains by recovering elastically."""
    lines = ["Relative to the same layout without failures (the model: hsdp.tools.planner.goodput; published "
             "figures next to it: docs/reference/goodput.md)."]
    r = next((r for r in rows if r.estimate is best), None)
    if r is not None and r.elastic is not None:
        lines.append(f"On the recommended {r.estimate.layout.label}: {r.checkpoint_restart:.1%} restarting from "
                     f"checkpoints, {r.elastic:.1%} with elastic replicas (hsdp launch --elastic; a failed node "
                     f"takes {r.per_failure} of {r.estimate.layout.replicate} replicas down while it rejoins)"
                     + ("" if r.elastic_diloco is None else f", {r.elastic_diloco:.1%} with elastic DiLoCo") + ".")
    elif r is not None:
        lines.append(f"The recommended {r.estimate.layout.label} has one replica: every failure restarts the job.")
    return lines


def print_goodput(rows: Sequence[LayoutGoodput], best: LayoutEstimate | None, title: str,
                  console: Console | None = None) -> None:
    """The table, then :func:`goodput_lines` (rich is imported here: ``hsdp plan --json -`` does without it)."""
    from rich.table import Table

    from hsdp.tools.planner.render import _console

    console = console or _console(200)
    table = Table(title=title)
    for col in GOODPUT_COLUMNS:
        table.add_column(col, justify="left" if col == "layout" else "right")
    for row in goodput_rows(rows, best):
        table.add_row(*row)
    console.print(table)
    for line in goodput_lines(rows, best):
        console.print(f"- {line}", highlight=False, markup=False)
