"""The benchmarks that run torchft next to hsdp, their parts without a launch: ``elastic_recovery.py``'s figures
and table on made-up step logs (both systems' ranks write the same records, and a run of several minutes per
system would lose its numbers to a crash here), ``diloco_slow_links.py``'s fragments and torchft's limits."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import diloco_slow_links as diloco  # noqa: E402
import elastic_recovery as bench  # noqa: E402

KILL_T, RECOVERY_S, REJOIN_S = 5.0, 3.0, 10.0


def _record(t: float, step: int, committed: bool, replicas: list[int], restart: int = 0) -> dict:
    return {"t": t, "step": step, "committed": committed, "replicas": replicas, "restart": restart}


def _clean() -> dict:
    records = {q: [_record(0.1 * s, s, True, [0, 1, 2]) for s in range(200)] for q in range(3)}
    return {"records": records, "kills": [], "t0": 0.0, "window": 20.0, "emulated": True}


def _faulty() -> dict:
    """Replica 0 killed at 5 s: the step in flight fails, the survivors commit alone from 8 s, replica 0 (its
    torchrun restart 1) commits again from 15 s."""
    records: dict[int, list[dict]] = {0: [], 1: [], 2: []}
    step = 0
    for i in range(200):
        t = 0.1 * i
        if t < KILL_T:
            members, committed = [0, 1, 2], True
        elif t < KILL_T + RECOVERY_S:
            members, committed = [0, 1, 2], False
        elif t < KILL_T + REJOIN_S:
            members, committed = [1, 2], True
        else:
            members, committed = [0, 1, 2], True
        for q in members if t < KILL_T or t >= KILL_T + REJOIN_S else (1, 2):
            records[q].append(_record(t, step, committed, members, restart=int(q == 0 and t >= KILL_T)))
        step += committed
    kills = [{"t": KILL_T, "victim": 0, "ranks_killed": 2}]
    return {"records": records, "kills": kills, "t0": 0.0, "window": 20.0, "emulated": True}


def test_measure_recovery_rejoin_and_ratio():
    m = bench.measure(_clean(), _faulty())
    assert m["recovery_s"] == [pytest.approx(RECOVERY_S, abs=0.11)]
    assert m["rejoin_s"] == [pytest.approx(REJOIN_S, abs=0.11)]
    assert m["committed_steps"]["clean"] == 200
    assert m["committed_steps"]["faulty"] == 200 - 30  # the 3 s without a committed step
    assert m["committed_ratio"] == pytest.approx(170 / 200)
    assert (m["kills"], m["ranks_killed"], m["victims"]) == (1, [2], [0])


def test_the_rejoin_part_by_part():
    """The restarted incarnation's start-up records split the kill -> first committed step into its parts."""
    run = _faulty()
    phases = {"started": KILL_T + 1, "imported": KILL_T + 4, "mesh": KILL_T + 5, "model": KILL_T + 5.5,
              "admitted": KILL_T + 9}
    run["records"][0].insert(50, {"phases": phases, "restart": 1})  # written before its first step record
    parts = bench.measure(_clean(), run)["rejoin_parts_median_s"]
    assert parts == {"restart": 1.0, "imports": 3.0, "mesh and admission wait": 1.0, "model": 0.5,
                     "optimizer and heal": 3.5, "first committed step": pytest.approx(1.0, abs=0.11)}
    assert sum(parts.values()) == pytest.approx(REJOIN_S, abs=0.11)
    assert bench.measure(_clean(), _faulty())["rejoin_parts_median_s"] == {}  # torchft's job logs no phases


def test_table_has_a_column_per_system(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "RESULTS", tmp_path)
    hsdp, torchft = bench.measure(_clean(), _faulty()), bench.measure(_clean(), _clean() | {"kills": []})
    result = {"date": "2026-12-04", "preset": "tiny", "nodes": 3, "nproc_per_node": 2, "minutes": 1.0,
              "kill_every_s": 30.0, "margin_s": 20.0, "bandwidth": "1gbit", "max_restarts": 20, "emulated": True,
              "node_cpus": "0.6", "timeouts_s": bench.torchft_side.timeouts(), "torchft_version": "0.2.0",
              "systems": {"hsdp": hsdp, "torchft": torchft}, "command": "CMD", "launch": "LAUNCH"}
    bench._write(result, "t")
    table = (tmp_path / "elastic_recovery_2026-12-04_t.md").read_text()
    assert "| | hsdp | torchft |" in table
    assert "| ratio (target >= 0.90) | 0.850 | 1.000 |" in table
    assert "| recovery: kill -> survivors' first committed step without it, median (s) | 3.0 | None |" in table
    assert "heartbeat 0.25 s, timeout 3 s" in table
    assert (tmp_path / "elastic_recovery_2026-12-04_t.json").exists()


def test_torchft_fragments_partition_the_model_like_hsdp():
    from hsdp.models.gpt import GPT, preset

    model = GPT(preset("tiny"))
    fragments = diloco.torchft_side._fragments(model, 3)
    owned = [id(p) for f in fragments for p in f.parameters()]
    assert sorted(owned) == sorted(id(p) for p in model.parameters())  # each once, the tied matrix too
    assert model.tok_emb.weight in set(fragments[0].parameters())  # the root unit first, as hsdp orders them
    # 5 units (the root, 20.6k parameters, and 4 blocks of 50k): cuts nearest thirds of 220.5k
    assert [sum(p.numel() for p in f.parameters()) for f in fragments] == [70592, 99968, 49984]


def test_torchft_streaming_limits():
    assert diloco.torchft_streaming_problem(40, 4, 2) is None
    assert "multiple of F" in diloco.torchft_streaming_problem(10, 4, 2)
    assert "tau (2) < H / F (2)" in diloco.torchft_streaming_problem(8, 4, 2)
