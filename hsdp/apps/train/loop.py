"""The training loop of ``hsdp train``: steps, evaluation, metrics, checkpoints, profiling.

One step = ``grad_accum`` micro-batches (all but the last inside ``model.no_sync()``, so the inter-node
hop runs once per step), gradient clipping over the whole sharded gradient, an AdamW step at the
scheduled learning rate. Each step's communication is read from ``model.comm_stats()`` (reset at the
step's start, so evaluation and sampling traffic are not counted) and published as one metrics record.
Every function here is called on every rank in the same order: evaluation, metric averages, warnings and
checkpoints are collectives. A SIGTERM on any rank (``train.save_on_signal``) ends the loop on every rank
after the same step, with a checkpoint there (see ``hsdp.engine.faults.preemption``).
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch

import hsdp
from hsdp.apps.train import resume
from hsdp.apps.train.config import RunConfig
from hsdp.apps.train.lm import lm_loss
from hsdp.apps.train.metrics import MetricsWriter, comm_totals, peak_memory_bytes
from hsdp.apps.train.optimizer import lr_at, set_lr
from hsdp.apps.train.profiling import StepProfiler
from hsdp.apps.train.progress import Reporter
from hsdp.apps.train.rank_warnings import RankWarnings
from hsdp.apps.train.ranks import RankChannel
from hsdp.apps.train.rundir import RunDir
from hsdp.data.text import TokenStream
from hsdp.engine.faults.preemption import StopSignals


@dataclass(frozen=True)
class Trainee:
    """What the loop trains: the wrapped model, its optimizer, its kind and the two token streams."""

    model: hsdp.ShardedModel
    optimizer: hsdp.ShardedOptimizer
    kind: str
    train: TokenStream
    held_out: TokenStream


@dataclass(frozen=True)
class Services:
    """Where the loop reports: the rank channel, rank 0's progress and metric files, warnings, profiler."""

    channel: RankChannel
    run: RunDir
    reporter: Reporter
    writer: MetricsWriter | None  # rank 0 only
    warnings: RankWarnings
    profiler: StepProfiler


@dataclass
class LoopResult:
    """This session's steps: their records (every rank holds them) and this rank's traffic totals."""

    records: list[dict[str, Any]] = field(default_factory=list)
    checkpoints: list[str] = field(default_factory=list)
    checkpoint_step: int | None = None  # the step of the newest of ``checkpoints``
    shard_bytes: float = 0.0  # this rank's, summed over the session's steps
    replicate_bytes: float = 0.0
    trace: str | None = None
    stopped_by_signal: bool = False  # a rank got SIGTERM: every rank stopped after the last record's step

    @property
    def steps(self) -> int:
        return len(self.records)

    @property
    def tokens(self) -> int:
        return sum(r["step_tokens"] for r in self.records)

    @property
    def seconds(self) -> float:
        return sum(r["step_s"] for r in self.records)


def tokens_per_step(cfg: RunConfig, stream: TokenStream) -> int:
    return cfg.train.batch_size * stream.block_size * cfg.train.grad_accum * stream.world_size


def forward_backward(t: Trainee, step: int, accum: int) -> torch.Tensor:
    """Run the step's micro-batches; returns this rank's mean loss (detached)."""
    total = torch.zeros((), dtype=torch.float64)
    device = t.model.mesh.device
    for micro in range(accum):
        x, y = t.train.batch((step - 1) * accum + micro)  # the data position is a function of the step
        x, y = x.to(device), y.to(device)
        last = micro == accum - 1
        with contextlib.nullcontext() if last else t.model.no_sync():
            loss = lm_loss(t.model, t.kind, x, y)
            (loss / accum).backward()
        total += loss.detach().double().cpu()
    return total / accum


def train_step(t: Trainee, cfg: RunConfig, step: int) -> tuple[torch.Tensor, float, float]:
    """One optimizer step; ``(this rank's loss, grad norm before clipping, seconds)``."""
    start = time.perf_counter()
    set_lr(t.optimizer, lr_at(step, cfg.optim, cfg.train.steps))
    # Cleared here rather than after the step: the last step's gradients then count in the summary's
    # model-state bytes, as they occupy memory during every step.
    t.optimizer.zero_grad(set_to_none=True)
    loss = forward_backward(t, step, cfg.train.grad_accum)
    max_norm = cfg.optim.grad_clip or math.inf  # inf: measure the norm, scale nothing
    grad_norm = float(hsdp.clip_grad_norm_(t.model, max_norm))
    t.optimizer.step()
    return loss, grad_norm, time.perf_counter() - start


@torch.no_grad()
def evaluate(t: Trainee, batches: int, channel: RankChannel) -> float:
    """Held-out loss: the same ``batches`` batches per rank every time, averaged over them and the ranks."""
    t.model.eval()
    device = t.model.mesh.device
    losses = [lm_loss(t.model, t.kind, *(b.to(device) for b in t.held_out.batch(i))).double().cpu()
              for i in range(batches)]
    t.model.train()
    return channel.mean([torch.stack(losses).mean().item()])[0]


def step_record(t: Trainee, cfg: RunConfig, step: int, channel: RankChannel,
                stop_requested: bool) -> tuple[dict[str, Any], bool]:
    """Run step ``step`` and measure it; also ``True`` when some rank asked to stop (the same on every rank:
    the request travels in the loss average)."""
    t.model.reset_comm_stats()
    loss, grad_norm, seconds = train_step(t, cfg, step)
    comm = comm_totals(t.model.comm_stats())
    mean_loss, stop_votes = channel.mean([loss.item(), float(stop_requested)])
    if not math.isfinite(mean_loss):
        raise FloatingPointError(f"the loss is {mean_loss} at step {step}: lower optim.lr or set optim.grad_clip")
    n_tokens = tokens_per_step(cfg, t.train)
    record = {"step": step, "loss": mean_loss, "eval_loss": None, "lr": lr_at(step, cfg.optim, cfg.train.steps),
              "grad_norm": grad_norm, "tokens": step * n_tokens, "step_tokens": n_tokens, "step_s": seconds,
              "tokens_per_s": n_tokens / max(seconds, 1e-9), **comm,
              "mem_bytes": peak_memory_bytes(t.model.mesh.device)}
    return record, stop_votes > 0


def _due(step: int, every: int, last: int) -> bool:
    return every > 0 and (step % every == 0 or step == last)


def after_step(t: Trainee, cfg: RunConfig, svc: Services, record: dict[str, Any], result: LoopResult) -> None:
    """Publish the step, flush warnings, checkpoint when due."""
    step = record["step"]
    if svc.writer is not None:
        svc.writer.write({k: v for k, v in record.items() if k != "step_tokens"})
    svc.reporter.update(step, record["loss"], record["tokens_per_s"])
    if record["eval_loss"] is not None:
        svc.reporter.note(f"step {step}: held-out loss {record['eval_loss']:.4f}")
    if step % cfg.train.log_every == 0 or step == cfg.train.steps:
        svc.warnings.flush(svc.channel)
    if _due(step, cfg.train.checkpoint_every, cfg.train.steps):
        checkpoint(t, cfg, svc, result, step)
        svc.reporter.note(f"step {step}: checkpoint {result.checkpoints[-1]}")


def checkpoint(t: Trainee, cfg: RunConfig, svc: Services, result: LoopResult, step: int) -> None:
    """Save the state after ``step`` (a collective)."""
    result.checkpoints.append(resume.save(svc.run, t.model, t.optimizer, step, cfg.train.keep_checkpoints))
    result.checkpoint_step = step


def stop_on_signal(t: Trainee, cfg: RunConfig, svc: Services, result: LoopResult) -> None:
    """Every rank: checkpoint the last step (unless it just was) so that ``--resume`` continues there."""
    step = result.records[-1]["step"]
    if result.checkpoint_step != step:
        checkpoint(t, cfg, svc, result, step)
    result.stopped_by_signal = True
    svc.reporter.note(f"step {step}: stopping on SIGTERM; checkpoint {result.checkpoints[-1]}")


def train(t: Trainee, cfg: RunConfig, svc: Services, start_step: int) -> LoopResult:
    """Steps ``start_step + 1`` to ``train.steps`` (or ``train.stop_after``), or until a SIGTERM."""
    result = LoopResult()
    end = cfg.train.stop_after or cfg.train.steps
    with StopSignals(cfg.train.save_on_signal) as signals:
        for step in range(start_step + 1, end + 1):
            svc.profiler.before(step)
            record, stopping = step_record(t, cfg, step, svc.channel, signals.requested)
            result.trace = svc.profiler.after(step) or result.trace
            if _due(step, cfg.train.eval_every, cfg.train.steps):
                record["eval_loss"] = evaluate(t, cfg.train.eval_batches, svc.channel)
            result.records.append(record)
            result.shard_bytes += record["shard_bytes"]
            result.replicate_bytes += record["replicate_bytes"]
            after_step(t, cfg, svc, record, result)
            if stopping:
                stop_on_signal(t, cfg, svc, result)
                break
    result.trace = svc.profiler.close() or result.trace
    return result
