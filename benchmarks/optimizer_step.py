"""Cost of the optimizer step on DTensor parameters versus plain local shards (hsdp before DTensors).

Three AdamW (foreach) optimizers step shards of the same wrapped model in the same processes, interleaved
step by step: over plain copies of the local chunks (what hsdp's parameters were before DTensors), through
``hsdp.ShardedOptimizer`` (its local step on the DTensor parameters), and plain torch AdamW over
``model.parameters()`` (every foreach op through DTensor dispatch). Gradients are
fixed random DTensors; only ``optimizer.step()`` is timed. Reports the median per rank and the slowest
rank's median, as JSON and a dated Markdown table under ``benchmarks/results/``.

    torchrun --nproc-per-node 4 benchmarks/optimizer_step.py --preset bench --steps 30
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import hsdp
from hsdp.models.gpt import GPT, preset


def _timed(step: object) -> float:
    t0 = time.perf_counter()
    step()  # type: ignore[operator]
    return time.perf_counter() - t0


def measure(preset_name: str, steps: int, sharding_degree: int) -> dict[str, float]:
    torch.manual_seed(0)
    model = hsdp.ShardedModel(GPT(preset(preset_name)), mesh=hsdp.init_mesh(sharding_degree))
    sharded = model.sharded_params()
    for p in sharded:
        p.accumulate_grad(torch.randn(p.layout.local_shape) * 1e-3)
    plain = [torch.nn.Parameter(p.sharded_local.detach().clone()) for p in sharded]
    for q, p in zip(plain, sharded, strict=True):
        q.grad = p.grad_local.clone()
    # The same model's DTensor parameters under two optimizers: their updates land in the same shards,
    # which changes nothing about the cost of a step.
    optimizers = {
        "plain": torch.optim.AdamW(plain, lr=1e-4, foreach=True),
        "hsdp": hsdp.ShardedOptimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)),
        "dtensor": torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True),
    }
    times: dict[str, list[float]] = {name: [] for name in optimizers}
    for i in range(steps + 2):  # two warm-up steps allocate the state and fill DTensor's dispatch cache
        names = list(optimizers)[i % 3:] + list(optimizers)[: i % 3]  # rotate the order: no position bias
        for name in names:
            dist.barrier()
            elapsed = _timed(optimizers[name].step)
            if i >= 2:
                times[name].append(elapsed)
    mine = torch.tensor([statistics.median(times[name]) for name in optimizers])
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)  # the slowest rank's median bounds the step
    seconds = dict(zip(optimizers, mine.tolist(), strict=True))
    n_params = sum(p.numel() for p in model.parameters())
    return {**{f"{k}_s": v for k, v in seconds.items()}, "hsdp_ratio": seconds["hsdp"] / seconds["plain"],
            "dtensor_ratio": seconds["dtensor"] / seconds["plain"], "params": n_params, "tensors": len(sharded)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="bench")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--sharding-degree", type=int, default=2)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    result = measure(args.preset, args.steps, args.sharding_degree)
    if dist.get_rank() == 0:
        _write(result, args, " ".join(["torchrun", f"--nproc-per-node {dist.get_world_size()}", *sys.argv]))
    dist.destroy_process_group()
    return 0


def _write(result: dict[str, float], args: argparse.Namespace, command: str) -> None:
    day = datetime.date.today().isoformat()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = {"date": day, "command": command, "preset": args.preset, "steps": args.steps, **result}
    (out / f"optimizer_step_{day}.json").write_text(json.dumps(record, indent=2) + "\n")
    table = (f"# Optimizer step on DTensor parameters vs plain shards ({day})\n\n`{command}`\n\n"
             f"GPT preset `{args.preset}` ({result['params'] / 1e6:.1f}M parameters, {result['tensors']} tensors), "
             f"AdamW foreach, sharding degree {args.sharding_degree}, median of {args.steps} interleaved steps, "
             f"slowest rank.\n\n| parameters | step s | ratio |\n|---|---|---|\n"
             f"| AdamW on plain local shards (hsdp before DTensors) | {result['plain_s']:.4f} | 1.00 |\n"
             f"| hsdp.ShardedOptimizer(AdamW) on DTensor parameters (local step) | {result['hsdp_s']:.4f} | "
             f"{result['hsdp_ratio']:.3f} |\n"
             f"| AdamW on DTensor parameters through DTensor dispatch | {result['dtensor_s']:.4f} | "
             f"{result['dtensor_ratio']:.3f} |\n")
    (out / f"optimizer_step_{day}.md").write_text(table)
    print(table)


if __name__ == "__main__":
    sys.exit(main())
