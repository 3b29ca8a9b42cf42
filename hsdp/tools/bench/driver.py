"""Side-by-side benchmark: hsdp (plain, and with ``shard_optimizer_across_replicas``) against FSDP2 (HSDP and
full shard) and DDP on the same GPT, seed and batches.

Every (network, system) pair runs as its own job of 2 nodes x 2 ranks: on an emulated cluster (network
namespaces, inter-node links shaped by tc) at each ``--bandwidths`` value, and on plain loopback. Reports
median step time, the ratios to FSDP2 HSDP and to plain hsdp, peak tensor memory and peak RSS per rank, model
state per rank split into parameters, gradients and optimizer state (``hsdp.state_bytes``), and inter-node
bytes per step read from the link counters against the floor ``2 (R-1)/R x P x 4`` bytes per node. Writes
JSON, a dated Markdown table with the exact command, and a plot to ``--out``.

    hsdp bench                       # the full matrix (tens of minutes on 2 cores)
    hsdp bench --bandwidths 1gbit --systems hsdp,fsdp2-hsdp --steps 5
    hsdp bench --systems hsdp,fsdp2-hsdp --no-extras --repeat 3     # ratios robust to a noisy machine
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from hsdp.tools.bench.report import markdown_table, plot
from hsdp.tools.results import results_run

DEFAULT_SYSTEMS = "hsdp,hsdp-opt-across-replicas,fsdp2-hsdp,fsdp2-full,ddp"


def _launch_command(network: str, stats: str) -> list[str]:
    base = [sys.executable, "-m", "hsdp", "launch", "--nodes", "2", "--nproc-per-node", "2"]
    if network == "loopback":
        return [*base, "--no-emulation"]
    return [*base, "--inter-node-bandwidth", network, "--require-emulation", "--stats-json", stats]


def jobs(args: argparse.Namespace) -> list[tuple[str, str, int]]:
    """(network, system, micro-batches) in run order."""
    networks = [b for b in args.bandwidths.split(",") if b] + ([] if args.no_loopback else ["loopback"])
    out = [(n, s, args.micro_batches) for n in networks for s in args.systems.split(",")]
    if networks and not args.no_extras:
        first = networks[0]
        out += [(first, "hsdp-bf16-hop", args.micro_batches), (first, "hsdp-int8-hop", args.micro_batches),
                (first, "hsdp", 4), (first, "fsdp2-hsdp", 4)]
    return out


def run_one(args: argparse.Namespace, network: str, system: str, micro_batches: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out, stats = f"{tmp}/result.json", f"{tmp}/stats.json"
        worker = ["-m", "hsdp.tools.bench.worker", "--system", system, "--preset", args.preset,
                  "--batch", str(args.batch), "--seq", str(args.seq), "--micro-batches", str(micro_batches),
                  "--steps", str(args.steps), "--warmup", str(args.warmup), "--out", out]
        cmd = [*_launch_command(network, stats), "--", *worker]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0 or not Path(out).exists():
            tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-25:])
            return {"system": system, "network": network, "micro_batches": micro_batches,
                    "error": f"exit {proc.returncode}:\n{tail}"}
        result = json.loads(Path(out).read_text())
    result["network"] = network
    return result


def summarise(results: list[dict]) -> list[dict]:
    """Add the floor, per-node inter-node MB/step, peaks over ranks and the ratios to FSDP2 HSDP on the same
    network and micro-batch count."""
    ok = [r for r in results if "error" not in r]
    for r in ok:
        replicas = r["world"] // r["sharding_degree"]
        r["floor_mb_per_node"] = 2 * (replicas - 1) / replicas * r["params"] * 4 / 1e6
        sent = [node[0] for node in r["inter_node_bytes_per_step"]]
        r["inter_node_mb_per_node"] = statistics.median(sent) / 1e6 if any(sent) else None
        r["peak_rss_mib"] = max(r["peak_rss_mib_per_rank"])
        r["peak_tensor_mib"] = max(r["peak_tensor_mib_per_rank"])
        r["state_bytes"] = _largest_state(r)
    base = {(r["network"], r["micro_batches"]): r for r in ok if r["system"] == "fsdp2-hsdp"}
    plain = {(r["network"], r["micro_batches"]): r for r in ok if r["system"] == "hsdp"}
    for r in ok:
        ref = base.get((r["network"], r["micro_batches"]))
        r["ratio_to_fsdp2_hsdp"] = r["median_step_s"] / ref["median_step_s"] if ref else None
        r["tensor_peak_ratio_to_fsdp2_hsdp"] = r["peak_tensor_mib"] / ref["peak_tensor_mib"] if ref else None
        ref = plain.get((r["network"], r["micro_batches"]))
        r["ratio_to_hsdp"] = r["median_step_s"] / ref["median_step_s"] if ref else None
        ours, theirs = r["state_bytes"], ref and ref["state_bytes"]
        r["optimizer_bytes_ratio_to_hsdp"] = (ours["optimizer"] / theirs["optimizer"]
                                              if ours and theirs and theirs["optimizer"] else None)
    return results


def _largest_state(r: dict) -> dict[str, int] | None:
    """Model-state bytes of the rank holding the most (ranks differ by padding and uneven chunks), with its
    total; None for results written before the worker measured them."""
    per_rank = r.get("state_bytes_per_rank")
    if not per_rank:
        return None
    largest = max(per_rank, key=lambda s: sum(s.values()))
    return {**largest, "total": sum(largest.values())}


def combine_repeats(runs: list[dict]) -> list[dict]:
    """One result per (network, system, micro-batches): the run with the median step time (an odd count
    picks the middle run; an even one the faster middle), with every run's median step time alongside.
    A job that failed in any repeat is reported as failed."""
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        groups.setdefault((r["network"], r["system"], r["micro_batches"]), []).append(r)
    out = []
    for group in groups.values():
        failed = [r for r in group if "error" in r]
        if failed:
            out.append(failed[0])
            continue
        ordered = sorted(group, key=lambda r: r["median_step_s"])
        chosen = dict(ordered[(len(ordered) - 1) // 2])
        chosen["repeats_median_step_s"] = [r["median_step_s"] for r in group]
        out.append(chosen)
    return out


def write(args: argparse.Namespace, results: list[dict], argv: list[str] | None) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = "hsdp bench " + shlex.join(sys.argv[1:] if argv is None else argv)
    run = results_run("bench", args.tag, command, args=vars(args))
    name, meta = run.name, run.meta
    (out / f"{name}.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    (out / f"{name}.md").write_text(markdown_table(meta, results))
    plot(results, out / f"{name}.png")
    print((out / f"{name}.md").read_text())
