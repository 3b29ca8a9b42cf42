"""Uneven batches on uneven nodes: ``model.set_batch_weight`` against an even split, on a slow and a fast node.

``hsdp launch --nodes 2 --nproc-per-node 2 --node-cpus 1.0,0.5``: node 0's two ranks share 1 CPU, node 1's
two share 0.5 (a cgroup cpu group per node), so a rank of node 1 computes half as fast. Every step trains a
small GPT (``hsdp.models``, byte-level, on the standard library's sources) on ``hsdp.init_mesh(2)`` (2 x 2:
sharding inside a node) with the SAME global batch of G sequences, drawn identically on every rank
(a generator seeded by the step), split two ways in separate runs:

* ``even``: G/4 sequences per rank; the slow node sets the pace and the fast one waits;
* ``weighted``: shares from a calibration at the start of the run (every rank times forward+backward of a
  fixed batch on a private copy of the model, all at once, so the ranks of a node share its CPUs as they do
  in training, in a few rounds whose median is the rate, so that one round disturbed by another program
  does not decide; the rates are all-gathered with ``model.comm.all_gather_floats``), proportional to the rates
  with largest-remainder rounding, every share >= 1; each rank calls ``model.set_batch_weight(share)`` and
  backwards its mean loss, so the gradient is the mean over the G sequences, as in the even split.

Both runs calibrate (the even run ignores the result), so they differ in the split only. The two loss curves
must agree up to float rounding (same samples, same gradient). Reported: the median step time over the
measured steps (after warm-up) of each run, tokens/s, the ratio weighted/even, the shares, the loss
difference, each rank's CPU time and exposed communication wait per step, and the fixed per-step cost (what
does not scale with the batch: communication, optimizer) from the two runs' step times. Runs alternate
(even, weighted, even, ...) ``--repeat`` times; figures are medians over the repeats. Writes
``benchmarks/results/hetero_weights_<date>.{json,md}`` with the command.

    python benchmarks/hetero_weights.py --repeat 3
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
MODES = ("even", "weighted")
MODEL = {"vocab_size": 256, "block_size": 128, "n_layer": 4, "n_head": 4, "n_embd": 128}  # ~0.84M parameters
SEQ = 128
CALIBRATION_BATCH = 4
CORPUS_BYTES = 2_000_000


# -- shares ----------------------------------------------------------------------------------------------
def proportional_shares(total: int, rates: Sequence[float]) -> list[int]:
    """``total`` samples split proportionally to ``rates`` (the sampler's largest remainder), every share at
    least 1 (taken from the largest shares). The same on every rank for the same rates."""
    from hsdp.data.weighted_sampler import split_sizes

    if total < len(rates) or not rates or min(rates) <= 0:
        raise ValueError(f"cannot split {total} samples over rates {list(rates)}: need total >= ranks, rates > 0")
    shares = split_sizes(rates, total)
    for i in range(len(shares)):
        if shares[i] == 0:
            shares[max(range(len(shares)), key=lambda j: (shares[j], -j))] -= 1
            shares[i] = 1
    return shares


# -- the worker: one run under hsdp launch ---------------------------------------------------------------
def _global_batch(corpus: object, step: int, size: int) -> object:
    """``size`` windows of SEQ + 1 bytes, the same on every rank: a generator seeded by the step."""
    import torch

    g = torch.Generator().manual_seed(10_000 + step)
    starts = torch.randint(0, corpus.numel() - SEQ - 1, (size,), generator=g)  # type: ignore[attr-defined]
    return torch.stack([corpus[s:s + SEQ + 1] for s in starts.tolist()])  # type: ignore[index]


def calibrate(module: object, batch: object, seconds: float) -> float:
    """Sequences per second of forward+backward of ``batch`` on ``module`` (no collectives): one warm-up
    pass, then passes for at least ``seconds`` (and 3)."""
    def one() -> None:
        _, loss = module(batch[:, :-1], batch[:, 1:])  # type: ignore[operator, index]
        loss.backward()

    one()
    n, start = 0, time.perf_counter()
    while n < 3 or time.perf_counter() - start < seconds:
        one()
        n += 1
    return n * CALIBRATION_BATCH / (time.perf_counter() - start)


def _waited(stats: dict[str, dict[str, dict[str, float]]]) -> float:
    return sum(op["waited"] for ops in stats.values() for op in ops.values())


def worker(args: argparse.Namespace) -> None:
    import torch

    import hsdp
    from hsdp.data.text import default_corpus_bytes
    from hsdp.models import GPT, GPTConfig

    torch.set_num_threads(1)  # a rank is one core's worth at most: its node's budget is what limits it
    mesh = hsdp.init_mesh(2)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.manual_seed(0)
    module = GPT(GPTConfig(**MODEL))
    probe = copy.deepcopy(module)  # the calibration's private copy: its passes touch no shard and no collective
    model = hsdp.ShardedModel(module, mesh=mesh)
    opt = hsdp.ShardedOptimizer(model, torch.optim.AdamW(model.parameters(), lr=args.lr))
    corpus = torch.frombuffer(bytearray(default_corpus_bytes(CORPUS_BYTES)), dtype=torch.uint8).long()

    rounds = []
    for _ in range(args.calibrate_rounds):
        model.comm.all_gather_floats([0.0])  # everyone here: calibrate at once, as the nodes' CPUs are shared
        rounds.append(calibrate(probe, _global_batch(corpus, -1, CALIBRATION_BATCH), args.calibrate_s))
    rate = statistics.median(rounds)
    del probe
    all_rounds = model.comm.all_gather_floats([rate, *rounds])
    rates = [r[0] for r in all_rounds]
    shares = proportional_shares(args.global_batch, rates) if args.mode == "weighted" \
        else [args.global_batch // world] * world
    lo, share = sum(shares[:rank]), shares[rank]

    ends, weighted_losses = [], []
    cpu0 = 0.0
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            model.reset_comm_stats()
            cpu0 = time.process_time()
        rows = _global_batch(corpus, step, args.global_batch)[lo:lo + share]
        if args.mode == "weighted":
            model.set_batch_weight(share)
        _, loss = model(rows[:, :-1], rows[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        ends.append(time.perf_counter())
        weighted_losses.append(loss.item() * share)
    per_step = [(time.process_time() - cpu0) / args.steps, _waited(model.comm_stats()) / args.steps]
    losses = model.comm.all_gather_floats(weighted_losses)
    ranks = model.comm.all_gather_floats(per_step)
    if rank == 0:
        step_s = [b - a for a, b in zip(ends[args.warmup - 1:], ends[args.warmup:])]
        Path(args.out).write_text(json.dumps({
            "mode": args.mode, "rates": rates, "calibration_rounds": [r[1:] for r in all_rounds],
            "shares": shares, "step_s": step_s,
            "global_loss": [sum(col) / args.global_batch for col in zip(*losses)],
            "cpu_s_per_step": [r[0] for r in ranks], "waited_s_per_step": [r[1] for r in ranks]}))


# -- the driver: alternating runs on the emulated cluster ------------------------------------------------
def _launch_command(args: argparse.Namespace, mode: str, out: str) -> list[str]:
    return [sys.executable, "-m", "hsdp", "launch", "--nodes", "2", "--nproc-per-node", "2",
            "--node-cpus", args.node_cpus, "--inter-node-bandwidth", args.bandwidth, "--require-emulation",
            "--", __file__, "--worker", "--mode", mode, "--global-batch", str(args.global_batch),
            "--steps", str(args.steps), "--warmup", str(args.warmup), "--calibrate-s", str(args.calibrate_s),
            "--calibrate-rounds", str(args.calibrate_rounds),
            "--lr", str(args.lr), "--out", out]


def _loadavg() -> float:
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def run_job(args: argparse.Namespace, mode: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/result.json"
        load = _loadavg()
        proc = subprocess.run(_launch_command(args, mode, out), capture_output=True, text=True)
        if proc.returncode != 0 or not Path(out).exists():
            tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-30:])
            raise SystemExit(f"{mode} run failed (exit {proc.returncode}):\n{tail}")
        result = json.loads(Path(out).read_text())
    result["median_step_s"] = statistics.median(result["step_s"])
    result["tokens_per_s"] = args.global_batch * SEQ / result["median_step_s"]
    result["loadavg_before"] = load
    result["compute_bound_s"] = compute_bound_s(result)
    return result


def compute_bound_s(run: dict) -> float:
    """The step's compute as calibrated: the slowest rank's share / rate (forward+backward, no collectives).
    The rest of the step is what does not scale with the batch (communication, optimizer, waiting)."""
    return max(share / rate for share, rate in zip(run["shares"], run["rates"]))


def summarise(runs: list[dict]) -> dict:
    by_mode = {m: [r for r in runs if r["mode"] == m] for m in MODES}
    pairs = list(zip(by_mode["even"], by_mode["weighted"]))
    out: dict = {m: {"median_step_s": statistics.median(r["median_step_s"] for r in rs),
                     "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rs),
                     "repeats_tokens_per_s": [r["tokens_per_s"] for r in rs]} for m, rs in by_mode.items()}
    out["ratio_weighted_over_even"] = out["weighted"]["tokens_per_s"] / out["even"]["tokens_per_s"]
    out["paired_ratios"] = [w["tokens_per_s"] / e["tokens_per_s"] for e, w in pairs]
    out["shares"] = [r["shares"] for r in by_mode["weighted"]]
    out["max_loss_difference"] = max(max(abs(a - b) for a, b in zip(e["global_loss"], w["global_loss"]))
                                     for e, w in pairs)
    for m, rs in by_mode.items():
        out[m]["compute_bound_s"] = statistics.median(r["compute_bound_s"] for r in rs)
        out[m]["rest_s"] = statistics.median(r["median_step_s"] - r["compute_bound_s"] for r in rs)
    # What the calibration promises if the rest of the step stayed as in the even run.
    out["predicted_ratio"] = statistics.median(
        e["median_step_s"] / (e["median_step_s"] - e["compute_bound_s"] + compute_bound_s({**e, "shares": w["shares"]}))
        for e, w in pairs)
    return out


def _row(mode: str, runs: list[dict], s: dict) -> str:
    rs = [r for r in runs if r["mode"] == mode]
    cpu = [statistics.median(r["cpu_s_per_step"][i] / r["median_step_s"] for r in rs) for i in range(4)]
    wait = [statistics.median(r["waited_s_per_step"][i] for r in rs) for i in range(4)]
    reps = ", ".join(f"{x:.0f}" for x in s[mode]["repeats_tokens_per_s"])
    return (f"| {mode} | {rs[-1]['shares']} | {s[mode]['median_step_s']:.3f} | {s[mode]['tokens_per_s']:.0f} "
            f"| {reps} | {s[mode]['compute_bound_s']:.3f} | {s[mode]['rest_s']:.3f} "
            f"| {', '.join(f'{c:.2f}' for c in cpu)} | {', '.join(f'{w:.3f}' for w in wait)} |")


def markdown(command: str, meta: dict, args: argparse.Namespace, runs: list[dict], s: dict) -> str:
    even, weighted = (next(r for r in runs if r["mode"] == m) for m in MODES)
    rates = ", ".join(f"{x:.1f}" for x in weighted["rates"])
    loads = ", ".join(f"{r['loadavg_before']:.1f}" for r in runs)
    return "\n".join([
        f"# Weighted uneven batches on a slow and a fast node ({meta['date']}, commit {meta['git']})", "",
        f"Command: `{command}`", "",
        f"`hsdp launch --nodes 2 --nproc-per-node 2 --node-cpus {args.node_cpus} --inter-node-bandwidth "
        f"{args.bandwidth}` (network namespaces, a cgroup cpu group per node), `hsdp.init_mesh(2)`, GPT "
        f"{MODEL} (byte-level, stdlib sources), global batch {args.global_batch} x {SEQ} tokens, the same "
        f"samples per step in both runs, AdamW lr {args.lr}; {args.steps} measured steps after {args.warmup} "
        f"warm-up, {args.repeat} alternating repeats, medians over the repeats.", "",
        "| split | shares (ranks 0-3, last run) | median step s | tokens/s | per repeat | slowest rank's "
        "calibrated compute s | rest of the step s | CPU per rank (of its step) | exposed comm wait s/step |",
        "|---|---|---|---|---|---|---|---|---|",
        _row("even", runs, s), _row("weighted", runs, s), "",
        f"- **weighted / even tokens/s: {s['ratio_weighted_over_even']:.2f}x** (per repeat: "
        f"{', '.join(f'{x:.2f}' for x in s['paired_ratios'])}; ideal 1.5x for nodes at 2:1)",
        f"- calibrated rates (sequences/s, ranks 0-3, last run): {rates}; shares per weighted run: {s['shares']}",
        f"- largest difference of the per-step global loss between the even and the weighted run: "
        f"{s['max_loss_difference']:.2e} (loss {even['global_loss'][0]:.3f} -> {even['global_loss'][-1]:.3f})",
        f"- the rest of the step (communication, optimizer, imbalance: not scaled by the batch) is "
        f"{s['even']['rest_s'] / s['even']['median_step_s']:.0%} of the even step; with the even run's rest, "
        f"the calibrated rates promise {s['predicted_ratio']:.2f}x",
        f"- load average of the machine before each run: {loads}",
        ""])


def driver(args: argparse.Namespace, argv: list[str]) -> None:
    from hsdp.tools.results import results_run

    runs = []
    for rep in range(args.repeat):
        for mode in MODES:
            print(f"repeat {rep + 1}/{args.repeat}: {mode} ...", flush=True)
            runs.append(run_job(args, mode))
            print(f"  median step {runs[-1]['median_step_s']:.3f} s, shares {runs[-1]['shares']}", flush=True)
    summary = summarise(runs)
    command = "python benchmarks/hetero_weights.py " + shlex.join(argv)
    run = results_run("hetero_weights", args.tag, command, args=vars(args), model=MODEL, seq=SEQ)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{run.name}.json").write_text(json.dumps({**run.meta, "runs": runs, "summary": summary}, indent=1))
    text = markdown(command, run.meta, args, runs, summary)
    (RESULTS / f"{run.name}.md").write_text(text)
    print(text)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--node-cpus", default="1.0,0.5")
    p.add_argument("--bandwidth", default="10gbit")
    p.add_argument("--global-batch", type=int, default=96, help="sequences per step (a multiple of 4)")
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--calibrate-s", type=float, default=1.5, help="seconds per calibration round")
    p.add_argument("--calibrate-rounds", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--tag", default="")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.global_batch % 4:
        p.error(f"--global-batch {args.global_batch}: the even split needs a multiple of 4 (2 nodes x 2 ranks)")
    if args.worker:
        worker(args)
    else:
        driver(args, argv)


if __name__ == "__main__":
    main()
