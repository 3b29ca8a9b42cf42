"""The goodput model (``goodput.py``) against published figures, from the inputs each publication gives.

Each :class:`Check` is one published figure with the inputs its source states and, where the source does not
state one that the model needs, an assumption said in words next to it. ``docs/reference/goodput.md`` is
generated from this table (``python -m hsdp.tools.planner.goodput_published > docs/reference/goodput.md``) and a
test fails when they drift, or when an estimate moves further from its figure than the table says.
"""

from __future__ import annotations

from dataclasses import dataclass

from hsdp.tools.planner.goodput import (
    CheckpointRestart,
    ElasticReplicas,
    Failures,
    Recovery,
    goodput,
    stall_for,
)

DAY = 86400.0
MINUTE = 60.0


@dataclass(frozen=True)
class Check:
    """A published ``figure`` (fraction of wall time, or of steps, that trained) next to the model's estimate
    from ``failures`` and ``recovery``; ``stated``: the inputs the source gives, ``assumed``: the ones it does
    not (with the value used), ``why``: what explains the gap."""

    name: str
    source: str
    figure: float
    failures: Failures
    recovery: Recovery
    stated: str
    assumed: str
    why: str
    steps: bool = False  # the figure counts committed steps, not capacity: the estimate is 1 - stalled

    @property
    def estimate(self) -> float:
        g = goodput(self.failures, self.recovery)
        return 1 - g.stalled if self.steps else g.fraction


def _ft_hsdp_failures() -> Failures:
    """The failure rate FT-HSDP's synchronous figure implies: 44% effective time with a 10-minute restart and a
    checkpoint every 5 minutes (assumed), solved for the rate by bisection on the model."""
    lo, hi = 1e-7, 1e-2  # failures per second
    for _ in range(100):
        mid = (lo * hi) ** 0.5
        synchronous = goodput(Failures(1, 1 / mid), CheckpointRestart(5 * MINUTE, 0.0, 10 * MINUTE)).fraction
        lo, hi = (mid, hi) if synchronous > 0.44 else (lo, mid)
    return Failures(1, 1 / lo)


_LLAMA3 = Failures.observed(2048, 419, 54 * DAY)

CHECKS: tuple[Check, ...] = (
    Check("Llama 3 405B, checkpoint-restart", "The Llama 3 Herd of Models (Meta, 2024), section 3.3.4", 0.90,
          _LLAMA3, CheckpointRestart(15 * MINUTE, 0.0, 10 * MINUTE),
          "16,384 H100 on 2,048 nodes; 419 unexpected interruptions in 54 days (one every 3.1 h); "
          "effective training time above 90%",
          "restart 10 min (FT-HSDP's figure for a synchronous restart at scale); a checkpoint every 15 min, "
          "saved without blocking",
          f"the figure is a lower bound; the model allows {stall_for(0.90, _LLAMA3) / MINUTE:.1f} min per failure "
          "for 90%, so any restart + half-interval under that lands above it"),
    Check("FT-HSDP at O(100k) GPUs, fault-tolerant", "Training LLMs with Fault Tolerant HSDP on 100,000 GPUs "
          "(arXiv 2602.00277)", 0.80, _ft_hsdp_failures(),
          ElasticReplicas(64, stall_s=3 * MINUTE, step_s=0.0, rejoin_s=10 * MINUTE),
          "synchronous training: 10 min stall per failure, 44% effective time; FT-HSDP: 3 min stall, 80%",
          "the failure rate solved from the synchronous 44% (a checkpoint every 5 min, restart 10 min: one "
          "failure every 15 min); 64 replicas, the failed one back after 10 min",
          "the stall dominates (20% of wall time); the replica count and rejoin time move the estimate by under "
          "one point (16 replicas: 77%)"),
    Check("torchft, 300 L40S, a failure every 60 s", "torchft, PyTorch blog (2025-06-20)", 0.82,
          Failures(1, 60.0), ElasticReplicas(30, stall_s=5.1, step_s=3.0, rejoin_s=60.0),
          "30 replica groups of 10 GPUs; one failure every 60 s; 82% step efficiency",
          "a stall of 5.1 s (what a survivor waited with torchft 0.2.0's default 5 s heartbeat timeout when we ran "
          "it on gloo); a 3 s step; the failed group back after 60 s",
          "the step time is not published: each further second per failure costs 1.7 points"),
    Check("hsdp elastic_recovery benchmark (3 x 2 emulated, a kill every 60 s)",
          "benchmarks/results/elastic_recovery_2026-12-03.md", 0.934, Failures(1, 75.0),
          ElasticReplicas(3, stall_s=2.93, step_s=1 / 7.78, rejoin_s=8.07),
          "4 kills in the 300 s window; recovery 2.93 s and rejoin 8.07 s (medians), 7.78 steps/s; committed "
          "steps 0.934 of the failure-free run's",
          "none (the figure counts committed steps: the estimate is 1 - stalled)",
          "the run loses 4.9 s per kill where the model counts 3.1 s: the survivors pause to heal the joiner, and "
          "run slower while its restart shares the machine's CPUs", steps=True),
)


def markdown() -> str:
    """The page: each figure next to the estimate, the inputs and what explains the gap."""
    lines = ["# Goodput: the model against published figures", "",
             "Generated from `hsdp/tools/planner/goodput_published.py`: "
             "`python -m hsdp.tools.planner.goodput_published > docs/reference/goodput.md`. The model is "
             "`hsdp.tools.planner.goodput` (its docstring has the formulas); `hsdp plan --node-mtbf` applies it to "
             "each layout.", "",
             "| case | published | estimate | inputs stated | inputs assumed |", "|---|---|---|---|---|"]
    for c in CHECKS:
        lines.append(f"| {c.name} ({c.source}) | {c.figure:.1%} | {c.estimate:.1%} | {c.stated} | {c.assumed} |")
    lines += ["", "Why each estimate lands where it does:", ""]
    lines += [f"- {c.name}: {100 * (c.estimate - c.figure):+.1f} points; {c.why}." for c in CHECKS]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
