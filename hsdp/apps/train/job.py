"""One rank of an ``hsdp train`` job: build the :class:`~hsdp.apps.train.trainer.Trainer`, train,
summarise, sample, report.

Runs on every rank (under torchrun, ``hsdp launch`` or ``hsdp train``'s own local launcher). Every step
that touches other ranks is a collective, taken by all ranks in the same order; rank 0 alone reports.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.panel import Panel
from rich.text import Text

from hsdp.apps.train import summary
from hsdp.apps.train.config import RunConfig
from hsdp.apps.train.elastic_run import quorum_lost_text
from hsdp.apps.train.rank_warnings import RankWarnings
from hsdp.apps.train.rundir import release_run_dir
from hsdp.apps.train.trainer import Trainer


@dataclass(frozen=True)
class JobOutcome:
    """What a rank's job produced: the summary (every rank holds it) and the sampled text; ``stopped`` when a
    SIGTERM ended it early (after a checkpoint); ``quorum_lost``: why the coordinator of an elastic job stopped it
    (fewer live replicas than its minimum)."""

    summary: dict[str, Any]
    sample: str | None
    stopped: bool = False
    quorum_lost: str = ""


Report = Callable[[Console, JobOutcome, Trainer], None]


def print_report(console: Console, outcome: JobOutcome, trainer: Trainer) -> None:
    """``hsdp train``'s end of run (rank 0): the summary tables, the sample (also saved), where the files are."""
    run = trainer.run
    summary.print_summary(console, outcome.summary, trainer.corpus.description)
    if outcome.sample is not None:
        with open(run.sample, "w", encoding="utf-8") as f:
            f.write(outcome.sample)
        console.print(Panel(Text(outcome.sample), title="sample after training", expand=False))
    if outcome.summary["trace"]:
        console.print(f"profiler traces: {run.profile}/rank<r>.json (open in ui.perfetto.dev)", markup=False)
    console.print(f"metrics: {run.path}/metrics.jsonl; plots: hsdp report {run.path}", markup=False)
    if outcome.stopped:
        last = outcome.summary["steps"]["last"]
        console.print(f"stopped by SIGTERM after step {last} (checkpoint saved): continue with hsdp train "
                      f"--resume and the same configuration", markup=False)


def _complete(trainer: Trainer) -> JobOutcome:
    """A resumed run that had already reached ``train.steps`` (e.g. a requeued job): nothing to do."""
    planned = trainer.cfg.train.steps
    if trainer.channel.is_root:
        trainer.console.print(f"{trainer.run.path} is complete ({trainer.start_step} of {planned} steps): raise "
                              f"train.steps to train further", markup=False)
    return JobOutcome({"steps": {"first": trainer.start_step + 1, "last": trainer.start_step, "planned": planned}},
                      None)


def run_job(cfg: RunConfig, console: Console | None = None, report: Report = print_report) -> JobOutcome:
    """Train as configured on this rank; every rank of the job calls it. Rank 0 prints progress, then
    ``report`` (``hsdp demo`` passes its own), and writes the run directory's files."""
    console = console or Console(highlight=False)
    # Plain text: a warning or a path may contain "[...]", which rich would read as markup.
    with RankWarnings(lambda line: console.print(line, markup=False)) as warns:
        trainer = Trainer(cfg, console, warns)
        trainer.announce()
        warns.flush(trainer.channel)
        if trainer.is_complete:
            release_run_dir(trainer.run)
            return _complete(trainer)
        result = trainer.train()
        final = trainer.summarize()
        # No sample after a SIGTERM: the grace period before SIGKILL is for the checkpoint. Elastic: the writer's.
        stopped = result.stopped_by_signal or bool(result.quorum_lost)
        text = None if stopped or not trainer.writes else trainer.sample_text()
        outcome = JobOutcome(final, text, result.stopped_by_signal, result.quorum_lost)
        warns.flush(trainer.channel)
    if trainer.channel.is_root and trainer.writes:
        report(console, outcome, trainer)
    elif trainer.channel.is_root and trainer.pen is not None and not result.quorum_lost:
        console.print(trainer.pen.done_text(trainer.start_step + 1, trainer.start_step + result.steps), markup=False)
    if trainer.channel.is_root and result.quorum_lost:
        saved = result.checkpoints[-1] if result.checkpoint_step == result.lost_at and trainer.writes else None
        console.print(quorum_lost_text(trainer.mesh.replicate_rank, result.quorum_lost, result.lost_at, saved),
                      markup=False)
    # Only now: the report writes into the run directory too. After an error the lease stays with this
    # process until it exits.
    release_run_dir(trainer.run)
    return outcome
