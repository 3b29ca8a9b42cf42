"""``benchmarks/decentralized.py``'s accounting on made-up logs (its launches take ten minutes): the tokens a
killed incarnation trained after its last landed sync are not kept, the alone rate, the bytes per step, the stop
step between syncs."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import decentralized as bench  # noqa: E402

TOKENS = 10


def _step(t: float, step: int, landed: bool = False, sent: int = 0) -> dict:
    return {"t": t, "step": step, "tokens": TOKENS, "sent": sent, "committed": True, "replicas": [0, 1],
            "landed": [0] if landed else []}


def _run() -> dict:
    """Two 1-rank replicas, 0.1 s a step, a sync landing after every 10th step. Replica 1's first incarnation
    dies after step 34 (its last landed sync after step 29: steps 30-34 are lost); its second trains 40-99."""
    lands = {s for s in range(100) if s % 10 == 9}
    steady = [_step(0.1 * s, s, s in lands, sent=1000 if s in lands else 0) for s in range(100)]
    first = [{"joined": 0}, *[_step(0.1 * s, s, s in lands) for s in range(35)]]
    second = [{"joined": 40}, *[_step(0.1 * s, s, s in lands) for s in range(40, 100)]]
    return {"logs": {(0, 0): [steady], (1, 0): [first, second]}, "t0": 0.0, "window": 9.95, "kills": [],
            "links": None}


def test_kept_tokens_drop_a_dead_incarnations_unsynced_steps():
    run = _run()
    assert bench._kept_tokens(run, window_only=False) == TOKENS * (100 + 30 + 60)
    run["t0"], run["window"] = 2.0, 5.0  # steps 20..70 of the window (inclusive bounds, float times)
    kept = bench._kept_tokens(run)
    assert kept == TOKENS * (len(range(20, 71)) + len(range(20, 30)) + len(range(40, 71)))


def test_alone_rate_and_bytes_per_step():
    run = _run()
    assert bench._alone_rate(run) == TOKENS * (100 + 35 + 60) / run["window"]
    assert bench._node_bytes_per_step(run, [1, 1], in_window=True) == 100.0  # 10 syncs of 1000 B over 100 steps


def test_stop_step_falls_between_a_landing_and_the_next_start():
    args = argparse.Namespace(every=40, fragments=4, delay=2)
    for newest in range(0, 30):
        stop = bench._stop_step(newest, args, "decentralized")
        assert stop >= newest + 20 and (stop + 1) % 10 == 3  # a sync started after step 9 landed after 11
    assert bench._stop_step(5, args, "alone") == 25


def test_the_shown_command_leaves_out_the_kept_folder():
    assert bench._shown_argv(["--minutes", "5", "--keep", "/x", "--tag", "t", "--keep=/y"]) == \
        ["--minutes", "5", "--tag", "t"]
