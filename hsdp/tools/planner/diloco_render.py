"""``hsdp plan --diloco-every H``'s output: each layout under DiLoCo next to plain HSDP, and what that means."""

from __future__ import annotations

from collections.abc import Sequence

from rich.console import Console
from rich.table import Table

from hsdp.tools.planner.diloco import DiLoCoEstimate, DiLoCoOptions
from hsdp.tools.planner.estimate import LayoutEstimate
from hsdp.tools.planner.render import _console
from hsdp.tools.quantities import format_bytes, format_rate, format_seconds

DILOCO_COLUMNS = ("layout", "plain step", "inner step", "sync step", "sync on link", "mean step",
                  "inter-node GB/node/step plain", "DiLoCo per sync", "DiLoCo per step", "state/GPU", "fits",
                  "tokens/s plain", "tokens/s DiLoCo", "vs plain")
NOT_DDP = ("DiLoCo is not DDP's math: the replicas drift apart for H steps and the outer optimizer makes the update, "
           "so these are speeds only, not a recommendation: compare the held-out loss at equal tokens before "
           "training with it (benchmarks/diloco_slow_links.py measures both).")


def _gb(n: float) -> str:
    return f"{n / 1e9:.3g}"


def _streaming(diloco: DiLoCoOptions) -> str:
    return f", {diloco.fragments} fragments, delay {diloco.delay}" if diloco.fragments > 1 or diloco.delay else ""


def diloco_title(diloco: DiLoCoOptions) -> str:
    return (f"DiLoCo every H={diloco.every} steps ({diloco.wire_dtype} pseudo-gradients{_streaming(diloco)}) next to "
            f"plain HSDP: not DDP's math")


def diloco_rows(estimates: Sequence[DiLoCoEstimate], best: LayoutEstimate | None) -> list[list[str]]:
    """One row per layout with R > 1: plain's step, DiLoCo's inner, sync and mean step, bytes, memory, tokens/s."""
    rows = []
    for d in estimates:
        mark = "* " if d.plain is best else ""
        rows.append([f"{mark}{d.plain.layout.label}", format_seconds(d.plain.step.step_s),
                     format_seconds(d.inner.step_s), format_seconds(d.sync_step_s), format_seconds(d.sync_link_s),
                     format_seconds(d.mean_step_s), _gb(d.plain.step.inter_node_bytes), _gb(d.sync_bytes),
                     _gb(d.inter_node_bytes), format_bytes(d.state_bytes), "yes" if d.fits else "NO",
                     f"{d.plain.tokens_per_s:,.0f}", f"{d.tokens_per_s:,.0f}", f"{d.speedup:.2f}x"])
    return rows


def _settings(diloco: DiLoCoOptions) -> str:
    dtype = {"bf16": "bfloat16", "int8": "int8"}.get(diloco.wire_dtype)
    wire = f", wire_dtype=torch.{dtype}" if dtype else ""
    train = f" parallel.diloco_wire_dtype={diloco.wire_dtype}" if dtype else ""
    if diloco.fragments > 1 or diloco.delay:
        wire += f", fragments={diloco.fragments}, delay={diloco.delay}"
        train += f" parallel.diloco_fragments={diloco.fragments} parallel.diloco_delay={diloco.delay}"
    return (f"ShardedModel(..., replica_sync=hsdp.DiLoCo(every={diloco.every}{wire})); hsdp train "
            f"parallel.replica_sync=diloco parallel.diloco_every={diloco.every}{train}")


def diloco_lines(estimates: Sequence[DiLoCoEstimate], best: LayoutEstimate | None, diloco: DiLoCoOptions,
                 inter_bandwidth: float) -> list[str]:
    """The sentences under the table: not DDP's math, then the recommended layout's numbers in words."""
    lines = [NOT_DDP]
    d = next((e for e in estimates if e.plain is best), None)
    if d is None:
        return [*lines, "No layout of this plan has more than one replica (or none fits): DiLoCo has nothing to "
                        "sync."]
    h, f = diloco.every, diloco.fragments
    what = "the sync adds" if f == 1 else f"each of the {f} fragments' syncs adds at most"
    behind = f" after running behind {diloco.delay} inner steps" if diloco.delay else ""
    lines.append(
        f"On the recommended {d.plain.layout.label}: inner steps {format_seconds(d.inner.step_s)} (no gradient "
        f"all-reduce across nodes; plain HSDP's step {format_seconds(d.plain.step.step_s)} sends "
        f"{_gb(d.plain.step.inter_node_bytes)} GB per node), and once every {h} steps {what} "
        f"{format_seconds(max(d.waits))}{behind} (the largest is {format_seconds(d.sync_link_s)} on the inter-node "
        f"link at {format_rate(inter_bandwidth)}; all together {_gb(d.sync_bytes)} GB per node, "
        f"{_sync_form(diloco)}), so the mean step is {format_seconds(d.mean_step_s)}, {d.speedup:.2f}x "
        f"plain's tokens/s, at "
        f"{_gb(d.inter_node_bytes)} GB per node per step; DiLoCo's global copy and outer momentum add "
        f"{diloco.state_bytes} B per parameter / S to each GPU ({'fits' if d.fits else 'does NOT fit'}). "
        f"Settings: {_settings(diloco)}.")
    return lines


def _sync_form(diloco: DiLoCoOptions) -> str:
    if diloco.wire_dtype == "int8":
        return ("the model in int8 blocks with fp32 scales, reduce-scattered and all-gathered: "
                "2(R-1)/R x P x (1 + 4/256)")
    return f"the model in {diloco.wire_dtype} x 2(R-1)/R"


def print_diloco(estimates: Sequence[DiLoCoEstimate], best: LayoutEstimate | None, diloco: DiLoCoOptions,
                 inter_bandwidth: float, console: Console | None = None) -> None:
    """The table, then :func:`diloco_lines`."""
    console = console or _console(200)
    table = Table(title=diloco_title(diloco))
    for col in DILOCO_COLUMNS:
        table.add_column(col, justify="left" if col == "layout" else "right")
    for row in diloco_rows(estimates, best):
        table.add_row(*row)
    console.print(table)
    for line in diloco_lines(estimates, best, diloco, inter_bandwidth):
        console.print(f"- {line}", highlight=False, markup=False)
