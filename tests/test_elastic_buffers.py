"""Elastic replicas keep their buffers in sync: BatchNorm running statistics, a joiner's included.

``hsdp launch --elastic --nodes 2 --nproc-per-node 2`` of ``tests/programs/elastic_bn_worker.py``: two replicas
of two ranks train a BatchNorm model, each replica on batches of its own scale and shift (its forward's running
statistics differ from the other's). Replica 1 is SIGKILLed in backward at step 4 of its first incarnation;
torchrun restarts it and it rejoins healed from replica 0. Checked:

- after every committed step, every member's ranks hold the same buffers, bit for bit (DDP's rule: broadcast from
  the lowest-numbered live replica once per step), including the joiner's first steps;
- the joiner's buffers right after its heal are the live replica's (not its own fresh ones: it has counted the
  live replica's batches);
- ``check_replicas`` passes at the end, and names ``bn.running_mean`` once one rank of replica 1 changed it;
- the inter-node hop is int8 with error feedback: a discarded step leaves every rank's residuals as they were
  before it, committed steps move them, and the joiner starts from zero residuals.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from launched import run_launch, why_failed

from hsdp.tools.launch.netns import find_tools

PROGRAM = Path(__file__).parent / "programs" / "elastic_bn_worker.py"
REPLICAS, RANKS, VICTIM, FAULT_STEP = 2, 2, 1, 4


def _logs(out: Path) -> dict[tuple[int, int], list[list[dict]]]:
    """(replica, rank) -> each incarnation's log lines, in start order."""
    logs: dict[tuple[int, int], list[list[dict]]] = {}
    for path in sorted(out.glob("r*_s*_i*.jsonl"), key=os.path.getmtime):
        replica, rank = int(path.name[1]), int(path.name.split("_s")[1].split("_")[0])
        logs.setdefault((replica, rank), []).append([json.loads(line) for line in path.read_text().splitlines()])
    return logs


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[int, int], list[list[dict]]]:
    """The one launch's logs, per (replica, rank) and incarnation."""
    out = tmp_path_factory.mktemp("elastic_bn")
    emulate = "--require-emulation" if os.geteuid() == 0 and find_tools() is not None else "--no-emulation"
    flags = ["--elastic", "--nodes", str(REPLICAS), "--nproc-per-node", str(RANKS), "--max-restarts", "1",
             "--min-replicas", "1", "--heartbeat-timeout", "4", emulate]
    env = {"OMP_NUM_THREADS": "1", "ELASTIC_OUT": str(out), "ELASTIC_VICTIM": str(VICTIM),
           "ELASTIC_FAULT_STEP": str(FAULT_STEP)}
    code, output, left = run_launch(flags, [str(PROGRAM)], env, 240)
    assert code == 0 and left == [], why_failed(output)
    found = _logs(out)
    assert len(found[(VICTIM, 0)]) == 2, "the victim did not rejoin"
    return found


def test_buffers_are_equal_on_every_member_after_every_committed_step_the_joiners_too(
        logs: dict[tuple[int, int], list[list[dict]]]) -> None:
    by_step: dict[int, dict[tuple[int, int], dict]] = {}
    for (replica, rank), incarnations in logs.items():
        for record in (r for lines in incarnations for r in lines if "step" in r):
            by_step.setdefault(record["step"], {})[(replica, rank)] = record
    committed = 0
    for step, records in sorted(by_step.items()):
        members = next(r["replicas"] for r in records.values())
        if not next(r["committed"] for r in records.values()):
            continue
        committed += 1
        present = [records[(m, s)]["buffers"] for m in members for s in range(RANKS) if (m, s) in records]
        assert len(present) == len(members) * RANKS, (step, sorted(records))
        assert all(b == present[0] for b in present), (step, present)
    assert committed >= FAULT_STEP + 2
    healed = logs[(VICTIM, 0)][1][0]
    source = next(r for r in logs[(0, 0)][0] if r.get("step") == healed["joined"] - 1)
    # The heal carried the live replica's buffers (as they were at the heal: after step joined - 1, or after the
    # forward of step joined where the members healed in that step's backward), not the joiner's fresh ones.
    tracked = source["buffers"]["bn.num_batches_tracked"][0]
    assert healed["buffers"]["bn.num_batches_tracked"][0] in (tracked, tracked + 1), (healed, source)
    assert any(v != 0.0 for v in healed["buffers"]["bn.running_mean"]), healed
    for incarnations in logs.values():
        done = incarnations[-1][-1]
        assert "1 buffer(s) differ across" in done["changed_buffer_check"], done
        assert "bn.running_mean" in done["changed_buffer_check"], done


def test_an_int8_hop_discarded_step_keeps_the_residuals_and_joiners_start_from_zero(
        logs: dict[tuple[int, int], list[list[dict]]]) -> None:
    """Error feedback as a transaction (``runtime/hop_transaction.py``): a discarded step leaves every rank's
    residuals bit for bit as they were before its forward, while committed steps of two replicas move them; a
    joiner starts from none. (The replicas stay identical: the worker's ``check_replicas`` passed.)"""
    discarded, moved = 0, 0
    for incarnations in logs.values():
        for record in (r for lines in incarnations for r in lines if "step" in r):
            if not record["committed"]:
                discarded += 1
                assert record["residuals"] == record["residuals_before"], record
            elif len(record["replicas"]) == REPLICAS:
                moved += record["residuals"]["digest"] != record["residuals_before"]["digest"]
    assert discarded >= 1 and moved >= FAULT_STEP, (discarded, moved)
    healed = logs[(VICTIM, 0)][1][0]
    assert healed["residuals"]["norm"] == 0.0, healed
    first = next(r for r in logs[(VICTIM, 0)][1] if "step" in r)
    assert first["residuals_before"]["norm"] == 0.0, first  # still none at its first forward
