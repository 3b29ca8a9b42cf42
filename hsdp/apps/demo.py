"""The ``hsdp demo`` job: train a tiny byte-level GPT with HSDP and show what sharding saves.

Meant for torchrun, e.g. 2 nodes x 2 ranks (``hsdp demo`` emulates that on one machine)::

    torchrun --nnodes 2 --nproc-per-node 2 ... -m hsdp.apps.demo --steps 100

Parameters, gradients and AdamW state are sharded across the ranks of a node and replicated across
nodes. Rank 0 shows the progress (a live bar on a terminal, a line every ``--log-every`` steps otherwise)
and ends with a summary: the loss before and after, throughput, and every rank's bytes of model state
against what one unsharded replica holds.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from rich.console import Console
from rich.panel import Panel
from rich.table import Table
from rich.text import Text
from torch import nn

import hsdp
from hsdp.apps.train.progress import Reporter
from hsdp.apps.train.ranks import RankChannel
from hsdp.data.text import ByteTokenizer, TokenStream, as_tokens, default_corpus_bytes, split_tokens
from hsdp.engine.memory import StateBytes
from hsdp.models import GPT, preset


@dataclass(frozen=True)
class DemoConfig:
    """What the demo trains and for how long. ``batch_size`` is per rank."""

    steps: int = 100
    preset: str = "tiny"
    batch_size: int = 8
    lr: float = 2e-3
    weight_decay: float = 0.1
    seed: int = 0
    log_every: int = 10
    corpus_bytes: int = 1_000_000
    eval_batches: int = 4
    sample_tokens: int = 60


def parse_args(argv: list[str] | None = None) -> DemoConfig:
    d = DemoConfig()
    p = argparse.ArgumentParser(prog="python -m hsdp.apps.demo", description="HSDP demo: train a tiny GPT")
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--preset", default=d.preset, help="a byte-vocabulary shape from hsdp.models.PRESETS")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="sequences per rank and step")
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--log-every", type=int, default=d.log_every)
    p.add_argument("--sample-tokens", type=int, default=d.sample_tokens, help="0 skips the text sample")
    a = p.parse_args(argv)
    if a.steps < 1:
        p.error("--steps must be at least 1")
    return DemoConfig(steps=a.steps, preset=a.preset, batch_size=a.batch_size, lr=a.lr, seed=a.seed,
                      log_every=max(1, a.log_every), sample_tokens=max(0, a.sample_tokens))


# ---------------------------------------------------------------------------------------------------------
# Measurements.
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


def mean_over_ranks(channel: RankChannel, value: torch.Tensor) -> float:
    """The average of a scalar over every rank (a collective: all ranks must call it)."""
    return channel.mean([value.detach().float().item()])[0]


@torch.no_grad()
def evaluate(model: nn.Module, stream: TokenStream, batches: int, channel: RankChannel) -> float:
    """Held-out loss averaged over ``batches`` batches per rank and over the ranks."""
    model.eval()
    losses = [model(*stream.batch(i))[1] for i in range(batches)]
    model.train()
    return mean_over_ranks(channel, torch.stack(losses).mean())


def rank_record(mesh: hsdp.HSDPMesh, model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, int]:
    """This rank's place in the mesh and its model-state bytes, for the summary."""
    node = int(os.environ.get("GROUP_RANK", mesh.replicate_rank))  # torchrun's node rank
    place = {"rank": mesh.rank, "node": node, "shard": mesh.shard_rank}
    return {**place, **hsdp.state_bytes(model, opt).as_dict()}


# ---------------------------------------------------------------------------------------------------------
# Training.
# ---------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TrainResult:
    """Rank-averaged training loss per step, tokens processed by all ranks, and the training time."""

    losses: list[float]
    tokens: int
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)


def train(model: nn.Module, opt: torch.optim.Optimizer, stream: TokenStream, cfg: DemoConfig,
          reporter: Reporter, channel: RankChannel) -> TrainResult:
    tokens_per_step = stream.batch_size * stream.block_size * dist.get_world_size()
    losses: list[float] = []
    start = time.perf_counter()
    for step in range(cfg.steps):
        opt.zero_grad(set_to_none=True)
        _, loss = model(*stream.batch(step))
        loss.backward()
        opt.step()
        losses.append(mean_over_ranks(channel, loss))
        elapsed = time.perf_counter() - start
        reporter.update(step + 1, losses[-1], tokens_per_step * (step + 1) / elapsed)
    return TrainResult(losses, tokens_per_step * cfg.steps, time.perf_counter() - start)


def sample_text(model: GPT, prompt: str, tokens: int, seed: int) -> str:
    """A continuation of ``prompt``. Every rank must call it: each new token is one sharded forward."""
    tok = ByteTokenizer()
    idx = torch.tensor([tok.encode(prompt)], dtype=torch.long)
    g = torch.Generator().manual_seed(seed)
    model.eval()
    out = model.generate(idx, tokens, temperature=0.8, top_k=20, generator=g)
    model.train()
    return tok.decode(out[0])


# ---------------------------------------------------------------------------------------------------------
# Summary tables (rank 0).
# ---------------------------------------------------------------------------------------------------------
def _kib(n: float) -> str:
    return f"{n / 1024:,.1f}"


def run_table(cfg: DemoConfig, mesh: hsdp.HSDPMesh, result: TrainResult, evals: tuple[float, float],
              n_params: int) -> Table:
    t = Table(title="HSDP demo", show_header=False)
    t.add_column(style="bold")
    t.add_column()
    t.add_row("mesh", f"{mesh.replicate_degree} replicas x {mesh.sharding_degree} shards "
                      f"({mesh.world_size} ranks)")
    t.add_row("model", f"GPT '{cfg.preset}', {n_params:,} parameters")
    t.add_row("steps", f"{cfg.steps} x {result.tokens // cfg.steps:,} tokens")
    t.add_row("train loss", f"{result.losses[0]:.3f} -> {result.losses[-1]:.3f} (first -> last step)")
    t.add_row("held-out loss", f"{evals[0]:.3f} -> {evals[1]:.3f} (before -> after)")
    t.add_row("throughput", f"{result.tokens_per_s:,.0f} tokens/s over {result.seconds:.1f} s")
    return t


def memory_table(records: list[dict[str, int]], unsharded: StateBytes) -> Table:
    # KiB in the cells keeps the table within 80 columns behind the launcher's "[node i] " prefix.
    t = Table(title="Model state per rank (KiB)", caption="plain: the unwrapped model with plain AdamW")
    for name in ("rank", "node", "shard", "params", "grads", "AdamW", "total", "ratio"):
        t.add_column(name, justify="right", no_wrap=True)
    for r in sorted(records, key=lambda r: r["rank"]):
        t.add_row(str(r["rank"]), str(r["node"]), str(r["shard"]), _kib(r["params"]), _kib(r["grads"]),
                  _kib(r["optimizer"]), _kib(r["total"]), f"{r['total'] / unsharded.total:.2f}x")
    t.add_row("plain", "", "", _kib(unsharded.params), _kib(unsharded.grads), _kib(unsharded.optimizer),
              _kib(unsharded.total), "1.00x", style="dim")
    return t


def print_summary(console: Console, cfg: DemoConfig, mesh: hsdp.HSDPMesh, result: TrainResult,
                  evals: tuple[float, float], records: list[dict[str, int]], unsharded: StateBytes,
                  n_params: int, sample: str | None) -> None:
    console.print(run_table(cfg, mesh, result, evals, n_params))
    console.print(memory_table(records, unsharded))
    mean_ratio = sum(r["total"] for r in records) / len(records) / unsharded.total
    console.print(f"model state per rank: {mean_ratio:.2f}x of plain "
                  f"(ideal with {mesh.sharding_degree} shards: {1 / mesh.sharding_degree:.2f}x)")
    if sample is not None:
        console.print(Panel(Text(sample), title="sample after training", expand=False))
    first, last = result.losses[0], result.losses[-1]
    verdict = "fell" if last < first else "did NOT fall"
    console.print(f"loss {verdict}: {first:.3f} -> {last:.3f}")


# ---------------------------------------------------------------------------------------------------------
# The job.
# ---------------------------------------------------------------------------------------------------------
def run(cfg: DemoConfig, mesh: hsdp.HSDPMesh, console: Console) -> None:
    is_root = mesh.rank == 0
    channel = RankChannel(mesh)  # metric averages and records, outside the model's comm stats
    torch.manual_seed(cfg.seed)  # rank 0's initial weights are broadcast: replicas start identical
    gpt_cfg = preset(cfg.preset)
    if gpt_cfg.vocab_size != ByteTokenizer.vocab_size:
        raise ValueError(f"preset {cfg.preset!r} has vocab {gpt_cfg.vocab_size}: the demo needs a byte "
                         f"vocabulary (256), e.g. 'tiny' or 'small'")
    model = GPT(gpt_cfg)
    n_params, unsharded = model.num_params(), unsharded_state_bytes(model)
    model = hsdp.ShardedModel(model, mesh=mesh)
    opt = hsdp.ShardedOptimizer(model, torch.optim.AdamW(model.parameters(), lr=cfg.lr,
                                                         weight_decay=cfg.weight_decay))
    train_tokens, eval_tokens = split_tokens(as_tokens(default_corpus_bytes(cfg.corpus_bytes)))
    stream = TokenStream(train_tokens, gpt_cfg.block_size, cfg.batch_size, seed=cfg.seed, mesh=mesh)
    held_out = TokenStream(eval_tokens, gpt_cfg.block_size, cfg.batch_size, seed=cfg.seed + 1, mesh=mesh)
    eval_before = evaluate(model, held_out, cfg.eval_batches, channel)
    with Reporter(console, cfg.steps, cfg.log_every, enabled=is_root) as reporter:
        result = train(model, opt, stream, cfg, reporter, channel)
    records = channel.gather(rank_record(mesh, model, opt))  # before zero_grad: grads count
    eval_after = evaluate(model, held_out, cfg.eval_batches, channel)
    sample = sample_text(model, "def ", cfg.sample_tokens, cfg.seed) if cfg.sample_tokens else None
    if is_root:
        print_summary(console, cfg, mesh, result, (eval_before, eval_after), records, unsharded, n_params,
                      sample)
    if not all(math.isfinite(x) for x in result.losses):
        raise RuntimeError("training produced a non-finite loss")


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    # Several ranks share the CPUs: one intra-op thread each avoids oversubscription.
    torch.set_num_threads(1)
    mesh = hsdp.init_mesh()
    try:
        run(cfg, mesh, Console(highlight=False))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
