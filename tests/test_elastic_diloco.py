"""DiLoCo on an elastic mesh: a sync is a transaction over the replicas present at it.

``hsdp launch --elastic --nodes 3 --nproc-per-node 2`` (``tests/programs/elastic_diloco_worker.py``): inner AdamW,
a sync every 3 inner steps through an outer Nesterov SGD. Replica 2 is SIGKILLed mid-phase (in the backward of
inner step 4); once it is back, replica 1 is SIGKILLed at a sync, just before its pseudo-gradient all-reduce;
torchrun restarts each (no checkpoint). Checked:

- the survivors do not wait for a restart: their sync after the mid-phase kill lands within 10 s of it (the
  coordinator's heartbeat timeout is 4 s), and that sync is theirs alone unless the restart was already there;
- the sync whose all-reduce failed is redone among the survivors, at the same boundary: no phase is lost (a sync
  lands after every third inner step on every survivor);
- each restarted replica enters at a sync boundary, healed (its first inner step's loss is the new global copy's);
- every rank's loss at every inner step and the final parameters equal a one-process simulation (1e-5): each
  replica's inner steps from the global copy, the pseudo-gradients of each sync's members averaged (a replica
  that joined at that sync weighs nothing), the outer step; a joiner restarts from the global copy with the inner
  optimizer state of the lowest-numbered live member;
- ``check_replicas`` (the global copy) passes on every member at the end; the launch exits 0, nothing left behind.

The same scenario on replicas of different shard degrees (``--nproc-per-node 2,1,1``, the mid-phase fault only):
the block at the end of this file.
"""

from __future__ import annotations

import copy
import json
import os
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from launched import run_launch
from models import ParityNet, batch, loss_fn

import hsdp
from hsdp.engine.hops import NoHop
from hsdp.engine.replica_sync import check_replica_sync

PROGRAM = Path(__file__).parent / "programs" / "elastic_diloco_worker.py"
REPLICAS, RANKS, EVERY, MID_PHASE_STEP = 3, 2, 3, 4
HEARTBEAT_TIMEOUT_S = 4
RUN_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("elastic_diloco")
    flags = ["--elastic", "--nodes", str(REPLICAS), "--nproc-per-node", str(RANKS), "--max-restarts", "1",
             "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT_S), "--no-emulation"]
    code, output, left = run_launch(flags, [str(PROGRAM)], {"OMP_NUM_THREADS": "1", "ELASTIC_OUT": str(out)},
                                    RUN_TIMEOUT_S)
    assert code == 0, output[-6000:]
    assert left == [], f"processes left behind: {left}"
    return out, output


def _logs(out: Path) -> dict[tuple[int, int], list[list[dict]]]:
    """(replica, rank) -> each incarnation's log lines, in start order."""
    logs: dict[tuple[int, int], list[list[dict]]] = {}
    for path in sorted(out.glob("r*_s*_i*.jsonl"), key=os.path.getmtime):
        replica, rank = int(path.name[1]), int(path.name.split("_s")[1].split("_")[0])
        logs.setdefault((replica, rank), []).append([json.loads(line) for line in path.read_text().splitlines()])
    return logs


def test_diloco_on_an_elastic_mesh_replays_exactly_the_syncs_members(run: tuple[Path, str]) -> None:
    out, output = run
    for victim in (1, 2):
        assert re.search(rf"\[coordinator\] .*replica {victim} left", output), output[-6000:]
        assert re.search(rf"\[coordinator\] .*replica {victim} rejoined \(incarnation 2, healed from replica 0\)",
                         output), output[-6000:]
    assert len(re.findall(r"\[coordinator\] .*step \d+ discarded", output)) == 1, output[-6000:]  # the failed sync
    logs = _logs(out)
    survivor = [r for r in logs[(0, 0)][0] if "step" in r]
    syncs = {r["step"]: r["replicas"] for r in survivor if r["synced"]}
    # No phase is lost: a sync landed after every EVERY-th inner step, and only then.
    assert sorted(syncs) == list(range(EVERY - 1, survivor[-1]["step"] + 1, EVERY))
    mid_phase = next(r["t"] for r in logs[(2, 0)][0] if "fault" in r)
    first_after = next(r for r in survivor if r["synced"] and r["step"] > MID_PHASE_STEP)
    assert first_after["t"] - mid_phase < 10, (first_after, mid_phase)  # the survivors did not wait for the restart
    # The mid-sync fault: replica 1 died in the sync after its last logged step, which the survivors redid alone.
    died = [r for r in logs[(1, 0)][0] if "step" in r][-1]["step"] + 1  # the inner step whose sync it died in
    assert any("fault" in r and r["fault"] == "mid-sync" for r in logs[(1, 0)][0])
    assert syncs[died] == [0, 2], (died, syncs)
    joined = {}
    for victim in (1, 2):
        for rank in range(RANKS):
            entry = logs[(victim, rank)][1][0]
            assert entry["joined"] % EVERY == 0 and victim in syncs[entry["joined"] - 1], entry  # at a boundary
            joined[victim, entry["joined"]] = True
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: with 2 threads on a loaded 2-core machine the replay takes 30x longer
    try:
        params, losses = _simulate(syncs, joined)
    finally:
        torch.set_num_threads(threads)
    for (replica, rank), incarnations in logs.items():
        for record in (r for lines in incarnations for r in lines if "step" in r):
            assert record["loss"] == pytest.approx(losses[(record["step"], replica, rank)], abs=1e-5), \
                (replica, rank, record["step"])
        saved = torch.load(out / f"params_r{replica}_s{rank}.pt")
        for name, value in params.items():
            torch.testing.assert_close(saved[name], value, rtol=1e-5, atol=1e-5, msg=f"{replica}/{rank} {name}")


def _simulate(syncs: dict[int, list[int]], joined: dict[tuple[int, int], bool],
              nproc: tuple[int, ...] = (RANKS,) * REPLICAS, by_ranks: bool = False
              ) -> tuple[dict[str, torch.Tensor], dict[tuple[int, int, int], float]]:
    """One process: DiLoCo's replicas as the logs say they met. Between syncs every replica alive at the phase's
    start takes its inner steps from the global copy (each on its ranks' batches concatenated, ``nproc[r]`` ranks);
    at a sync the members that trained the phase (not a replica joining there) average their pseudo-gradients
    (``by_ranks``: weighted by their rank counts, what a sync must not do) and the outer optimizer steps the
    global copy, which every member then holds; a joiner takes the inner optimizer state of the lowest-numbered
    member that trained. The losses each rank saw, and the final global copy."""
    torch.manual_seed(0)  # the first sync's heal made every replica replica 0
    global_model = ParityNet()
    params = [p for p in global_model.parameters() if p.requires_grad]
    outer = torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)
    local = {r: copy.deepcopy(global_model) for r in range(REPLICAS)}
    inner = {r: torch.optim.AdamW(local[r].parameters(), lr=1e-2) for r in range(REPLICAS)}
    alive = set(range(REPLICAS))
    losses: dict[tuple[int, int, int], float] = {}
    for end in sorted(syncs):
        for r in sorted(alive):
            for k in range(end - EVERY + 1, end + 1):
                parts = [batch(k, REPLICAS * r + s) for s in range(nproc[r])]
                with torch.no_grad():
                    for s, (x, y) in enumerate(parts):
                        losses[(k, r, s)] = loss_fn(local[r](x), y).item()
                loss_fn(local[r](torch.cat([x for x, _ in parts])), torch.cat([y for _, y in parts])).backward()
                inner[r].step()
                inner[r].zero_grad()
        members = syncs[end]
        joiners = [r for r in members if (r, end + 1) in joined]
        trained = [r for r in members if r not in joiners]
        shares = [nproc[r] if by_ranks else 1 for r in trained]
        for i, p in enumerate(params):
            deltas = [w * (p.detach() - list(q for q in local[r].parameters() if q.requires_grad)[i].detach())
                      for w, r in zip(shares, trained, strict=True)]
            p.grad = torch.stack(deltas).sum(0) / sum(shares)
        outer.step()
        outer.zero_grad()
        for r in joiners:
            source = min(trained)
            inner[r].load_state_dict(copy.deepcopy(inner[source].state_dict()))
        for r in members:
            local[r].load_state_dict(global_model.state_dict())
        alive = set(members)
    return {n: p.detach().clone() for n, p in global_model.named_parameters()}, losses


# -- Replicas of different shard degrees: 2, 1 and 1 ranks ------------------------------------------------------
# ``--nproc-per-node 2,1,1`` (4 processes), replica 2's mid-phase fault only (``ELASTIC_MID_SYNC=0``): each sync's
# pseudo-gradients are averaged piece by piece over the quorum's degrees, and the killed 1-rank replica 2 is healed
# from the 2-rank replica 0 (so is every 1-rank replica at the first quorum): its global copy, outer momentum and
# inner AdamW state re-cut across degrees on the way. Each replica's pseudo-gradient counts once, as on a fixed
# mesh of different degrees; a replay weighting them by rank count is checked to differ.
HETERO = (2, 1, 1)


@pytest.fixture(scope="module")
def hetero_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("elastic_diloco_hetero")
    return out, _launch(out, HETERO, {"ELASTIC_MID_SYNC": "0"})


def test_diloco_on_elastic_replicas_of_2_1_1_ranks_heals_across_degrees_and_replays_exactly(
        hetero_run: tuple[Path, str]) -> None:
    out, output = hetero_run
    assert re.search(r"\[coordinator\] .*replica 2 left", output), output[-6000:]
    assert re.search(r"\[coordinator\] .*replica 2 rejoined \(incarnation 2, healed from replica 0\)", output), \
        output[-6000:]
    logs = _logs(out)
    assert sorted(logs) == [(0, 0), (0, 1), (1, 0), (2, 0)] and len(logs[(2, 0)]) == 2  # 2, 1, 1 ranks; one restart
    survivor = [r for r in logs[(0, 0)][0] if "step" in r]
    syncs = {r["step"]: r["replicas"] for r in survivor if r["synced"]}
    assert sorted(syncs) == list(range(EVERY - 1, survivor[-1]["step"] + 1, EVERY))  # no phase lost
    mid_phase = next(r["t"] for r in logs[(2, 0)][0] if "fault" in r)
    first_after = next(r for r in survivor if r["synced"] and r["step"] > MID_PHASE_STEP)
    assert first_after["t"] - mid_phase < 10, (first_after, mid_phase)  # the survivors did not wait
    assert [0, 1] in syncs.values(), syncs  # a sync of the survivors alone (2 ranks + 1 rank)
    entry = logs[(2, 0)][1][0]
    assert entry["joined"] % EVERY == 0 and syncs[entry["joined"] - 1] == [0, 1, 2], entry  # at a boundary
    joined = {(2, entry["joined"]): True}
    params, losses = _replay(syncs, joined, HETERO)
    _check_replay(out, logs, params, losses)
    by_ranks, _ = _replay(syncs, joined, HETERO, by_ranks=True)
    assert max((params[n] - by_ranks[n]).abs().max().item() for n in params) > 1e-3  # 0.1 measured


def test_diloco_on_elastic_replicas_of_different_degrees_is_accepted_but_not_its_int8_wire() -> None:
    mesh = SimpleNamespace(elastic=object(), heterogeneous=True)  # what check_replica_sync reads of the mesh
    assert isinstance(check_replica_sync(hsdp.DiLoCo(every=3), None, False, mesh), NoHop)
    assert isinstance(check_replica_sync(hsdp.DiLoCo(every=3, wire_dtype=torch.bfloat16), None, False, mesh), NoHop)
    with pytest.raises(ValueError, match=r"wire_dtype=torch.int8\) on an elastic job of replicas of different "
                                         r"shard degrees is not supported yet: use wire_dtype=torch.bfloat16"):
        check_replica_sync(hsdp.DiLoCo(every=3, wire_dtype=torch.int8), None, False, mesh)
    homogeneous = SimpleNamespace(elastic=object(), heterogeneous=False)
    assert isinstance(check_replica_sync(hsdp.DiLoCo(every=3, wire_dtype=torch.int8), None, False, homogeneous),
                      NoHop)


def _launch(out: Path, nproc: tuple[int, ...], env: dict[str, str]) -> str:
    """The elastic DiLoCo launch of replicas of ``nproc`` ranks, checked to end well; its output."""
    flags = ["--elastic", "--nodes", str(len(nproc)), "--nproc-per-node", ",".join(map(str, nproc)),
             "--max-restarts", "1", "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT_S), "--no-emulation"]
    code, output, left = run_launch(flags, [str(PROGRAM)], {"OMP_NUM_THREADS": "1", "ELASTIC_OUT": str(out), **env},
                                    RUN_TIMEOUT_S)
    assert code == 0, output[-6000:]
    assert left == [], f"processes left behind: {left}"
    return output


def _replay(syncs: dict[int, list[int]], joined: dict[tuple[int, int], bool], nproc: tuple[int, ...],
            by_ranks: bool = False) -> tuple[dict[str, torch.Tensor], dict[tuple[int, int, int], float]]:
    """:func:`_simulate` on one thread (tiny ops: two threads on a loaded 2-core machine take far longer)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _simulate(syncs, joined, nproc, by_ranks)
    finally:
        torch.set_num_threads(threads)


def _check_replay(out: Path, logs: dict[tuple[int, int], list[list[dict]]], params: dict[str, torch.Tensor],
                  losses: dict[tuple[int, int, int], float]) -> None:
    """Every rank's loss at every inner step, and its saved parameters, equal the replay's (1e-5)."""
    for (replica, rank), incarnations in logs.items():
        for record in (r for lines in incarnations for r in lines if "step" in r):
            assert record["loss"] == pytest.approx(losses[(record["step"], replica, rank)], abs=1e-5), \
                (replica, rank, record["step"])
        saved = torch.load(out / f"params_r{replica}_s{rank}.pt")
        for name, value in params.items():
            torch.testing.assert_close(saved[name], value, rtol=1e-5, atol=1e-5, msg=f"{replica}/{rank} {name}")
