"""PreemptionGuard in a hand-written loop: a SIGTERM to one rank stops every rank after the same step, in
time to save; without a signal nothing changes; the previous SIGTERM handler comes back afterwards."""

from __future__ import annotations

import os
import signal

from harness import run_distributed

import hsdp


def _loop(rank: int, world: int) -> dict:
    mesh = hsdp.init_mesh(2)
    before = signal.getsignal(signal.SIGTERM)
    steps_run, agreed_at = [], None
    with hsdp.PreemptionGuard(mesh) as guard:
        for step in range(1, 10):
            steps_run.append(step)
            if rank == 3 and step == 4:  # a scheduler signals one node's rank only
                os.kill(os.getpid(), signal.SIGTERM)
            if guard.should_stop():
                agreed_at = step
                break
        requested = guard.requested
    with hsdp.PreemptionGuard(mesh) as quiet:
        nothing = [quiet.should_stop() for _ in range(3)]
    return {"steps": steps_run, "agreed_at": agreed_at, "stopped": guard.stopped, "requested": requested,
            "restored": signal.getsignal(signal.SIGTERM) == before, "quiet": nothing}


def test_sigterm_on_one_rank_stops_every_rank_at_the_same_step() -> None:
    results = run_distributed(_loop, 4)
    for rank, r in enumerate(results):
        assert r["agreed_at"] == 4 and r["steps"] == [1, 2, 3, 4] and r["stopped"], (rank, r)
        assert r["requested"] is (rank == 3)  # only rank 3 got the signal; the others learned it
        assert r["restored"] and r["quiet"] == [False, False, False]
