"""DiLoCo against plain HSDP on slow and fast emulated links: tokens/s, inter-node bytes, held-out loss.

Two emulated nodes of 2 ranks (``hsdp launch --nodes 2 --nproc-per-node 2``), ``hsdp.init_mesh(2)`` (one
replica per node, each sharded over its 2 ranks), a byte-level GPT (``hsdp.models.gpt``, preset ``small``) on
the Python standard library's sources (``hsdp.data.text``; the last 5 % of the tokens held out). Two modes,
the same seed, batches and token budget:

- ``plain``: HSDP, the gradient all-reduced across nodes every step, AdamW;
- ``diloco``: ``replica_sync=hsdp.DiLoCo(every=H, outer_lr=0.7, outer_momentum=0.9)``: inner AdamW, nothing
  crosses nodes for H - 1 steps, then one all-reduce of the pseudo-gradient and an outer Nesterov SGD step.

Each at two link rates (100 Mbit/s, 10 Gbit/s). Tokens/s = the global tokens of the measured steps (after
``--warmup``) / their wall time (the slowest rank's sum of step times; DiLoCo's syncs included, evaluations
excluded). The held-out loss (a fixed set of windows, every rank a quarter) is evaluated before training and
every H steps, where DiLoCo's replicas agree (right after a sync), so both modes are compared at equal tokens.
Inter-node bytes per step: hsdp's count (``model.comm_stats()["replicate"]``, summed over a node's ranks) and
the node's link counters (frames, TCP/IP headers included), as (bytes of the long run - bytes of an H-step run
at 10 Gbit/s) / (steps - H), so the rendezvous, the wrap-time broadcasts and the final gather cancel out.

Why so few tokens per step (1 x 128 per rank by default): the per-step all-reduce's time does not depend on
the model size relative to its compute (both scale with the parameter count), only on the tokens per step; two
shared CPU cores compute ~100x slower than a GPU, so a small per-step batch puts this machine where a GPU
cluster on a 100 Mbit/s link is: the link dominates plain HSDP's step.

Writes ``benchmarks/results/diloco_slow_links_<date>.{json,md,png}`` (``--tag`` adds a suffix) with the commands.

    sudo python benchmarks/diloco_slow_links.py            # the driver: six launches, the table, the plot
    sudo python benchmarks/diloco_slow_links.py --quick    # a 1-2 minute smoke run (preset tiny, few steps)
    python benchmarks/diloco_slow_links.py --job --mode diloco --steps 40  # one rank's job (under torchrun)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
RATES = ("100mbit", "10gbit")
MODES = ("plain", "diloco")
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9  # the paper's outer Nesterov SGD


# ---------------------------------------------------------------------------------------------------------
# One rank's job.
# ---------------------------------------------------------------------------------------------------------
def _held_out(tokens: object, block: int, windows: int, rank: int, world: int) -> object:
    """This rank's share of the fixed held-out windows (evenly spaced over the held-out tokens)."""
    import torch

    starts = torch.linspace(0, len(tokens) - block - 1, windows).long()  # type: ignore[arg-type]
    mine = starts[rank::world]
    return torch.stack([tokens[s:s + block + 1] for s in mine.tolist()]).long()  # type: ignore[index]


def _evaluate(model: object, windows: object) -> float:
    """Mean held-out loss over every rank's windows (one tiny all-reduce across the world)."""
    import torch
    import torch.distributed as dist

    model.eval()  # type: ignore[attr-defined]
    with torch.no_grad():
        _, loss = model(windows[:, :-1], windows[:, 1:])  # type: ignore[operator,index]
    model.train()  # type: ignore[attr-defined]
    total = torch.tensor([loss.item() * len(windows), float(len(windows))], dtype=torch.float64)  # type: ignore
    dist.all_reduce(total)
    return (total[0] / total[1]).item()


def job(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import hsdp
    from hsdp.data.text import TokenStream, as_tokens, default_corpus_bytes, split_tokens
    from hsdp.models.gpt import GPT, preset

    mesh = hsdp.init_mesh(2)
    cfg = preset(args.preset)
    train, held = split_tokens(as_tokens(default_corpus_bytes(args.corpus_bytes)), 0.05)
    stream = TokenStream(train, args.block, args.batch, seed=args.seed, mesh=mesh)
    windows = _held_out(held, args.block, args.eval_windows, mesh.rank, mesh.world_size)
    sync = hsdp.DiLoCo(every=args.every, outer_lr=OUTER_LR, outer_momentum=OUTER_MOMENTUM) \
        if args.mode == "diloco" else None
    torch.manual_seed(args.seed)
    model = hsdp.ShardedModel(GPT(cfg), mesh=mesh, replica_sync=sync)
    opt = hsdp.ShardedOptimizer(model, torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95),
                                                         weight_decay=0.1))
    evals = [(0, _evaluate(model, windows))]
    step_s, losses, sent = [], [], []
    for step in range(args.steps):
        x, y = stream.batch(step)
        model.reset_comm_stats()
        start = time.perf_counter()
        _, loss = model(x, y)
        loss.backward()
        hsdp.clip_grad_norm_(model, 1.0)
        opt.step()
        opt.zero_grad()
        step_s.append(time.perf_counter() - start)
        losses.append(loss.item())
        sent.append(sum(op["wire_bytes"] for op in model.comm_stats().get("replicate", {}).values()))
        if (step + 1) % args.every == 0 or step + 1 == args.steps:  # DiLoCo's replicas agree here
            evals.append((step + 1, _evaluate(model, windows)))
    mine = {"step_s": step_s, "loss": losses, "sent": sent}
    everyone = [None] * mesh.world_size
    dist.all_gather_object(everyone, mine)
    if mesh.rank == 0:
        params = sum(p.numel() for p in model.parameters() if p.requires_grad)
        Path(args.out).write_text(json.dumps({"mesh": repr(mesh), "params": params, "evals": evals,
                                              "ranks": everyone}))


# ---------------------------------------------------------------------------------------------------------
# The driver.
# ---------------------------------------------------------------------------------------------------------
def _job_args(args: argparse.Namespace, mode: str, steps: int) -> list[str]:
    return ["--job", "--mode", mode, "--steps", str(steps), "--every", str(args.every), "--preset", args.preset,
            "--batch", str(args.batch), "--block", str(args.block), "--lr", str(args.lr), "--seed", str(args.seed),
            "--eval-windows", str(args.eval_windows), "--corpus-bytes", str(args.corpus_bytes)]


def _launch(args: argparse.Namespace, mode: str, rate: str, steps: int, tmp: Path) -> dict:
    name = f"{mode}_{rate}_{steps}"
    stats, out = tmp / f"links_{name}.json", tmp / f"job_{name}.json"
    command = [str(Path(sys.executable).parent / "hsdp"), "launch", "--nodes", "2", "--nproc-per-node", "2",
               "--inter-node-bandwidth", rate, "--require-emulation", "--stats-json", str(stats), "--",
               __file__, *_job_args(args, mode, steps), "--out", str(out)]
    began = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    # As a person would type it: no interpreter or temporary paths.
    shown = ["hsdp", *command[1:command.index("--stats-json") + 1], f"links_{name}.json", "--",
             "benchmarks/diloco_slow_links.py", *_job_args(args, mode, steps), "--out", f"job_{name}.json"]
    return {"command": shlex.join(shown), "links": json.loads(stats.read_text()),
            "job": json.loads(out.read_text()), "launch_s": time.perf_counter() - began}


def _summarise(run: dict, short: dict, args: argparse.Namespace) -> dict:
    ranks, steps = run["job"]["ranks"], args.steps
    measured = range(args.warmup, steps)
    wall = max(sum(r["step_s"][s] for s in measured) for r in ranks)
    global_tokens = len(ranks) * args.batch * args.block
    # The global train loss per step: the mean of the ranks' (under DiLoCo, of the replicas' own) losses.
    loss = [statistics.fmean(r["loss"][s] for r in ranks) for s in range(steps)]
    # Over the steps the link counters' difference covers (whole sync periods).
    counted = range(args.every, steps)
    hsdp_node = [sum(r["sent"][s] for r in ranks[2 * n:2 * n + 2] for s in counted) / len(counted) for n in range(2)]
    link = [(a["sent_bytes"] - b["sent_bytes"]) / (steps - args.every)
            for a, b in zip(run["links"]["nodes"], short["links"]["nodes"], strict=True)]
    return {"tokens_per_s": len(measured) * global_tokens / wall, "measured_steps": len(measured),
            "measured_wall_s": wall, "median_step_s": statistics.median(ranks[0]["step_s"][s] for s in measured),
            "syncs_measured": sum(1 for s in measured if (s + 1) % args.every == 0) if run["mode"] == "diloco"
            else len(measured),
            "hsdp_bytes_per_step_per_node": hsdp_node, "link_bytes_per_step_per_node": link,
            "link_sent_total_per_node": [n["sent_bytes"] for n in run["links"]["nodes"]],
            "held_out": run["job"]["evals"], "train_loss": loss, "launch_s": run["launch_s"],
            "command": run["command"]}


def drive(args: argparse.Namespace) -> None:
    if args.steps % args.every or args.steps < 2 * args.every:
        raise ValueError(f"--steps {args.steps} must be a multiple of --every {args.every}, at least twice it "
                         f"(the link counters are differenced against an --every-step run)")
    runs: dict[str, dict[str, dict]] = {rate: {} for rate in RATES}
    with tempfile.TemporaryDirectory() as tmp:
        short = {m: _launch(args, m, "10gbit", args.every, Path(tmp)) for m in MODES}
        for rate in RATES:
            for mode in MODES:
                runs[rate][mode] = {**_launch(args, mode, rate, args.steps, Path(tmp)), "mode": mode}
                print(f"{rate} {mode}: {runs[rate][mode]['launch_s']:.0f} s", flush=True)
    first = runs[RATES[0]][MODES[0]]["job"]
    result = {"date": datetime.date.today().isoformat(), "mesh": first["mesh"], "params": first["params"],
              "settings": {k: v for k, v in vars(args).items() if k not in ("job", "out", "mode")},
              "global_tokens_per_step": 4 * args.batch * args.block, "rates": {}}
    for rate in RATES:
        s = {m: _summarise(runs[rate][m], short[m], args) for m in MODES}
        final = {m: s[m]["held_out"][-1][1] for m in MODES}
        s["tokens_per_s_ratio"] = s["diloco"]["tokens_per_s"] / s["plain"]["tokens_per_s"]
        s["held_out_relative_gap"] = (final["diloco"] - final["plain"]) / final["plain"]
        result["rates"][rate] = s
    result["short_commands"] = [short[m]["command"] for m in MODES]
    _write(result, args)


# ---------------------------------------------------------------------------------------------------------
# Results.
# ---------------------------------------------------------------------------------------------------------
def _plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    per_step = result["global_tokens_per_step"]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    rate = RATES[0]
    for mode, colour in zip(MODES, ("tab:blue", "tab:orange"), strict=True):
        s = result["rates"][rate][mode]
        tokens = [(i + 1) * per_step for i in range(len(s["train_loss"]))]
        ax.plot(tokens, s["train_loss"], color=colour, alpha=0.35, lw=0.8, label=f"{mode}: train (per step)")
        ax.plot([t * per_step for t, _ in s["held_out"]], [v for _, v in s["held_out"]], "o-", color=colour,
                label=f"{mode}: held-out")
    every = result["settings"]["every"]
    ax.set(xlabel="tokens (global)", ylabel="loss (nats/byte)",
           title=f"GPT {result['settings']['preset']}, 2 x 2 ranks, {rate} links: plain HSDP vs DiLoCo (H={every})")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _rows(result: dict) -> list[str]:
    rows = ["| link | mode | tokens/s | ratio | median step s | inter-node B/step, nodes 0, 1 (hsdp) | "
            "(link counters) | held-out loss at end | gap |", "|---|---|---|---|---|---|---|---|---|"]
    for rate, s in result["rates"].items():
        for m in MODES:
            r = s[m]
            ratio = f"{s['tokens_per_s_ratio']:.2f}x" if m == "diloco" else "1"
            gap = f"{100 * s['held_out_relative_gap']:+.2f} %" if m == "diloco" else ""
            link = ", ".join(f"{b:.0f}" for b in r["link_bytes_per_step_per_node"])
            counted = ", ".join(f"{b:.0f}" for b in r["hsdp_bytes_per_step_per_node"])
            rows.append(f"| {rate} | {m} | {r['tokens_per_s']:.0f} | {ratio} | {r['median_step_s']:.3f} | "
                        f"{counted} | {link} | {r['held_out'][-1][1]:.4f} | {gap} |")
    return rows


def _curve_rows(result: dict) -> list[str]:
    per_step = result["global_tokens_per_step"]
    header = "| tokens | " + " | ".join(f"{m} {rate}" for rate in RATES for m in MODES) + " |"
    rows = [header, "|---" * (1 + 2 * len(RATES)) + "|"]
    evals = result["rates"][RATES[0]]["plain"]["held_out"]
    for i, (step, _) in enumerate(evals):
        cells = [f"{result['rates'][rate][m]['held_out'][i][1]:.4f}" for rate in RATES for m in MODES]
        rows.append(f"| {step * per_step} | " + " | ".join(cells) + " |")
    return rows


def _write(result: dict, args: argparse.Namespace) -> None:
    RESULTS.mkdir(exist_ok=True)
    stem = RESULTS / (f"diloco_slow_links_{result['date']}" + (f"_{args.tag}" if args.tag else ""))
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    _plot(result, stem.with_suffix(".png"))
    st = result["settings"]
    driver = "sudo python benchmarks/diloco_slow_links.py" + (" --quick" if args.quick else "") + \
        "".join(f" --{k} {st[k]}" for k in ("steps", "every", "preset", "batch", "block", "warmup"))
    lines = [f"# DiLoCo vs plain HSDP on slow and fast emulated links ({result['date']})", "",
             f"{result['mesh']} on `hsdp launch --nodes 2 --nproc-per-node 2` (network namespaces, shaped links). "
             f"GPT `{st['preset']}` ({result['params'] / 1e6:.2f}M parameters, fp32), byte-level, stdlib sources "
             f"(first {st['corpus_bytes']:,} bytes, last 5 % held out); {st['batch']} x {st['block']} tokens per "
             f"rank per step ({result['global_tokens_per_step']} global), {st['steps']} steps, the same seed and "
             f"batches in both modes; AdamW lr {st['lr']}, betas (0.9, 0.95), weight decay 0.1, "
             f"`hsdp.clip_grad_norm_(model, 1.0)`. DiLoCo: H = {st['every']}, outer Nesterov SGD lr {OUTER_LR}, "
             f"momentum {OUTER_MOMENTUM}, fp32 pseudo-gradient.", "",
             f"Tokens/s = global tokens of steps {st['warmup']}..{st['steps'] - 1} / their wall time (the slowest "
             f"rank's sum of step times, DiLoCo's syncs inside, evaluations outside). Held-out loss: "
             f"{st['eval_windows']} fixed windows, before training and every {st['every']} steps (DiLoCo right "
             f"after a sync). Inter-node bytes per step over steps {st['every']}..{st['steps'] - 1} (whole sync "
             f"periods): hsdp's count (the node's ranks summed) and the link counters, (long run - "
             f"{st['every']}-step run at 10gbit) / {st['steps'] - st['every']}. The machine (2 CPU cores) was shared "
             f"with other jobs: timings are noisy.", "", "```", driver,
             *[result["rates"][r][m]["command"] for r in RATES for m in MODES],
             *result["short_commands"], "```", "", *_rows(result), "",
             "Held-out loss at equal tokens:", "", *_curve_rows(result), "",
             f"Plot: `{stem.with_suffix('.png').name}` (train loss per step and held-out loss vs tokens, "
             f"{RATES[0]})."]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", action="store_true", help="run one rank's training job (under torchrun)")
    parser.add_argument("--mode", choices=MODES, default="plain", help="--job: plain HSDP or DiLoCo")
    parser.add_argument("--quick", action="store_true", help="a 1-2 minute smoke run: preset tiny, 40 steps, H 10")
    parser.add_argument("--steps", type=int, default=160, help="training steps per run (a multiple of --every)")
    parser.add_argument("--every", type=int, default=40, help="DiLoCo's H: inner steps between syncs")
    parser.add_argument("--preset", default="small", help="a GPT preset of hsdp.models.gpt (default: small)")
    parser.add_argument("--batch", type=int, default=1, help="sequences per rank per step")
    parser.add_argument("--block", type=int, default=128, help="tokens per sequence (<= the preset's block)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of tokens/s")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-windows", type=int, default=64, help="held-out windows (split over the ranks)")
    parser.add_argument("--corpus-bytes", type=int, default=2_000_000)
    parser.add_argument("--tag", default="", help="a suffix for the result files")
    parser.add_argument("--out", default=os.devnull, help="--job: where rank 0 writes its record")
    args = parser.parse_args()
    if args.quick:
        args.preset, args.steps, args.every, args.eval_windows = "tiny", 40, 10, 16
        args.block = min(args.block, 64)
        args.tag = args.tag or "quick"
    if args.job:
        job(args)
    else:
        drive(args)


if __name__ == "__main__":
    main()
