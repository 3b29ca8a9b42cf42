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
import contextlib
import math
from collections.abc import Callable, Iterator

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


class Pacer:
    """A rank's mean batch, paced in the run (``--pace``): the balance rounds size the batches alone, but a
    replica's sync work differs from another's and this machine's speed drifts, so a replica that keeps waiting
    at the syncs' starts for the others (``SyncStep.waited``: the quorum's wait, summed over ``phases`` phases,
    against their wall time) grows its batch by ``gain`` of that share above ``deadband`` (arrival jitter). The
    slowest replica, the last to arrive, waits only for the coordinator's answer and keeps its batch; no replica
    shrinks, so the others converge on it, and the damping keeps one from overshooting past it for long."""

    def __init__(self, mean: float, phases: int = 4, deadband: float = 0.02, gain: float = 0.5) -> None:
        self.mean, self.phases, self.deadband, self.gain = mean, phases, deadband, gain
        self._since: float | None = None  # the wall time of the first counted phase's start
        self._idle, self._starts = 0.0, 0

    def after_step(self, now: float, started: bool, waited: float) -> float | None:
        """After an inner step whose syncs waited ``waited`` seconds for the others (``started``: a sync started
        at it, a phase's boundary), at wall time ``now``: the new mean when it changed, else None."""
        if self._since is None:  # count from a phase's start: a partial phase would skew the share
            if started:
                self._since = now
            return None
        self._idle += waited
        self._starts += started
        if self._starts < self.phases:
            return None
        share = self._idle / max(now - self._since, 1e-9)
        self._since, self._idle, self._starts = now, 0.0, 0
        if share <= self.deadband:
            return None
        self.mean = round(self.mean * min(1.25, 1 + self.gain * (share - self.deadband) / (1 - share)), 2)
        return self.mean


def paced_batches(run: dict, nproc: list[int], block: int) -> list[float]:
    """Each rank's mean sequences per inner step over a paced run's window (its log's tokens): the batches the
    references then run (:func:`at_paced_batches`)."""
    t0, end, out = run["t0"], run["t0"] + run["window"], []
    for replica, n in enumerate(nproc):
        for rank in range(n):
            counts = [r["tokens"] / block for inc in run["logs"].get((replica, rank), []) for r in report.steps(inc)
                      if t0 <= r["t"] <= end]
            out.append(round(sum(counts) / len(counts), 1))
    return out


@contextlib.contextmanager
def at_paced_batches(args: argparse.Namespace, nproc: list[int], run: dict) -> Iterator[list[float] | None]:
    """With ``--pace``, ``args.batches`` for the launches inside: the batches the paced ``run`` trained on
    (:func:`paced_batches`), restored after; yields them (None without ``--pace``). The references (the alone
    run after, plain HSDP) then do the same work per step as the run they are held against: a larger batch is
    more tokens per second alone and fewer steps for the same tokens."""
    from hsdp.models.gpt import preset

    if not args.pace:
        yield None
        return
    paced, initial = paced_batches(run, nproc, preset(args.preset).block_size), args.batches
    args.batches = show_batches(paced)
    try:
        yield paced
    finally:
        args.batches = initial
