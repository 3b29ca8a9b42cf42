"""``hsdp bench``: the arguments of :mod:`hsdp.tools.bench.driver` and the run over its job list.

Every argument after ``bench`` goes to this module's own parser (:func:`main`); ``hsdp --help`` only lists it.
"""

from __future__ import annotations

import argparse

from hsdp.apps.cli.helptext import RATE_UNITS, HelpFormatter
from hsdp.tools.bench import driver


def add_bench(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """List ``bench`` on ``subparsers`` for ``hsdp --help``; ``hsdp.apps.cli.main`` hands it to :func:`main`."""
    return subparsers.add_parser("bench", help="hsdp against FSDP2 (HSDP, full shard) and DDP on the same work "
                                               "(see `hsdp bench --help`)", add_help=False)


def build_parser() -> argparse.ArgumentParser:
    """``hsdp bench``'s own parser; every option's help ends with its default."""
    p = argparse.ArgumentParser(prog="hsdp bench", description=driver.__doc__, formatter_class=HelpFormatter)
    p.add_argument("--systems", default=driver.DEFAULT_SYSTEMS,
                   help="comma list; also hsdp-bf16-hop, hsdp-int8-hop")
    p.add_argument("--bandwidths", default="1gbit,200mbit",
                   help=f"comma list of emulated inter-node rates, {RATE_UNITS}; '' for none")
    p.add_argument("--no-loopback", action="store_true", help="skip the plain-loopback runs")
    p.add_argument("--preset", default="bench", help="GPT shape of hsdp.models (tiny, small, bench, gpt2-124m, ...)")
    p.add_argument("--batch", type=int, default=2, help="sequences per rank and micro-batch")
    p.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    p.add_argument("--micro-batches", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--steps", type=int, default=5, help="measured steps per job (after the warm-up)")
    p.add_argument("--warmup", type=int, default=2, help="steps run before measuring")
    p.add_argument("--out", default="benchmarks/results", help="directory of the JSON, Markdown and PNG results")
    p.add_argument("--tag", default="", help="suffix of the result file names")
    p.add_argument("--repeat", type=int, default=1,
                   help="run the whole job list this many times, interleaved (A B A B, so drifts in machine load "
                        "hit every system alike); each figure is the median over the repeats")
    p.add_argument("--no-extras", action="store_true",
                   help="skip the hsdp variants on the first bandwidth: bf16 and int8 inter-node hops, and "
                        "4 micro-batches with deferred sync (hsdp and FSDP2 HSDP)")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run ``hsdp bench`` with ``argv`` (default: the process's); 0 when every job ran, else 1."""
    args = parse_args(argv)
    if args.repeat < 1:
        raise SystemExit(f"hsdp bench: error: --repeat must be at least 1, got {args.repeat}")
    runs = []
    todo = driver.jobs(args) * args.repeat
    for i, (network, system, micro) in enumerate(todo, 1):
        print(f"[bench {i}/{len(todo)}] {system} on {network}, {micro} micro-batch(es) ...", flush=True)
        r = driver.run_one(args, network, system, micro)
        print(f"[bench]   median step {r.get('median_step_s', r.get('error'))}", flush=True)
        runs.append(r)
    results = driver.summarise(driver.combine_repeats(runs))
    driver.write(args, results, argv)
    return 0 if all("error" not in r for r in results) else 1
