"""Output of a heterogeneous plan (:mod:`hsdp.tools.planner.hetero`): the table per node type, the comparison of
the even and the weighted split, and the lines a user pastes (Python and ``hsdp train`` TOML)."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from hsdp.tools.planner.hetero import HeteroPlan, SplitEstimate, TypePlan
from hsdp.tools.planner.render import _console
from hsdp.tools.quantities import format_bytes, format_seconds

HETERO_COLUMNS = ("node type", "ranks", "usable/GPU", "weight/rank", "even: seq/rank", "S", "peak/GPU", "step",
                  "weighted: seq/rank", "S", "peak/GPU", "step")


def _number(w: float) -> str:
    return f"{w:g}" if w != int(w) else f"{int(w)}.0"


def weights_expression(weights: tuple[float, ...] | list[float]) -> str:
    """A Python list expression of per-rank weights, runs of equal values compressed: ``[3.17] * 16 + [1.0] * 16``."""
    runs: list[list[Any]] = []
    for w in weights:
        if runs and runs[-1][0] == w:
            runs[-1][1] += 1
        else:
            runs.append([w, 1])
    return " + ".join(f"[{_number(w)}]" + (f" * {n}" if n > 1 else "") for w, n in runs)


def degree_text(plan: HeteroPlan) -> str:
    """``8`` when every replica has the same degree (what ``init_mesh`` takes today), else the list."""
    degrees = plan.sharding_degrees
    return str(degrees[0]) if len(set(degrees)) == 1 else "[" + ", ".join(map(str, degrees)) + "]"


def paste_lines(plan: HeteroPlan) -> dict[str, list[str]]:
    """What to paste: ``python`` (mesh and sampler) and ``toml`` (``hsdp train``'s keys) lines."""
    degree = degree_text(plan)
    weights = "[" + ", ".join(_number(w) for w in plan.rank_weights) + "]"
    python = [f"mesh = hsdp.init_mesh(sharding_degree={degree})",
              f"sampler = hsdp.distributed_sampler(ds, mesh, weights={weights_expression(plan.rank_weights)}, "
              f"batch_size={plan.global_batch}, model=model)",
              "loader = DataLoader(ds, batch_sampler=sampler)"]
    toml = ["[parallel]", f"sharding_degree = {degree}", f"batch_weights = {weights}", "[train]",
            f"batch_size = {plan.model.micro_batch}", f"grad_accum = {plan.options.micro_batches}"]
    return {"python": python, "toml": toml}


def hetero_dict(plan: HeteroPlan) -> dict[str, Any]:
    """The plan as JSON, with the paste lines."""
    return {**plan.as_dict(), "paste": paste_lines(plan)}


def _cells(s: SplitEstimate) -> list[str]:
    fits = "" if s.fits else " (NO)"
    return [str(s.batch), str(s.shard), format_bytes(s.memory.total) + fits, format_seconds(s.step_s)]


def _row(t: TypePlan) -> list[str]:
    return [t.group.label, str(t.group.ranks), format_bytes(t.memory_limit), _number(t.weight),
            *_cells(t.even), *_cells(t.weighted)]


def summary_lines(plan: HeteroPlan) -> list[str]:
    """The comparison in words: each split's tokens/s, which type paces it, and what does not fit."""
    even, weighted = plan.pacing(False), plan.pacing(True)
    slowest = min(plan.types, key=lambda t: t.weight)
    peaks = ", ".join(f"{t.group.gpu} {t.group.spec.peak_flops / 1e12:.4g} = {_number(t.weight)}" for t in plan.types)
    lines = [f"Batch weights per rank: each GPU's dense bf16 peak over {slowest.group.gpu}'s (TFLOPS: {peaks}); "
             f"measured ones: hsdp tune, or hsdp train's parallel.batch_weights = \"auto\".",
             f"Even split ({plan.model.micro_batch} sequences per rank per micro-batch, {plan.global_batch} in "
             f"all): {plan.even_tokens_per_s:,.0f} tokens/s, {format_seconds(plan.even_step_s)} per step, paced by "
             f"the {even.group.label} ranks.",
             f"Weighted split (the same {plan.global_batch} sequences, per rank "
             f"{' / '.join(f'{t.weighted.batch} on {t.group.gpu}' for t in plan.types)}): "
             f"{plan.weighted_tokens_per_s:,.0f} tokens/s, {format_seconds(plan.weighted_step_s)} per step "
             f"({plan.speedup - 1:+.0%}), paced by the {weighted.group.label} ranks."]
    for t in plan.types:
        for name, s in (("weighted", t.weighted), ("even", t.even)):
            if not s.fits:
                lines.append(f"The {name} split does not fit on {t.group.label}: even at S={s.shard} a rank needs "
                             f"{format_bytes(s.memory.total)} of {format_bytes(t.memory_limit)} usable; use "
                             f"--activation-checkpointing, a smaller --micro-batch or shorter --seq-len.")
    return lines


def print_hetero(plan: HeteroPlan, console: Console | None = None) -> None:
    """The table, the comparison, then the lines to paste (when the weighted split fits)."""
    console = console or _console()
    table = Table(title=f"{plan.model.name} ({plan.model.params / 1e9:.3g}B params) on "
                        f"{' + '.join(t.group.label for t in plan.types)} ({plan.world_size} ranks)")
    for col in HETERO_COLUMNS:
        table.add_column(col, justify="left" if col == "node type" else "right")
    for t in plan.types:
        table.add_row(*_row(t))
    console.print(table)
    for line in summary_lines(plan):
        console.print(f"- {line}", highlight=False)
    if not plan.fits:
        return
    lines = paste_lines(plan)
    console.print("\nPython:", highlight=False)
    for line in lines["python"]:
        console.print(f"  {line}", highlight=False, markup=False, soft_wrap=True)
    console.print("hsdp train (TOML; parallel.sharding_degree=... on the command line alike):", highlight=False)
    for line in lines["toml"]:
        console.print(f"  {line}", highlight=False, markup=False, soft_wrap=True)
