"""Batches that give the replicas' inner steps the same length, measured (``decentralized.py --balance-rounds``).

A DiLoCo sync waits for the slowest replica, so a replica whose inner steps are shorter idles at every sync:
batch weights exist so that it trains on more samples instead (``model.set_batch_weight``; a sync weighs each
replica's pseudo-gradient by what it processed). Which batch makes the steps equal depends on the machine and
drifts with it, so the driver measures it instead of assuming it: a short ``alone`` launch (no inter-node
communication) at the current batches gives each replica's mean inner-step seconds, and every replica faster
than the slowest has its ranks' batches scaled by ``slowest / own``. A step's time is not proportional to its
batch (a fixed part: the optimizer step, the launch overheads; cpu-quota periods), so one round misses: the
next measures again from there and applies half the correction (the ratios are of concurrent runs, which this
machine's drift affects alike, but a 30 s window's noise is some percent). Batches are sequences per step on
average, to a tenth: a rank of mean ``b`` trains on :func:`count_at` sequences at inner step ``k``
(``floor(b (k + 1)) - floor(b k)``), so fractions pace exactly.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

import decentralized_report as report


def parse_batches(text: str) -> list[float]:
    """``"4,4,30.5,8"`` -> each rank's mean sequences per step; ``ValueError`` naming a count below 1."""
    batches = [float(x) for x in text.split(",")]
    if any(not math.isfinite(b) or b < 1 for b in batches):
        raise ValueError(f"--batches {text}: every rank needs at least 1 sequence per step on average")
    return batches


def show_batches(batches: list[float]) -> str:
    return ",".join(f"{b:g}" for b in batches)


def count_at(step: int, mean: float) -> int:
    """The sequences a rank of mean ``mean`` trains on at inner step ``step``: the whole part, plus one on the
    steps where the fraction carries (``mean`` itself for an integer)."""
    return math.floor(mean * (step + 1) + 1e-9) - math.floor(mean * step + 1e-9)


def step_seconds(run: dict) -> list[float]:
    """Each replica's mean inner-step seconds over an alone run's window (its rank 0's log): the mean, not the
    median, as a sync waits for the slowest replica's whole phase, its slow steps included."""
    t0, end = run["t0"], run["t0"] + run["window"]
    seconds = []
    for replica in sorted({replica for replica, _ in run["logs"]}):
        times = [r["t"] for inc in run["logs"][(replica, 0)] for r in report.steps(inc) if t0 <= r["t"] <= end]
        seconds.append((times[-1] - times[0]) / (len(times) - 1))
    return seconds


def rebalance(batches: list[float], nproc: list[int], seconds: list[float], damping: float = 1.0) -> list[float]:
    """``batches`` with each replica faster than the slowest scaled by ``(slowest / own) ** damping`` (to a tenth
    of a sequence, never below the batch it had); the slowest keeps its own. A later round damps (``0.5``: half
    the correction, in ratio), as two runs' ratios differ by this machine's noise as well."""
    slowest, out, at = max(seconds), [], 0
    for n, own in zip(nproc, seconds):
        out += [max(b, round(b * (slowest / own) ** damping, 1)) for b in batches[at:at + n]]
        at += n
    return out


def balance_batches(args: argparse.Namespace, nproc: list[int], alone: Callable[[str], dict]) -> list[dict]:
    """``--balance-rounds`` short alone launches (``alone(name)``, each over ``--balance-seconds``), each rescaling
    ``args.batches`` so that the replicas' inner steps take as long; what each round measured."""
    rounds, window = [], args.alone_seconds
    args.alone_seconds = args.balance_seconds
    try:
        for i in range(args.balance_rounds):
            seconds = step_seconds(alone(f"balance-{i}"))
            batches = rebalance(parse_batches(args.batches), nproc, seconds, 1.0 if i == 0 else 0.5)
            rounds.append({"batches": args.batches, "step_s": [round(t, 4) for t in seconds],
                           "next": show_batches(batches)})
            print(f"[bench] balance round {i}: --batches {args.batches}: inner steps of {rounds[-1]['step_s']} s; "
                  f"next {rounds[-1]['next']}", flush=True)
            args.batches = show_batches(batches)
    finally:
        args.alone_seconds = window
    return rounds
