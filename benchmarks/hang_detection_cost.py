"""Cost of hang detection: training steps with the collective ledger on and off, interleaved.

Every collective hsdp issues is entered in the watchdog's ledger (a counter, a small record, two dict
operations) and the watchdog thread publishes a snapshot once per beat. This runs full training steps
(forward, backward, AdamW) of one wrapped GPT in the same processes, alternating steps with the ledger
attached to the model's ``Comm`` and detached, so drift and noise hit both alike. Reports each rank's
median step time per mode and the slowest rank's ratio, as JSON and a dated Markdown table. On a busy
machine that ratio is mostly noise, so it also reports a bound that noise cannot move: the ledger's own
cost per collective (timed over many entries) times the collectives of one step, over the step time.

    torchrun --nproc-per-node 4 benchmarks/hang_detection_cost.py --preset bench --steps 30
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


def measure(preset_name: str, steps: int, batch: int) -> dict[str, float]:
    torch.manual_seed(0)
    mesh = hsdp.init_mesh()
    model = hsdp.ShardedModel(GPT(preset(preset_name)), mesh=mesh)
    opt = hsdp.ShardedOptimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    cfg = model.cfg
    x = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size))
    ledger = model.comm._ledger
    assert ledger is not None, "the watchdog must be on (init_mesh's default fault policy)"
    times: dict[str, list[float]] = {"on": [], "off": []}
    for i in range(2 * steps + 4):  # four warm-up steps
        mode = "on" if i % 2 == 0 else "off"
        model.comm._ledger = ledger if mode == "on" else None
        dist.barrier()
        t0 = time.perf_counter()
        _, loss = model(x, x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        elapsed = time.perf_counter() - t0
        if i >= 4:
            times[mode].append(elapsed)
    model.comm._ledger = ledger
    model.reset_comm_stats()
    _, loss = model(x, x)
    loss.backward()
    calls = sum(s["calls"] for ops in model.comm_stats().values() for s in ops.values())
    opt.zero_grad()
    out = {mode: statistics.median(v) for mode, v in times.items()}
    out["collectives_per_step"] = calls
    out["ledger_us_per_collective"] = ledger_cost_us()
    out["bound"] = calls * out["ledger_us_per_collective"] * 1e-6 / out["off"]
    return out


def ledger_cost_us(n: int = 200_000) -> float:
    """Microseconds one collective spends in the ledger: enter, then done (on a scratch ledger)."""
    from hsdp.engine.faults.ledger import CollectiveLedger

    scratch = CollectiveLedger()
    t0 = time.perf_counter()
    for _ in range(n):
        scratch.done(scratch.enter("hsdp::all_gather[shard] blocks.0", None))
    return (time.perf_counter() - t0) / n * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="bench")
    p.add_argument("--steps", type=int, default=30, help="measured steps per mode")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = p.parse_args()
    torch.set_num_threads(1)
    result = measure(args.preset, args.steps, args.batch)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, result)
    if dist.get_rank() == 0:
        write(args, everyone)
    dist.destroy_process_group()


def write(args: argparse.Namespace, per_rank: list[dict[str, float]]) -> None:
    slowest = {mode: max(r[mode] for r in per_rank) for mode in ("on", "off")}
    ratio = slowest["on"] / slowest["off"]
    bound = max(r["bound"] for r in per_rank)
    day = datetime.date.today().isoformat()
    command = "torchrun --nproc-per-node " + str(len(per_rank)) + " " + " ".join(sys.argv)
    report = {"date": day, "command": command, "preset": args.preset, "steps_per_mode": args.steps,
              "batch": args.batch, "per_rank_median_s": per_rank, "slowest_rank_median_s": slowest,
              "on_over_off": ratio, "ledger_bound": bound}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"hang_detection_cost_{day}.json").write_text(json.dumps(report, indent=1))
    rows = "\n".join(f"| {r} | {v['on']:.4f} | {v['off']:.4f} | {v['on'] / v['off']:.3f} |"
                     for r, v in enumerate(per_rank))
    (out / f"hang_detection_cost_{day}.md").write_text(
        f"# Hang detection cost {day}\n\nCommand: `{command}`\n\n"
        f"GPT preset `{args.preset}`, batch {args.batch}, {args.steps} steps per mode, interleaved; gloo on CPU. "
        f"Median step time (forward, backward, AdamW) with the collective ledger on and off.\n\n"
        f"| rank | ledger on (s) | ledger off (s) | on / off |\n|---|---|---|---|\n{rows}\n\n"
        f"Slowest rank: on {slowest['on']:.4f} s, off {slowest['off']:.4f} s, **{ratio:.3f}x**.\n\n"
        f"Ledger cost, noise-free bound: {per_rank[0]['ledger_us_per_collective']:.2f} us per collective x "
        f"{per_rank[0]['collectives_per_step']} collectives per step = **{bound:.2e}** of a step "
        f"(load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores during the run).\n")
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
