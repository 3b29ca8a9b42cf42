"""Goodput (``hsdp plan --node-mtbf``): the closed forms, the published figures they are checked against, the CLI.

The checkpoint-restart form is Daly's: its limits are known (no failures: the save overhead alone; rare failures:
the first-order Young form) and its optimum sits near Young's interval. The elastic forms are an alternating
renewal per replica times the survivors' stall, checked on hand-computed numbers. The published table in
docs/reference/goodput.md is generated and each estimate stays within a few points of its figure.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from hsdp.apps.cli import main
from hsdp.tools.planner.goodput import (
    CheckpointRestart,
    ElasticDiLoCo,
    ElasticReplicas,
    Failures,
    goodput,
    stall_for,
    young_interval,
)
from hsdp.tools.planner.goodput_published import CHECKS, markdown

ROOT = Path(__file__).resolve().parents[1]
HOUR = 3600.0


def test_without_failures_checkpoint_restart_loses_only_the_saves() -> None:
    g = goodput(Failures(64, math.inf), CheckpointRestart(1800, 60, 600))
    assert g.fraction == pytest.approx(1800 / 1860) and g.saving == pytest.approx(60 / 1860)


def test_rare_failures_match_the_first_order_form() -> None:
    failures = Failures(16, 50_000 * HOUR)  # one every 3,125 h: rate x (restart + interval) ~ 1e-4
    r = CheckpointRestart(1800, 30, 600)
    first_order = 1800 / 1830 * (1 - failures.rate * (600 + 1830 / 2))
    g = goodput(failures, r)
    assert g.fraction == pytest.approx(first_order, abs=1e-7)
    assert 1 - g.fraction == pytest.approx(g.stalled + g.redone + g.saving, rel=1e-3)


def test_frequent_failures_leave_the_first_order_forms_behind() -> None:
    failures = Failures(1, 1800)  # a failure every 30 min, 10 min restarts
    r = CheckpointRestart(600, 0, 600)
    exact = goodput(failures, r).fraction
    assert exact == pytest.approx(600 / (math.exp(600 / 1800) * math.expm1(600 / 1800) * 1800))
    # Neither first-order form holds here (rate x cost = 0.5): the linear one charges failures that fall inside a
    # restart as new losses, the renewal one ignores that a failure can strike a restart or the redone work.
    cost = failures.rate * (600 + 300)
    assert 1 - cost + 0.1 < exact < 1 / (1 + cost) - 0.05


def test_youngs_interval_is_near_the_best_one() -> None:
    failures = Failures(1024, 20_000 * HOUR)
    save = 60.0
    young = young_interval(save, failures)
    assert young == pytest.approx(math.sqrt(2 * save * 20_000 * HOUR / 1024))
    grid = [young * f for f in (0.25, 0.5, 0.8, 1.0, 1.25, 2.0, 4.0)]
    values = [goodput(failures, CheckpointRestart(t, save, 600)).fraction for t in grid]
    best = max(values)
    assert values[3] > best - 2e-3 and values[0] < best and values[-1] < best


def test_elastic_replicas_by_hand() -> None:
    failures = Failures(8, 8 * 600)  # a failure every 600 s
    g = goodput(failures, ElasticReplicas(4, stall_s=4.0, step_s=2.0, rejoin_s=60.0))
    hit = 1 / 600 / 4  # one replica fails every 2,400 s
    away = hit * 60 / (1 + hit * 60)
    assert g.fraction == pytest.approx((1 - 6 / 600) * (1 - away))
    assert g.stalled == pytest.approx(0.01) and g.away == pytest.approx(0.99 * away)
    # Two replicas per node: each fails twice as often.
    two = goodput(failures, ElasticReplicas(4, stall_s=4.0, step_s=2.0, rejoin_s=60.0, per_failure=2))
    assert two.away == pytest.approx(0.99 * (2 * hit * 60) / (1 + 2 * hit * 60))


def test_elastic_diloco_stalls_only_when_a_failure_hits_a_sync_and_loses_a_phase() -> None:
    failures = Failures(1, 600)
    overlapped = goodput(failures, ElasticDiLoCo(4, phase_s=30.0, sync_s=0.0, stall_s=4.0, rejoin_s=60.0))
    assert overlapped.stalled == 0.0
    hit = 1 / 600 / 4
    assert overlapped.fraction == pytest.approx(1 - hit * 90 / (1 + hit * 90))  # away: rejoin + a phase
    blocking = goodput(failures, ElasticDiLoCo(4, phase_s=30.0, sync_s=10.0, stall_s=4.0, rejoin_s=60.0))
    assert blocking.stalled == pytest.approx(10 / 40 * 14 / 600)
    # Per-step elastic at the same failure rate stalls on every failure.
    assert goodput(failures, ElasticReplicas(4, 4.0, 1.0, 60.0)).stalled > blocking.stalled


def test_bad_inputs_name_the_fix() -> None:
    with pytest.raises(ValueError, match="at least one node and a positive mean time"):
        Failures(0, 100.0)
    with pytest.raises(ValueError, match="nobody to go on without it; use CheckpointRestart"):
        goodput(Failures(2, 100.0), ElasticReplicas(1))
    with pytest.raises(ValueError, match="checkpoint interval must be positive"):
        goodput(Failures(2, 100.0), CheckpointRestart(0.0))
    with pytest.raises(ValueError, match="between 1 and all 2"):
        goodput(Failures(2, 100.0), ElasticReplicas(2, per_failure=3))


def test_published_figures_land_within_a_few_points_and_the_page_is_generated() -> None:
    assert (ROOT / "docs" / "reference" / "goodput.md").read_text() == markdown()
    by_name = {c.name.split(",")[0]: c for c in CHECKS}
    for c in CHECKS:
        assert abs(c.estimate - c.figure) < 0.03, (c.name, c.estimate, c.figure)
    llama = by_name["Llama 3 405B"]
    assert llama.estimate > 0.90  # the paper says "higher than 90%"
    assert 1 / llama.failures.rate / HOUR == pytest.approx(54 * 24 / 419)
    assert stall_for(0.90, llama.failures) / 60 == pytest.approx(18.6, abs=0.05)


ARGS = ["plan", "--model", "7b", "--nodes", "4", "--gpus-per-node", "8", "--inter-node-bandwidth", "10Gbit/s"]


def test_plan_prints_each_layouts_goodput(capsys: pytest.CaptureFixture) -> None:
    assert main([*ARGS, "--node-mtbf", "100h", "--rejoin-time", "5min", "--diloco-every", "20"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "a node failing every 100 min" not in text and "with a node failing every 100.0 h" in text
    assert "(4 nodes: one failure every 25.0 h); restart 10 min" in text and "rejoin 5 min" in text
    assert "On the recommended" in text and "with elastic replicas" in text
    assert main([*ARGS, "--node-mtbf", "100h", "--diloco-every", "20", "--json", "-"]) == 0
    rows = json.loads(capsys.readouterr().out)["goodput"]["layouts"]
    by_shard = {r["shard"]: r for r in rows}
    assert by_shard[32]["elastic_replicas"] is None  # one replica: nobody to go on without it
    assert by_shard[8]["replicas_down_per_node_failure"] == 1 and by_shard[2]["replicas_down_per_node_failure"] == 4
    restart = by_shard[8]["checkpoint_restart"]
    assert all(r["checkpoint_restart"] == restart for r in rows)  # the whole job restarts, whatever the layout
    assert restart < by_shard[8]["elastic_replicas"] < 1 and restart < by_shard[8]["elastic_diloco"] < 1


def test_plan_refuses_recovery_flags_without_a_failure_rate(capsys: pytest.CaptureFixture) -> None:
    assert main([*ARGS, "--checkpoint-every", "30min"]) == 2
    assert "--checkpoint-every is read only with --node-mtbf DURATION" in capsys.readouterr().err
    assert main([*ARGS, "--node-mtbf", "100"]) == 2
    assert "use one of d, h, min" in capsys.readouterr().err
