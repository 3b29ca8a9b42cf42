"""One rank of an ``hsdp train`` job: build everything from the configuration, train, summarise.

Runs on every rank (under torchrun, ``hsdp launch`` or ``hsdp train``'s own local launcher). Order:
mesh -> run directory -> corpus -> model (rank 0's initial weights are broadcast) -> ShardedModel ->
sharded AdamW -> resume -> loop -> summary -> text sample. Every step that touches other ranks is a
collective, taken by all ranks in the same order.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
from rich.console import Console
from rich.panel import Panel
from rich.text import Text

import hsdp
from hsdp.apps.train import resume, summary
from hsdp.apps.train.config import RunConfig
from hsdp.apps.train.corpus import Corpus, load_corpus
from hsdp.apps.train.lm import BuiltModel, build_model, logits_of, sample
from hsdp.apps.train.loop import LoopResult, Services, Trainee, train
from hsdp.apps.train.metrics import MetricsWriter
from hsdp.apps.train.optimizer import build_optimizer
from hsdp.apps.train.profiling import StepProfiler, profile_window
from hsdp.apps.train.progress import Reporter
from hsdp.apps.train.rank_warnings import RankWarnings
from hsdp.apps.train.ranks import RankChannel
from hsdp.apps.train.rundir import RunDir, prepare_run_dir
from hsdp.data.text import TokenStream

_PRECISION = {"fp32": None, "bf16": hsdp.MixedPrecision(param_dtype=torch.bfloat16)}


@dataclass(frozen=True)
class JobOutcome:
    """What a rank's job produced: the summary (every rank holds it) and the sampled text; ``stopped`` when a
    SIGTERM ended it early (after a checkpoint)."""

    summary: dict[str, Any]
    sample: str | None
    stopped: bool = False


def replica_hop(name: str) -> Any:
    from hsdp.engine.hops import AllReduceHop, Int8ErrorFeedbackHop

    return {"fp32": AllReduceHop(), "bf16": AllReduceHop(torch.bfloat16), "int8": Int8ErrorFeedbackHop()}[name]


def build_trainee(cfg: RunConfig, mesh: hsdp.HSDPMesh, corpus: Corpus) -> tuple[Trainee, BuiltModel]:
    """The wrapped model, its optimizer and this rank's token streams."""
    torch.manual_seed(cfg.train.seed)  # rank 0's weights are broadcast; the seed makes them reproducible
    built = build_model(cfg.model, corpus.tokenizer.vocab_size)
    built.module.to(mesh.device)  # this rank's GPU under NCCL (init_mesh selected it), else the CPU
    model = hsdp.ShardedModel(built.module, mesh=mesh, reshard_after_forward=cfg.parallel.reshard_after_forward,
                              mixed_precision=_PRECISION[cfg.parallel.mixed_precision],
                              replica_hop=replica_hop(cfg.parallel.replica_hop))
    # Per-rank generator state from here on: dropout masks differ across ranks, as their data does.
    torch.manual_seed(cfg.train.seed + 1 + mesh.rank)
    optimizer = build_optimizer(model, cfg.optim)
    batch = cfg.train.batch_size
    streams = (TokenStream(corpus.train, built.block_size, batch, seed=cfg.train.seed, mesh=mesh),
               TokenStream(corpus.held_out, built.block_size, batch, seed=cfg.train.seed + 1, mesh=mesh))
    return Trainee(model, optimizer, built.kind, *streams), built


def text_sample(t: Trainee, corpus: Corpus, cfg: RunConfig, block_size: int) -> str | None:
    """A continuation of ``train.sample_prompt`` (every rank takes part: each token is one forward)."""
    if not cfg.train.sample_tokens:
        return None
    prompt = corpus.tokenizer.encode(cfg.train.sample_prompt) or [0]
    t.model.eval()
    device = t.model.mesh.device
    ids = sample(lambda idx: logits_of(t.model, t.kind, idx.to(device)), prompt, cfg.train.sample_tokens,
                 block_size, seed=cfg.train.seed)
    t.model.train()
    return corpus.tokenizer.decode(ids)


def _services(cfg: RunConfig, channel: RankChannel, run: RunDir, console: Console, warns: RankWarnings,
              start_step: int) -> Services:
    end = cfg.train.stop_after or cfg.train.steps
    window = profile_window(start_step, end, cfg.train.profile_steps)
    writer = MetricsWriter(run.path, start_step if cfg.train.resume else None) if channel.is_root else None
    reporter = Reporter(console, cfg.train.steps, cfg.train.log_every, channel.is_root, start_step)
    profiler = StepProfiler(cfg.train.profile, window, run.profile, channel.mesh.rank)
    return Services(channel, run, reporter, writer, warns, profiler)


def _finish(cfg: RunConfig, t: Trainee, built: BuiltModel, result: LoopResult, svc: Services,
            start_step: int) -> dict[str, Any]:
    ranks = svc.channel.gather(summary.rank_record(t.model, t.optimizer, result))
    out = summary.build_summary(cfg, t.model.mesh, built.n_params, result, ranks, start_step)
    if svc.channel.is_root:
        summary.write_summary(svc.run.summary, out)
    return out


@dataclass(frozen=True)
class _Setup:
    """Everything built before the first step."""

    channel: RankChannel
    run: RunDir
    corpus: Corpus
    trainee: Trainee
    built: BuiltModel
    start_step: int


def _set_up(cfg: RunConfig, console: Console) -> _Setup:
    mesh = hsdp.init_mesh(cfg.parallel.sharding_degree or None)
    channel = RankChannel(mesh)
    run = prepare_run_dir(cfg, channel)
    corpus = load_corpus(cfg.data)
    t, built = build_trainee(cfg, mesh, corpus)
    start_step, loaded = resume.resume(run, t.model, t.optimizer, channel) if cfg.train.resume else (0, "")
    if channel.is_root:
        console.print(f"hsdp train: {mesh.replicate_degree} x {mesh.sharding_degree} mesh, {built.description}",
                      markup=False)
        console.print(f"data: {corpus.description}", markup=False)
        console.print(f"resumed from {loaded} (step {start_step})" if loaded else f"run directory: {run.path}",
                      markup=False)
    return _Setup(channel, run, corpus, t, built, start_step)


def _complete(cfg: RunConfig, s: _Setup, console: Console) -> JobOutcome:
    """A resumed run that had already reached ``train.steps`` (e.g. a requeued job): nothing to do."""
    if s.channel.is_root:
        console.print(f"{s.run.path} is complete ({s.start_step} of {cfg.train.steps} steps): raise "
                      f"train.steps to train further", markup=False)
    return JobOutcome({"steps": {"first": s.start_step + 1, "last": s.start_step, "planned": cfg.train.steps}},
                      None)


def run_job(cfg: RunConfig, console: Console | None = None) -> JobOutcome:
    """Train as configured on this rank; every rank of the job calls it. Rank 0 prints progress, the
    summary and the sample, and writes the run directory's files."""
    console = console or Console(highlight=False)
    # Plain text: a warning or a path may contain "[...]", which rich would read as markup.
    with RankWarnings(lambda line: console.print(line, markup=False)) as warns:
        s = _set_up(cfg, console)
        warns.flush(s.channel)
        if s.start_step >= cfg.train.steps:
            return _complete(cfg, s, console)
        svc = _services(cfg, s.channel, s.run, console, warns, s.start_step)
        with svc.reporter, svc.writer or contextlib.nullcontext():
            result = train(s.trainee, cfg, svc, s.start_step)
        final = _finish(cfg, s.trainee, s.built, result, svc, s.start_step)
        # No sample after a SIGTERM: the grace period before SIGKILL is for the checkpoint.
        text = None if result.stopped_by_signal else text_sample(s.trainee, s.corpus, cfg, s.built.block_size)
        outcome = JobOutcome(final, text, result.stopped_by_signal)
        warns.flush(s.channel)
    if s.channel.is_root:
        _report(console, outcome, s.corpus, s.run)
    return outcome


def _report(console: Console, outcome: JobOutcome, corpus: Corpus, run: RunDir) -> None:
    summary.print_summary(console, outcome.summary, corpus.description)
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
