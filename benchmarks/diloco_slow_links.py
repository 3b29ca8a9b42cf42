"""DiLoCo and Streaming DiLoCo against plain HSDP on slow and fast emulated links: tokens/s, bytes, held-out loss.

Two emulated nodes of 2 ranks (``hsdp launch --nodes 2 --nproc-per-node 2``), ``hsdp.init_mesh(2)`` (one
replica per node, each sharded over its 2 ranks), a byte-level GPT (``hsdp.models.gpt``, preset ``small``: 7
units with parameters, 6 blocks and the root) on the Python standard library's sources (``hsdp.data.text``; the
last 5 % of the tokens held out). Three modes, the same seed, batches and token budget:

- ``plain``: HSDP, the gradient all-reduced across nodes every step, AdamW;
- ``diloco``: ``replica_sync=hsdp.DiLoCo(every=H, outer_lr, outer_momentum, wire_dtype)``: inner AdamW, nothing
  crosses nodes for H - 1 steps, then one all-reduce of the pseudo-gradient and an outer Nesterov SGD step;
- ``streaming``: the same with ``fragments=F, delay=tau``: a fragment (1/F of the model) syncs every H / F
  steps, its all-reduce overlapping the next tau steps' compute.

With ``--systems hsdp,torchft`` (the default), torchft 0.2.0's DiLoCo and Streaming DiLoCo
(``torchft.local_sgd.DiLoCo``, ``pip install -e .[peers]``) run too, as modes ``torchft-diloco`` and
``torchft-streaming``: the same launch, model, batches, inner optimizer, H, outer optimizer, F, tau and alpha,
FSDP2 inside each node (``diloco_slow_links_torchft.py`` says what differs: fp32 pseudo-gradients only).

Each at two link rates (100 Mbit/s, 10 Gbit/s). Tokens/s = the global tokens of the measured steps (after
``--warmup``) / their wall time (the slowest rank's sum of step times; syncs included, evaluations excluded).
The held-out loss (fixed windows, each replica all of them, the replicas' mean) is evaluated before training and
every H steps (DiLoCo's replicas agree there), so the modes are compared at equal tokens. Inter-node bytes per
step: hsdp's count (``model.comm_stats()["replicate"]``, summed over a node's ranks) and the node's link
counters (frames, headers included), as (bytes of the long run - bytes of an H-step run at 10 Gbit/s) /
(steps - H), so the rendezvous, the wrap-time broadcasts and the final gather cancel out. ``--sweep`` runs
configurations loss-only on loopback (the loss does not depend on the link) and keeps every one tried.

Why so few tokens per step (1 x 128 per rank by default): the per-step all-reduce's time does not depend on
the model size relative to its compute (both scale with the parameter count), only on the tokens per step; two
shared CPU cores compute ~100x slower than a GPU, so a small per-step batch puts this machine where a GPU
cluster on a 100 Mbit/s link is: the link dominates plain HSDP's step.

Writes ``benchmarks/results/diloco_slow_links_<date>.{json,md,png}`` (``--tag`` adds a suffix) with the commands.

    sudo python benchmarks/diloco_slow_links.py --every 10 --outer-lr 1.0 --outer-momentum 0.0 --wire bf16
        # the driver (results 2026-12-03_h10): 9 launches, the table, the plot
    sudo python benchmarks/diloco_slow_links.py --quick       # a smoke run (preset tiny, few steps)
    python benchmarks/diloco_slow_links.py --sweep 20:0.7:0.9:bf16 20:1.0:0.0:fp32:4:2  # loss only, loopback
    python benchmarks/diloco_slow_links.py --steps 160 --sweep 10:1.0:0.0:fp32 10:1.0:0.0:int8  # int8's loss next
        # to fp32's (DiLoCo(wire_dtype=torch.int8), error feedback); the driver takes --wire int8 too
    python benchmarks/diloco_slow_links.py --job --mode diloco --steps 40  # one rank's job (under torchrun)
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import diloco_slow_links_torchft as torchft_side
from diloco_slow_links_report import RATES, stem_of, sweep_rows, write

MODES = ("plain", "diloco", "streaming")
SYSTEMS = ("hsdp", "torchft")
# --wire: the pseudo-gradients' torch dtype (int8: quantised with error feedback, about a quarter of fp32's bytes).
WIRES = {"fp32": None, "bf16": "bfloat16", "int8": "int8"}


# One rank's job.
def _held_out(tokens: object, block: int, windows: int, rank: int, world: int) -> object:
    """This rank's share of the fixed held-out windows (evenly spaced over the held-out tokens): ``rank`` of
    ``world`` is the rank's place in its replica, so every replica evaluates all of them."""
    import torch

    starts = torch.linspace(0, len(tokens) - block - 1, windows).long()  # type: ignore[arg-type]
    mine = starts[rank::world]
    return torch.stack([tokens[s:s + block + 1] for s in mine.tolist()]).long()  # type: ignore[index]


def _evaluate(model: object, windows: object) -> float:
    """Mean held-out loss over the windows, averaged over the replicas (one tiny all-reduce across the world):
    under Streaming DiLoCo the replicas never agree on every fragment at once, so each is evaluated."""
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
    windows = _held_out(held, args.block, args.eval_windows, mesh.shard_rank, mesh.sharding_degree)
    streaming = {"fragments": args.fragments, "delay": args.delay, "mix": args.mix} if args.mode == "streaming" \
        else {}
    sync = None if args.mode == "plain" else hsdp.DiLoCo(
        every=args.every, outer_lr=args.outer_lr, outer_momentum=args.outer_momentum,
        wire_dtype=None if WIRES[args.wire] is None else getattr(torch, WIRES[args.wire]), **streaming)
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
        if (step + 1) % args.every == 0 or step + 1 == args.steps:  # DiLoCo's replicas agree here (not streaming)
            evals.append((step + 1, _evaluate(model, windows)))
    mine = {"step_s": step_s, "loss": losses, "sent": sent}
    everyone = [None] * mesh.world_size
    dist.all_gather_object(everyone, mine)
    if mesh.rank == 0:
        params = sum(p.numel() for p in model.parameters() if p.requires_grad)
        Path(args.out).write_text(json.dumps({"mesh": repr(mesh), "params": params, "evals": evals,
                                              "ranks": everyone}))


# The driver.
def _job_args(args: argparse.Namespace, mode: str, steps: int) -> list[str]:
    outer = [] if mode == "plain" else ["--outer-lr", str(args.outer_lr), "--outer-momentum",
                                        str(args.outer_momentum), "--wire", args.wire]
    stream = ["--fragments", str(args.fragments), "--delay", str(args.delay), "--mix", str(args.mix)] \
        if mode.endswith("streaming") else []
    return ["--job", "--mode", mode, "--steps", str(steps), "--every", str(args.every), "--preset", args.preset,
            "--batch", str(args.batch), "--block", str(args.block), "--lr", str(args.lr), "--seed", str(args.seed),
            "--eval-windows", str(args.eval_windows), "--corpus-bytes", str(args.corpus_bytes), *outer, *stream]


def _launch(args: argparse.Namespace, mode: str, rate: str | None, steps: int, tmp: Path) -> dict:
    """One launch on 2 x 2 emulated nodes at ``rate`` (``None``: on loopback, the loss only, no counters)."""
    name = f"{mode}_{rate or 'loopback'}_{steps}"
    stats, out = tmp / f"links_{name}.json", tmp / f"job_{name}.json"
    links = ["--no-emulation"] if rate is None else \
        ["--inter-node-bandwidth", rate, "--require-emulation", "--stats-json", str(stats)]
    command = [str(Path(sys.executable).parent / "hsdp"), "launch", "--nodes", "2", "--nproc-per-node", "2",
               *links, "--", __file__, *_job_args(args, mode, steps), "--out", str(out)]
    began = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    # As a person would type it: no interpreter or temporary paths.
    shown = ["hsdp", *command[1:command.index("--")], "--", "benchmarks/diloco_slow_links.py",
             *_job_args(args, mode, steps), "--out", f"job_{name}.json"]
    shown = [f"links_{name}.json" if part == str(stats) else part for part in shown]
    return {"command": shlex.join(shown), "links": json.loads(stats.read_text()) if rate else None,
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
            "steps_sending_measured": sum(1 for s in measured if ranks[0]["sent"][s] > 0),
            "hsdp_bytes_per_step_per_node": hsdp_node, "link_bytes_per_step_per_node": link,
            "link_sent_total_per_node": [n["sent_bytes"] for n in run["links"]["nodes"]],
            "held_out": run["job"]["evals"], "train_loss": loss, "launch_s": run["launch_s"],
            "command": run["command"]}


def torchft_streaming_problem(every: int, fragments: int, delay: int) -> str | None:
    """Why torchft 0.2.0's Streaming DiLoCo refuses these settings (``None``: it runs them): it syncs a
    fragment every H / F steps exactly and must wait for it before the next (hsdp's offsets need neither)."""
    if every % fragments:
        return f"torchft-streaming skipped: torchft needs H ({every}) to be a multiple of F ({fragments})"
    if delay >= every // fragments:
        return f"torchft-streaming skipped: torchft needs tau ({delay}) < H / F ({every // fragments})"
    return None


def _modes(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """hsdp's ``--modes``, then torchft's DiLoCo modes among them when ``--systems`` has torchft; and notes on
    the modes left out."""
    systems = [s for s in args.systems.split(",") if s]
    if not systems or any(s not in SYSTEMS for s in systems) or "hsdp" not in systems:
        raise SystemExit(f"--systems {args.systems}: hsdp (plain HSDP is the reference) and optionally torchft")
    if "torchft" not in systems:
        return list(args.modes), []
    if importlib.util.find_spec("torchft") is None:
        raise SystemExit("torchft is not installed: pip install -e .[peers] (or --systems hsdp)")
    problem = torchft_streaming_problem(args.every, args.fragments, args.delay)
    skipped = {"streaming"} if problem else set()
    extra = [f"torchft-{m}" for m in args.modes if m != "plain" and m not in skipped]
    return [*args.modes, *extra], [problem] if problem and "streaming" in args.modes else []


def drive(args: argparse.Namespace) -> None:
    if args.steps % args.every or args.steps < 2 * args.every:
        raise ValueError(f"--steps {args.steps} must be a multiple of --every {args.every}, at least twice it "
                         f"(the link counters are differenced against an --every-step run)")
    modes, notes = _modes(args)
    for note in notes:
        print(note, file=sys.stderr, flush=True)
    runs: dict[str, dict[str, dict]] = {rate: {} for rate in RATES}
    with tempfile.TemporaryDirectory() as tmp:
        short = {m: _launch(args, m, "10gbit", args.every, Path(tmp)) for m in modes}
        for rate in RATES:
            for mode in modes:
                runs[rate][mode] = {**_launch(args, mode, rate, args.steps, Path(tmp)), "mode": mode}
                print(f"{rate} {mode}: {runs[rate][mode]['launch_s']:.0f} s", flush=True)
    first = runs[RATES[0]][MODES[0]]["job"]
    result = {"date": datetime.date.today().isoformat(), "mesh": first["mesh"], "params": first["params"],
              "settings": {k: v for k, v in vars(args).items() if k not in ("job", "out", "mode")},
              "global_tokens_per_step": 4 * args.batch * args.block, "rates": {}, "notes": notes}
    for rate in RATES:
        s = {m: _summarise(runs[rate][m], short[m], args) for m in modes}
        for m in modes:  # against plain HSDP at the same link rate
            s[m]["tokens_per_s_ratio"] = s[m]["tokens_per_s"] / s["plain"]["tokens_per_s"]
            s[m]["held_out_relative_gap"] = (s[m]["held_out"][-1][1] - s["plain"]["held_out"][-1][1]) \
                / s["plain"]["held_out"][-1][1]
        result["rates"][rate] = s
    result["short_commands"] = [short[m]["command"] for m in modes]
    if args.sweep_json:
        result["sweep"] = json.loads(Path(args.sweep_json).read_text())
    write(result, args)


# The loss-only sweep (loopback: the loss does not depend on the link).
def _parse_spec(spec: str) -> dict:
    """``H:outer_lr:outer_momentum:wire`` (DiLoCo) or ``...:F:tau`` (Streaming DiLoCo), e.g. ``20:0.7:0.9:bf16``."""
    parts = spec.split(":")
    if len(parts) not in (4, 6) or parts[3] not in WIRES:
        raise ValueError(f"--sweep {spec!r}: use H:outer_lr:outer_momentum:wire (wire fp32, bf16 or int8), or "
                         f"H:outer_lr:outer_momentum:wire:fragments:delay for Streaming DiLoCo")
    return {"every": int(parts[0]), "outer_lr": float(parts[1]), "outer_momentum": float(parts[2]),
            "wire": parts[3], **({"fragments": int(parts[4]), "delay": int(parts[5])} if len(parts) == 6 else {})}


def sweep(args: argparse.Namespace) -> None:
    """Each ``--sweep`` spec once on loopback, and plain HSDP once per step count; appended to the sweep file
    (what is already there is kept and not rerun), so every configuration tried stays in the record."""
    path = stem_of(datetime.date.today().isoformat(), args.tag or "sweep").with_suffix(".json")
    done = json.loads(path.read_text()) if path.exists() else {"settings": {}, "runs": []}
    fixed = {k: getattr(args, k) for k in ("preset", "batch", "block", "lr", "seed", "eval_windows", "corpus_bytes")}
    if done["settings"] and done["settings"] != fixed:
        raise ValueError(f"{path.name} holds runs of other settings {done['settings']}: pass another --tag")
    done["settings"] = fixed
    specs = [{"mode": "plain", "every": 10}] + [
        {"mode": "streaming" if "fragments" in c else "diloco", **c} for c in map(_parse_spec, args.sweep)]
    with tempfile.TemporaryDirectory() as tmp:
        for spec in specs:
            key = {**spec, "steps": args.steps}
            if any({k: r.get(k) for k in key} == key for r in done["runs"]):
                continue
            run_args = argparse.Namespace(**{**vars(args), "mix": 0.0, **spec})
            run = _launch(run_args, spec["mode"], None, args.steps, Path(tmp))
            done["runs"].append({**key, "held_out": run["job"]["evals"], "command": run["command"],
                                 "launch_s": run["launch_s"]})
            print(f"{key}: held-out {run['job']['evals'][-1][1]:.4f} ({run['launch_s']:.0f} s)", flush=True)
            path.write_text(json.dumps(done, indent=1) + "\n")
    path.with_suffix(".md").write_text("\n".join(sweep_rows(done)) + "\n")
    print("\n".join(sweep_rows(done)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", action="store_true", help="run one rank's training job (under torchrun)")
    parser.add_argument("--mode", choices=MODES + torchft_side.MODES, default="plain",
                        help="--job: plain HSDP, DiLoCo or streaming (torchft's: torchft-diloco, torchft-streaming)")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="the driver's modes")
    parser.add_argument("--systems", default=",".join(SYSTEMS),
                        help="hsdp, and torchft to run its DiLoCo modes too (default: hsdp,torchft)")
    parser.add_argument("--quick", action="store_true", help="a 1-2 minute smoke run: preset tiny, 40 steps, H 10")
    parser.add_argument("--steps", type=int, default=160, help="training steps per run (a multiple of --every)")
    parser.add_argument("--every", type=int, default=40, help="DiLoCo's H: inner steps between syncs")
    parser.add_argument("--outer-lr", type=float, default=0.7, help="DiLoCo's outer Nesterov SGD lr")
    parser.add_argument("--outer-momentum", type=float, default=0.9, help="DiLoCo's outer momentum")
    parser.add_argument("--wire", choices=tuple(WIRES), default="fp32",
                        help="the pseudo-gradient's dtype (int8: error feedback, about a quarter of fp32's bytes)")
    parser.add_argument("--fragments", type=int, default=4, help="streaming: F (GPT small has 7 units)")
    parser.add_argument("--delay", type=int, default=2, help="streaming: tau, steps a fragment's sync overlaps")
    parser.add_argument("--mix", type=float, default=0.0, help="streaming: alpha, the local share kept")
    parser.add_argument("--preset", default="small", help="a GPT preset of hsdp.models.gpt (default: small)")
    parser.add_argument("--batch", type=int, default=1, help="sequences per rank per step")
    parser.add_argument("--block", type=int, default=128, help="tokens per sequence (<= the preset's block)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of tokens/s")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-windows", type=int, default=64, help="held-out windows (each replica all of them)")
    parser.add_argument("--corpus-bytes", type=int, default=2_000_000)
    parser.add_argument("--sweep", nargs="+", metavar="SPEC", help="loss only, on loopback: run each "
                        "H:outer_lr:outer_momentum:wire[:F:tau] (and plain HSDP) for --steps, append to the "
                        "sweep file")
    parser.add_argument("--sweep-json", help="the driver: list this sweep file's runs in the Markdown")
    parser.add_argument("--tag", default="", help="a suffix for the result files")
    parser.add_argument("--out", default=os.devnull, help="--job: where rank 0 writes its record")
    args = parser.parse_args()
    if args.quick:
        args.preset, args.steps, args.every, args.eval_windows = "tiny", 40, 10, 16
        args.block = min(args.block, 64)
        args.tag = args.tag or "quick"
    if "plain" not in args.modes:
        parser.error("--modes must include plain (the ratios and gaps are against it)")
    if args.job and args.mode in torchft_side.MODES:
        torchft_side.job(args, _held_out, _evaluate)
    elif args.job:
        job(args)
    elif args.sweep:
        sweep(args)
    else:
        drive(args)


if __name__ == "__main__":
    main()
