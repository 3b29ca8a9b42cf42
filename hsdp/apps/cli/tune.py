"""``hsdp tune``: the arguments of :mod:`hsdp.tools.planner.tune`, the run (measure, calibrate, compare) and
its output."""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from hsdp.apps.cli.helptext import RATE_UNITS, HelpFormatter
from hsdp.apps.cli.plan import parse_degrees
from hsdp.tools.planner.balance import propose_weights
from hsdp.tools.planner.compare import TuneReport, analyse, emulated_cluster, options_from_metrics
from hsdp.tools.planner.tune import (
    DEFAULT_SCRIPT,
    TuneRun,
    candidate_label,
    collect,
    default_workdir,
    load_metrics,
    shards_optimizer,
    summarise,
)
from hsdp.tools.quantities import parse_bandwidth, parse_bytes

TUNE_EPILOG = f"""\
examples:
  hsdp tune                                          # the built-in workload on 2 emulated nodes x 2 ranks
  hsdp tune --nodes 4 --nproc-per-node 2 --inter-node-bandwidth 100mbit --repeats 3 -- train.py --steps 8
  hsdp tune --from-metrics runs/tune/ --nodes 16 --nproc-per-node 8 --inter-node-bandwidth 50GB/s

The script runs once per shard degree and repeat with HSDP_SHARDING_DEGREE set (hsdp.init_mesh() reads it)
and HSDP_METRICS_FILE naming where it writes its measurements (hsdp.tools.planner.metrics.StepRecorder);
HSDP_SHARD_OPTIMIZER_ACROSS_REPLICAS=1 asks it to pass shard_optimizer_across_replicas=True to ShardedModel.
Every rank runs the same batch; from the recommended layout's per-rank times (busy seconds on CPU ranks: a
step less its waits in collectives; else forward+backward of the unwrapped model) tune proposes batch weights
that equalize them (weight_r = slowest / t_r), for hsdp train's parallel.batch_weights and
hsdp.distributed_sampler(weights=...); on a uniform machine they are about 1.
Without a script: {" ".join(DEFAULT_SCRIPT)}.
"""


def add_tune(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``tune`` on ``subparsers``."""
    p = subparsers.add_parser("tune", help="measure each shard degree, calibrate the cost model, recommend",
                              description="Run a few steps of each candidate layout, fit the cost model's "
                                          "constants to the measurements and print predicted vs measured. "
                                          "Candidates keep T=1 (no tensor parallelism: the script would need a "
                                          "TP plan); hsdp plan --tp auto estimates T > 1.",
                              epilog=TUNE_EPILOG, formatter_class=HelpFormatter)
    p.add_argument("--nodes", type=int, default=2, help="nodes (emulated: one namespace each)")
    p.add_argument("--nproc-per-node", type=int, default=2, help="ranks per node")
    p.add_argument("--inter-node-bandwidth", default="1gbit",
                   help=f"emulated link rate of each node, each direction: {RATE_UNITS}")
    p.add_argument("--inter-node-latency", default="0", help="emulated one-way delay, e.g. 1ms")
    p.add_argument("--intra-node-bandwidth", default=None,
                   help=f"nominal rate inside a node before calibration, {RATE_UNITS} (default: 200MB/s, gloo "
                        f"on loopback)")
    p.add_argument("--degrees", default=None, help="comma list of shard degrees (default: every divisor)")
    p.add_argument("--repeats", type=int, default=2, help="launches per degree, round-robin")
    p.add_argument("--gpu-memory", default=None, help="memory limit per rank for 'fits' (default: none)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--no-emulation", action="store_true", help="run the nodes on loopback (no shaping)")
    mode.add_argument("--allow-fallback", action="store_true", help="fall back to loopback without root")
    p.add_argument("--shard-optimizer-across-replicas", default="auto", choices=("auto", "on", "off"),
                   help="auto: measure each degree with R > 1 also with the optimizer sharded across replicas "
                        "($HSDP_SHARD_OPTIMIZER_ACROSS_REPLICAS=1) and let the plan use it where it pays")
    p.add_argument("--from-metrics", nargs="+", metavar="PATH", help="analyse existing metrics files or dirs")
    p.add_argument("--workdir", default=None, help="keep every run's metrics and log here (default: a temp dir)")
    p.add_argument("--out", default=None, help="write tune_<date>[_<tag>].json/.md/.png into this directory")
    p.add_argument("--tag", default="", help="suffix of the result file names")
    p.add_argument("--json", metavar="FILE", help="write the report as JSON ('-': stdout)")
    p.add_argument("--plot", metavar="FILE", help="write the calibrated plan with the measured points (PNG)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, metavar="-- SCRIPT [ARGS...]")
    p.set_defaults(func=run_tune)
    return p


def _tune_run(args: argparse.Namespace) -> TuneRun:
    script = list(args.script_args)
    if script[:1] == ["--"]:
        script = script[1:]
    emulation = "none" if args.no_emulation else "auto" if args.allow_fallback else "require"
    return TuneRun(tuple(script) or DEFAULT_SCRIPT, args.nodes, args.nproc_per_node, args.inter_node_bandwidth,
                   args.inter_node_latency, tuple(parse_degrees(args.degrees) or ()), args.repeats, emulation,
                   shard_optimizer=args.shard_optimizer_across_replicas)


def _report(args: argparse.Namespace, results: list[dict[str, Any]]) -> TuneReport:
    measured = summarise(results)
    memory = parse_bytes(args.gpu_memory) if args.gpu_memory else math.inf
    nominal = emulated_cluster(measured.world_size // measured.nproc_per_node, measured.nproc_per_node,
                               args.inter_node_bandwidth, memory)
    if args.intra_node_bandwidth:
        nominal = replace(nominal, intra_bandwidth=parse_bandwidth(args.intra_node_bandwidth))
    ok = next(r for r in results if "error" not in r)
    report = analyse(measured, nominal, options_from_metrics(ok), args.shard_optimizer_across_replicas)
    return replace(report, weights=propose_weights(_recommended_runs(report, results)))


def _recommended_runs(report: TuneReport, results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The runs of the recommended candidate (every successful run when there is none): the per-rank times
    the batch weights come from, measured at the same batch on every rank."""
    ok = [r for r in results if "error" not in r]
    key = (report.recommended_shard, report.recommended_shard_optimizer)
    return [r for r in ok if (r["sharding_degree"], shards_optimizer(r)) == key] or ok


def run_tune(args: argparse.Namespace) -> int:
    """Execute a parsed ``hsdp tune``; 0 when every candidate ran, 1 when some failed, 2 on bad arguments."""
    from hsdp.tools.planner.render import dump_json, print_tune, write_results

    try:
        if args.from_metrics:
            results = load_metrics(args.from_metrics)
        else:
            tune_run = _tune_run(args)
            workdir = Path(args.workdir) if args.workdir else default_workdir()
            labels = [candidate_label(*c) for c in tune_run.candidates]
            print(f"[tune] {tune_run.nodes} x {tune_run.nproc_per_node} ranks, candidates {', '.join(labels)}, "
                  f"{tune_run.repeats} repeats; runs in {workdir}", flush=True)
            results = collect(tune_run, workdir, echo=lambda s: print(s, flush=True))
        report = _report(args, results)
    except ValueError as e:
        print(f"hsdp tune: error: {e}", file=sys.stderr)
        return 2
    print_tune(report)
    if args.json:
        dump_json(report.as_dict(), args.json)
    if args.plot:
        from hsdp.tools.planner.plot import plot_plan

        plot_plan(report.plan, args.plot, report)
    if args.out:
        write_results(report, Path(args.out), args.tag, results)
    return 1 if report.measured.failures else 0
