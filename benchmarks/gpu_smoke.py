"""GPU smoke test: train one GPT with hsdp and with PyTorch FSDP2 and compare losses and step times.

Both frameworks start from the same initial weights (one reference model, deep-copied), see the same
batches, use the same optimizer and the same ``("replicate", "shard")`` device mesh (1 x 1 on one GPU).
The run passes when the per-step losses agree within the precision's tolerance; step times, tokens/s and
peak memory are printed side by side and written to ``<out>/gpu_smoke_<date>.{json,md}``.

Precision (``--precision``), identical for both frameworks so the comparison is fair:

* ``mixed-bf16`` (default on CUDA): each framework's own mixed-precision policy with the same dtypes:
  bf16 all-gather and compute, fp32 reduce-scatter, fp32 master shards and optimizer state.
* ``autocast-bf16``: fp32 parameters, gradients and optimizer state, matmuls in bf16
  under ``torch.autocast``; FSDP2 gets ``MixedPrecisionPolicy()`` (no casting of its own): both gather
  fp32 parameters and reduce fp32 gradients, the same bytes on the wire and the same arithmetic.
* ``bf16``: the model is cast to bf16 before wrapping (pure bf16: parameters, gradients, optimizer state
  and collectives), again the same for both.
* ``fp32`` (default on CPU): no reduced precision; the losses must then agree almost exactly.

Run on one GPU with ``benchmarks/gpu_smoke.sh`` (torchrun, NCCL; ``benchmarks/gpu_check.sh`` runs it on the
``gpt-1b`` preset after the CUDA tests); check on CPU (gloo) with
``torchrun --standalone --nproc-per-node 1 benchmarks/gpu_smoke.py --device cpu --steps 3 --out /tmp``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import gc
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import hsdp
from hsdp.models import GPT, preset

ROOT = Path(__file__).resolve().parents[1]
PRECISIONS = ("mixed-bf16", "autocast-bf16", "bf16", "fp32")
# Relative tolerance on each step's loss. bf16 keeps 8 significant bits (eps 2**-8 ~ 0.4%): a few ulps of
# drift over some steps is agreement; a wrong gradient or a missed update is off by far more.
RTOL = {"mixed-bf16": 2e-2, "autocast-bf16": 2e-2, "bf16": 3e-2, "fp32": 1e-4}
# What each precision means for both frameworks (the results files say which one ran).
PRECISION_NOTES = {
    "mixed-bf16": "fp32 master shards and optimizer state, bf16 all-gather and compute, fp32 reduce-scatter: "
                  "hsdp MixedPrecision(param_dtype=bf16, reduce_dtype=fp32) vs FSDP2 "
                  "MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)",
    "autocast-bf16": "fp32 parameters, gradients, optimizer state and collectives; matmuls in bf16 under "
                     "torch.autocast; FSDP2 with MixedPrecisionPolicy() (no casting of its own)",
    "bf16": "model cast to bf16 before wrapping: bf16 parameters, gradients, optimizer state and collectives",
    "fp32": "fp32 throughout",
}
METHOD = ("Same initial weights (one reference GPT, deep-copied), same per-rank batches, same AdamW, same "
          "('replicate', 'shard') mesh; hsdp wraps each block as a unit (default policy), FSDP2 calls "
          "fully_shard on each block and then the root. Step time is wall time from before forward to after "
          "optimizer.zero_grad, with a device synchronize at both ends.")


@dataclass
class RunResult:
    """One framework's run: per-step loss (mean over ranks) and wall time."""

    name: str
    losses: list[float]
    step_ms: list[float]
    peak_mem_gib: float | None


# ---------------------------------------------------------------------------------------------------------
# Setup.
# ---------------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--preset", default=None, help="hsdp.models.gpt preset (default: gpt2-124m on cuda, "
                   "tiny on cpu)")
    p.add_argument("--precision", choices=PRECISIONS, default=None,
                   help="default: autocast-bf16 on cuda, fp32 on cpu")
    p.add_argument("--steps", type=int, default=20, help="training steps per framework (all compared)")
    p.add_argument("--warmup", type=int, default=3, help="leading steps left out of the timings")
    p.add_argument("--batch-size", type=int, default=None, help="per rank (default: 8 on cuda, 4 on cpu)")
    p.add_argument("--seq-len", type=int, default=None, help="default: the preset's block size")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sharding-degree", type=int, default=None, help="default: every rank (1 x world mesh)")
    p.add_argument("--rtol", type=float, default=None, help="loss tolerance (default: by precision)")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results",
                   help="folder for the JSON and Markdown result files")
    args = p.parse_args(argv)
    on_cuda = args.device == "cuda"
    args.preset = args.preset or ("gpt2-124m" if on_cuda else "tiny")
    args.precision = args.precision or ("mixed-bf16" if on_cuda else "fp32")
    args.batch_size = args.batch_size or (8 if on_cuda else 4)
    args.rtol = args.rtol if args.rtol is not None else RTOL[args.precision]
    if args.steps < 1:
        p.error("--steps must be at least 1")
    if on_cuda and not torch.cuda.is_available():
        p.error("--device cuda but CUDA is not available: pass --device cpu")
    return args


def setup(device_type: str) -> torch.device:
    """Init the process group from the torchrun environment; NCCL on CUDA, gloo on CPU."""
    if device_type == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)  # before init: NCCL binds this rank to its own GPU
        dist.init_process_group("nccl")
        return torch.device("cuda", local_rank)
    dist.init_process_group("gloo")
    return torch.device("cpu")


def build_mesh(device_type: str, sharding_degree: int | None) -> DeviceMesh:
    """The ``(replicate, shard)`` mesh both frameworks run on; 1 x 1 on a single device."""
    world = dist.get_world_size()
    s = sharding_degree or world
    if world % s:
        raise ValueError(f"--sharding-degree {s} does not divide the world size {world}")
    return init_device_mesh(device_type, (world // s, s), mesh_dim_names=("replicate", "shard"))


def make_batches(vocab: int, batch: int, seq: int, steps: int, seed: int,
                 device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Learnable synthetic text: each next token is a fixed permutation of the last (10% random).

    The permutation is the same on every rank (one "language"); the sequences differ per rank, as data
    parallel training needs. Built on the CPU up front so both frameworks get bit-identical batches and
    data generation stays out of the step times.
    """
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(vocab, generator=g)
    g.manual_seed(seed + 1 + dist.get_rank())
    batches = []
    for _ in range(steps):
        tokens = torch.empty(batch, seq + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(vocab, (batch,), generator=g)
        noise = torch.rand(batch, seq, generator=g) < 0.1
        random_tokens = torch.randint(vocab, (batch, seq), generator=g)
        for t in range(seq):
            tokens[:, t + 1] = torch.where(noise[:, t], random_tokens[:, t], perm[tokens[:, t]])
        tokens = tokens.to(device)
        batches.append((tokens[:, :-1], tokens[:, 1:]))
    return batches


# ---------------------------------------------------------------------------------------------------------
# The two frameworks.
# ---------------------------------------------------------------------------------------------------------
def _adamw(params: list[nn.Parameter], lr: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.1)


def wrap_hsdp(model: GPT, dm: DeviceMesh, lr: float, precision: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    # Default wrap policy: every block of GPT.blocks is a unit, the embeddings, final norm and tied head
    # form the root unit -- the same grouping as the FSDP2 calls below.
    mp = hsdp.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if precision == "mixed-bf16" else None
    sharded = hsdp.ShardedModel(model, mesh=hsdp.init_mesh(device_mesh=dm), mixed_precision=mp)
    return sharded, hsdp.ShardedOptimizer(sharded, _adamw(list(sharded.parameters()), lr))


def wrap_fsdp2(model: GPT, dm: DeviceMesh, lr: float, precision: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    # The same policy as hsdp's for mixed-bf16; otherwise no casting of its own (dtypes from --precision).
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if precision == "mixed-bf16" else MixedPrecisionPolicy()
    for block in model.blocks:
        fully_shard(block, mesh=dm, mp_policy=mp)
    fully_shard(model, mesh=dm, mp_policy=mp)
    return model, _adamw(list(model.parameters()), lr)


WRAPPERS: dict[str, Callable[[GPT, DeviceMesh, float, str], tuple[nn.Module, torch.optim.Optimizer]]] = {
    "hsdp": wrap_hsdp,
    "fsdp2": wrap_fsdp2,
}


# ---------------------------------------------------------------------------------------------------------
# Training and timing.
# ---------------------------------------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    if precision == "autocast-bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _mean_over_ranks(values: list[float], device: torch.device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)  # SUM: gloo has no AVG
    return (t / dist.get_world_size()).tolist()


def train(name: str, ref: GPT, dm: DeviceMesh, batches: list, args: argparse.Namespace,
          device: torch.device) -> RunResult:
    """Train a fresh copy of ``ref`` with one framework; loss and wall time of every step."""
    model = copy.deepcopy(ref).to(device)  # deepcopy keeps the tied embedding/head a single Parameter
    if args.precision == "bf16":
        model = model.to(torch.bfloat16)  # before wrapping: both frameworks shard bf16 parameters
    model, opt = WRAPPERS[name](model, dm, args.lr, args.precision)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    losses, times = [], []
    for x, y in batches:
        _sync(device)
        start = time.perf_counter()
        with _autocast(device, args.precision):
            _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
        losses.append(loss.detach().float())
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    losses_f = _mean_over_ranks([v.item() for v in losses], device)
    del model, opt
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the next framework starts from the same free memory
    return RunResult(name, losses_f, times, peak)


# ---------------------------------------------------------------------------------------------------------
# Reporting.
# ---------------------------------------------------------------------------------------------------------
def loss_deviation(a: RunResult, b: RunResult) -> float:
    """The largest relative per-step loss difference (``inf`` if a loss is not finite)."""
    worst = 0.0
    for x, y in zip(a.losses, b.losses, strict=True):
        if not (math.isfinite(x) and math.isfinite(y)):
            return math.inf
        worst = max(worst, abs(x - y) / max(abs(y), 1e-8))
    return worst


def timing(r: RunResult, warmup: int, tokens_per_step: int) -> dict[str, float | None]:
    timed = r.step_ms[min(warmup, len(r.step_ms) - 1):]  # at least one step, even when --steps <= --warmup
    median = statistics.median(timed)
    return {"median_step_ms": round(median, 3), "mean_step_ms": round(statistics.fmean(timed), 3),
            "tokens_per_s": round(tokens_per_step / (median / 1e3), 1), "timed_steps": len(timed),
            "peak_mem_gib": None if r.peak_mem_gib is None else round(r.peak_mem_gib, 3)}


def command_line() -> str:
    """The command that ran, as the torchrun call of benchmarks/gpu_smoke.sh (relative paths only)."""
    script = Path(sys.argv[0]).resolve()
    shown = script.relative_to(ROOT) if script.is_relative_to(ROOT) else Path(script.name)
    nproc = os.environ.get("LOCAL_WORLD_SIZE", "1")
    return shlex.join(["torchrun", "--standalone", "--nproc-per-node", nproc, str(shown), *sys.argv[1:]])


def environment(device: torch.device) -> dict[str, str | None]:
    def git(*cmd: str) -> str | None:
        try:
            return subprocess.run(["git", *cmd], cwd=ROOT, capture_output=True, text=True, timeout=10,
                                  check=True).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None

    status = git("status", "--porcelain")
    return {
        "torch": torch.__version__, "hsdp": hsdp.__version__, "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "world_size": str(dist.get_world_size()), "git_commit": git("rev-parse", "--short", "HEAD"),
        "git_dirty": None if status is None else str(bool(status)),
    }


def side_by_side(h: RunResult, f: RunResult) -> list[str]:
    rows = ["| step | hsdp loss | FSDP2 loss | hsdp ms | FSDP2 ms |", "|---:|---:|---:|---:|---:|"]
    for i, (lh, lf, th, tf) in enumerate(zip(h.losses, f.losses, h.step_ms, f.step_ms)):
        rows.append(f"| {i} | {lh:.5f} | {lf:.5f} | {th:.1f} | {tf:.1f} |")
    return rows


def markdown(payload: dict) -> str:
    t, cfg = payload["timing"], payload["config"]
    verdict = "PASS" if payload["passed"] else "FAIL"
    lines = [
        f"# hsdp vs FSDP2 smoke test, {payload['date']}",
        "",
        f"Command: `{payload['command']}`",
        "",
        "Environment: " + ", ".join(f"{k} {v}" for k, v in payload["environment"].items()),
        "",
        "Config: " + ", ".join(f"{k}={v}" for k, v in cfg.items()),
        "",
        f"**{verdict}**: largest relative loss difference {payload['max_rel_loss_diff']:.2e} "
        f"(tolerance {payload['rtol']:.0e}).",
        "",
        "| | hsdp | FSDP2 |",
        "|---|---:|---:|",
    ]
    for key in ("median_step_ms", "mean_step_ms", "tokens_per_s", "peak_mem_gib"):
        lines.append(f"| {key} | {t['hsdp'][key]} | {t['fsdp2'][key]} |")
    timed = t["hsdp"]["timed_steps"]
    lines += ["", f"Timings over the last {timed} of {cfg['steps']} steps (the rest are warm-up).", "",
              *payload["table"], ""]
    lines += ["Method: " + payload["method"], ""]
    return "\n".join(lines)


def write_results(out: Path, payload: dict) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    # CPU checks get their own name so they never overwrite a GPU result of the same day.
    stem = f"gpu_smoke_{payload['date']}" if payload["config"]["device"] == "cuda" else \
        f"gpu_smoke_cpu_{payload['date']}"
    paths = [out / f"{stem}.json", out / f"{stem}.md"]
    data = {k: v for k, v in payload.items() if k != "table"}
    paths[0].write_text(json.dumps(data, indent=2) + "\n")
    paths[1].write_text(markdown(payload))
    return paths


# ---------------------------------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> bool:
    device = setup(args.device)
    dm = build_mesh(args.device, args.sharding_degree)
    cfg = preset(args.preset)
    seq = args.seq_len or cfg.block_size
    torch.manual_seed(args.seed)
    ref = GPT(cfg)  # on the CPU in fp32: one initialisation, copied into each framework
    batches = make_batches(cfg.vocab_size, args.batch_size, seq, args.steps, args.seed, device)
    results = {name: train(name, ref, dm, batches, args, device) for name in WRAPPERS}
    h, f = results["hsdp"], results["fsdp2"]
    deviation = loss_deviation(h, f)
    passed = deviation <= args.rtol
    if dist.get_rank() == 0:
        report(args, ref, seq, device, dm, h, f, deviation, passed)
    return passed


def report(args: argparse.Namespace, ref: GPT, seq: int, device: torch.device, dm: DeviceMesh,
           h: RunResult, f: RunResult, deviation: float, passed: bool) -> None:
    tokens = dist.get_world_size() * args.batch_size * seq
    config = {"device": args.device, "preset": args.preset, "params": ref.num_params(),
              "precision": args.precision, "mesh": "x".join(map(str, dm.shape)), "batch_per_rank": args.batch_size,
              "seq_len": seq, "steps": args.steps, "warmup": args.warmup, "lr": args.lr, "seed": args.seed}
    payload = {
        "date": datetime.datetime.now(datetime.timezone.utc).date().isoformat(),
        "command": command_line(), "environment": environment(device), "config": config,
        "passed": passed, "max_rel_loss_diff": deviation, "rtol": args.rtol,
        "timing": {r.name: timing(r, args.warmup, tokens) for r in (h, f)},
        "runs": {r.name: asdict(r) for r in (h, f)},
        "method": f"{METHOD} Precision {args.precision}: {PRECISION_NOTES[args.precision]}.",
        "table": side_by_side(h, f),
    }
    print("\n".join(payload["table"]))
    print(f"{'':>16} {'hsdp':>12} {'FSDP2':>12}")
    for key in ("median_step_ms", "tokens_per_s", "peak_mem_gib"):
        print(f"{key:>16} {payload['timing']['hsdp'][key]!s:>12} {payload['timing']['fsdp2'][key]!s:>12}")
    print(f"{'PASS' if passed else 'FAIL'}: max relative loss difference {deviation:.2e} (rtol {args.rtol:.0e})")
    for path in write_results(args.out, payload):
        print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        passed = run(args)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
