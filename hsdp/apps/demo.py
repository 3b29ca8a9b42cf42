"""``hsdp demo``: ``hsdp train`` with a preset configuration, ending with what sharding saves.

The demo runs the same :class:`~hsdp.apps.train.trainer.Trainer` as ``hsdp train``, configured by
:data:`DEMO`: a tiny byte-level GPT on the Python standard library's sources at a constant learning rate,
no checkpoints, on 2 emulated nodes x 2 ranks of this machine (one torchrun agent per node, each rank
running ``python -m hsdp.apps.demo``). Its run directory is temporary. Parameters, gradients and AdamW
state are sharded across the ranks of a node and replicated across nodes; rank 0 shows the progress and
ends with the demo's summary: the loss, throughput, and every rank's bytes of model state against what
one unsharded replica holds.
"""

from __future__ import annotations

import sys
import tempfile
from typing import TYPE_CHECKING, Any

import torch
from rich.console import Console
from rich.panel import Panel
from rich.table import Table
from rich.text import Text
from torch import nn

from hsdp.apps.train.config import RunConfig
from hsdp.apps.train.config_io import apply_overrides, build_config
from hsdp.apps.train.summary import kib
from hsdp.engine.memory import StateBytes
from hsdp.tools.launch.emulated import USAGE_ERROR

if TYPE_CHECKING:
    from hsdp.apps.train.job import JobOutcome
    from hsdp.apps.train.trainer import Trainer

# What differs from `hsdp train`'s defaults (the rest, e.g. batch 8 per rank, AdamW at lr 2e-3, is shared).
DEMO: dict[str, dict[str, Any]] = {
    "data": {"max_bytes": 1_000_000},
    "optim": {"min_lr": 2e-3, "warmup_steps": 0, "grad_clip": 0.0},  # a constant learning rate, no clipping
    "train": {"steps": 100, "eval_every": 20, "checkpoint_every": 0, "sample_tokens": 60,
              "save_on_signal": False},  # a demo keeps no checkpoint: SIGTERM just ends it
}


def demo_config(overrides: list[str]) -> RunConfig:
    """:data:`DEMO`, then ``section.field=value`` overrides; ``ValueError`` naming a bad one."""
    return build_config(apply_overrides(DEMO, overrides), "the demo's configuration")


def launch(nodes: int, nproc_per_node: int, steps: int | None = None) -> int:
    """``hsdp demo``: start ``nodes`` emulated nodes of ``nproc_per_node`` ranks, each running
    :func:`main`, in a temporary run directory; the exit status. ``steps``: ``None`` keeps the preset's."""
    from hsdp.tools.launch import launch_local

    with tempfile.TemporaryDirectory(prefix="hsdp-demo-") as out:
        overrides = [f"train.out_dir={out}", f"parallel.nodes={nodes}", f"parallel.nproc_per_node={nproc_per_node}",
                     *([] if steps is None else [f"train.steps={steps}"])]
        try:
            cfg = demo_config(overrides)  # checked once here, before starting any rank
        except ValueError as e:
            print(f"hsdp demo: error: {e}", file=sys.stderr)
            return USAGE_ERROR
        return launch_local(cfg.parallel.nodes, cfg.parallel.nproc_per_node, ["-m", "hsdp.apps.demo", *overrides])


# ---------------------------------------------------------------------------------------------------------
# The summary (rank 0), from the Trainer's results.
# ---------------------------------------------------------------------------------------------------------
def unsharded_state_bytes(model: nn.Module) -> StateBytes:
    """What one plain (unwrapped) replica holds after an AdamW step: every parameter, a gradient per
    trainable parameter, and AdamW's two moments plus a float32 ``step`` scalar per trainable tensor."""
    params = list(model.parameters())  # distinct: a tied matrix counts once
    trainable = [p for p in params if p.requires_grad]

    def nbytes(ps: list[nn.Parameter]) -> int:
        return sum(p.numel() * p.element_size() for p in ps)

    adamw = 2 * nbytes(trainable) + 4 * len(trainable)
    return StateBytes(params=nbytes(params), grads=nbytes(trainable), optimizer=adamw)


def held_out_row(records: list[dict[str, Any]]) -> str | None:
    """The first and last held-out losses of the run with their steps (``None`` without evaluations)."""
    evals = [(r["step"], r["eval_loss"]) for r in records if r["eval_loss"] is not None]
    if not evals:
        return None
    (first_step, first), (last_step, last) = evals[0], evals[-1]
    if first_step == last_step:
        return f"{last:.3f} (step {last_step})"
    return f"{first:.3f} -> {last:.3f} (step {first_step} -> {last_step})"


def run_table(summary: dict[str, Any], records: list[dict[str, Any]]) -> Table:
    t = Table(title="HSDP demo", show_header=False)
    t.add_column(style="bold")
    t.add_column()
    m, model = summary["mesh"], summary["model"]
    t.add_row("mesh", f"{m['replicas']} replicas x {m['shards']} shards ({m['world']} ranks)")
    t.add_row("model", f"{model['kind']} '{model['preset']}', {model['params']:,} parameters")
    t.add_row("steps", f"{len(records)} x {summary['tokens'] // len(records):,} tokens")
    t.add_row("train loss", f"{summary['loss_first']:.3f} -> {summary['loss_last']:.3f} (first -> last step)")
    held_out = held_out_row(records)
    if held_out is not None:
        t.add_row("held-out loss", held_out)
    t.add_row("throughput", f"{summary['tokens_per_s']:,.0f} tokens/s over {summary['seconds']:.1f} s")
    return t


def memory_table(ranks: list[dict[str, Any]], unsharded: StateBytes) -> Table:
    # KiB in the cells keeps the table within 80 columns behind the launcher's "[node i] " prefix.
    t = Table(title="Model state per rank (KiB)", caption="plain: the unwrapped model with plain AdamW")
    for name in ("rank", "node", "shard", "params", "grads", "AdamW", "total", "ratio"):
        t.add_column(name, justify="right", no_wrap=True)
    for r in sorted(ranks, key=lambda r: r["rank"]):
        t.add_row(str(r["rank"]), str(r["node"]), str(r["shard"]), kib(r["params"]), kib(r["grads"]),
                  kib(r["optimizer"]), kib(r["total"]), f"{r['total'] / unsharded.total:.2f}x")
    t.add_row("plain", "", "", kib(unsharded.params), kib(unsharded.grads), kib(unsharded.optimizer),
              kib(unsharded.total), "1.00x", style="dim")
    return t


def print_demo_summary(console: Console, outcome: JobOutcome, trainer: Trainer) -> None:
    """The demo's end of run (rank 0): loss and throughput, model state per rank against one plain replica,
    the sample, and whether the loss fell."""
    summary, ranks = outcome.summary, outcome.summary["ranks"]
    with torch.device("meta"):  # the plain replica's shapes and dtypes, nothing allocated
        unsharded = unsharded_state_bytes(trainer.lm.build(trainer.shape))
    console.print(run_table(summary, trainer.result.records))
    console.print(memory_table(ranks, unsharded))
    shards = summary["mesh"]["shards"]
    mean_ratio = sum(r["total"] for r in ranks) / len(ranks) / unsharded.total
    console.print(f"model state per rank: {mean_ratio:.2f}x of plain (ideal with {shards} shards: {1 / shards:.2f}x)")
    if outcome.sample is not None:
        console.print(Panel(Text(outcome.sample), title="sample after training", expand=False))
    first, last = summary["loss_first"], summary["loss_last"]
    verdict = "fell" if last < first else "did NOT fall"
    console.print(f"loss {verdict}: {first:.3f} -> {last:.3f}")


def main(argv: list[str] | None = None) -> int:
    """One rank of the demo (what :func:`launch` starts): ``python -m hsdp.apps.demo [section.field=value ...]``."""
    from hsdp.apps.train.command import run_rank

    return run_rank(demo_config(sys.argv[1:] if argv is None else argv), report=print_demo_summary)


if __name__ == "__main__":
    sys.exit(main())
