"""DiLoCo on an elastic mesh: each fragment's sync is a transaction over the replicas present at it.

``hsdp launch --elastic --nodes 3`` (``tests/programs/elastic_diloco_worker.py``): inner AdamW, each fragment
synced every 3 inner steps through an outer Nesterov SGD, in three cases: whole-model DiLoCo on replicas of 2
ranks, and Streaming DiLoCo (two fragments, delay 1: a sync starts after one inner step and lands after the next;
one step both lands fragment 1 and starts fragment 0) on replicas of 2, 1 and 1 ranks (``--nproc-per-node 2,1,1``:
shard degrees that differ), in fp32 and with the int8 wire (error feedback: replayed in fp32 to 5e-3, and checked
to differ from it; the mid-phase fault only: fewer restarts on 2 cores). Replica 2 is SIGKILLed mid-phase (in the
backward of a step with no sync in flight); once it is back, replica 1 is SIGKILLed at a sync's start, just before
its pseudo-gradient all-reduce; torchrun restarts each (no checkpoint). Checked, in each case:

- the survivors do not wait for a restart: their sync after the mid-phase kill lands within 10 s of it (the
  coordinator's heartbeat timeout is 4 s), and that sync is theirs alone unless the restart was already there;
- the sync whose all-reduce failed is redone among the survivors (with a delay, where it was to land): no phase is
  lost (each fragment's sync lands after the same inner steps on every survivor, the one step discarded);
- each restarted replica enters at a sync boundary (a fragment's start, or the survivors' redo of a landing),
  healed, and takes part in that sync's landing;
- every rank's loss at every inner step and the final parameters equal a one-process simulation (1e-5): each
  replica's inner steps, at each fragment's sync start its pseudo-gradient and weight (the inner steps since the
  fragment's last sync, or since it was healed: 0 in the sync it enters), at the landing the weighted average
  over the sync's committed members and the outer step of that fragment, which every member then holds; a joiner
  takes the global copy as its weights and the inner optimizer state of the lowest-numbered member that trained
  (a replay taking that member's weights instead is checked to differ);
- ``check_replicas`` (the global copy) passes on every member at the end; the launch exits 0, nothing left behind;
- ``opt.sync_replicas()`` then leaves every rank the same weights, and the checkpoint one replica saves alone after
  it (the others gone; replica 1 in the fp32 streaming case) holds them, its inner optimizer state where a load on
  another replica count reads it, and its int8-wire residuals;
- on degrees 2, 1, 1: each sync's pseudo-gradients are averaged piece by piece over the quorum's degrees, and the
  killed 1-rank replica 2 is healed from the 2-rank replica 0 (so is every 1-rank replica at the first quorum): its
  global copy, outer momentum and inner AdamW state re-cut across degrees on the way. Each replica's
  pseudo-gradient counts once (its inner steps), as on a fixed mesh of different degrees; a replay weighting
  replicas by their rank counts is checked to differ.

And in one process, the transactions stubbed: where a joiner enters the members' syncs of an inner step (a redo
of a landing, then a start; a live replica healed in its own vote; an elastic job's start).
"""

from __future__ import annotations

import copy
import io
import json
import os
import re
from pathlib import Path

import pytest
import torch
from launched import run_launch, why_failed
from models import ParityNet, batch, loss_fn

import hsdp
from hsdp.checkpoint.dcp_io import read_metadata_file
from hsdp.checkpoint.export import read_weights
from hsdp.engine.optim.outer_pending import PendingSync
from hsdp.engine.optim.outer_plan import START, SyncPlan
from hsdp.engine.optim.outer_step import OuterState, SyncStep

PROGRAM = Path(__file__).parent / "programs" / "elastic_diloco_worker.py"
REPLICAS, EVERY = 3, 3
# Per case: the worker's SYNCS key (fragments, delay, the mid-phase step), the ranks of each replica (2, 1, 1:
# different shard degrees), whether replica 1 dies mid-sync too (not with the int8 wire: fewer restarts on 2 cores),
# and the wire (int8: error feedback, replayed in fp32).
CASES = {"whole": ("whole", (2, 2, 2), True, "fp32"), "streaming-2-1-1": ("streaming", (2, 1, 1), True, "fp32"),
         "streaming-2-1-1-int8": ("streaming", (2, 1, 1), False, "int8")}
# The int8 wire against the fp32 replay: error feedback keeps the weights within about one rounding step of it
# (a pseudo-gradient block's max / 127); farther, residuals went astray (a quorum of other degrees regroups them).
INT8_BOUND = 5e-3
SYNCS = {"whole": (1, 0, 4), "streaming": (2, 1, 5)}
HEARTBEAT_TIMEOUT_S = 4
RUN_TIMEOUT_S = 300


@pytest.fixture(scope="module", params=list(CASES))
def run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, str]:
    case = request.param
    out = tmp_path_factory.mktemp(f"elastic_diloco_{case}")
    sync, nproc, mid_sync, wire = CASES[case]
    flags = ["--elastic", "--nodes", str(REPLICAS), "--nproc-per-node", ",".join(map(str, nproc)), "--max-restarts",
             "1", "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT_S), "--no-emulation"]
    env = {"OMP_NUM_THREADS": "1", "ELASTIC_OUT": str(out), "ELASTIC_SYNC": sync,
           "ELASTIC_MID_SYNC": "1" if mid_sync else "0", "ELASTIC_WIRE": wire, "ELASTIC_WRITER": str(_writer(case))}
    code, output, left = run_launch(flags, [str(PROGRAM)], env, RUN_TIMEOUT_S)
    assert code == 0, why_failed(output)
    assert left == [], f"processes left behind: {left}"
    return case, out, output


def _writer(case: str) -> int:
    """The replica that checkpoints at the end: replica 1 in one case (a writer other than replica 0, as after
    replica 0 left an elastic job), replica 0 elsewhere."""
    return 1 if case == "streaming-2-1-1" else 0


def _logs(out: Path) -> dict[tuple[int, int], list[list[dict]]]:
    """(replica, rank) -> each incarnation's log lines, in start order."""
    logs: dict[tuple[int, int], list[list[dict]]] = {}
    for path in sorted(out.glob("r*_s*_i*.jsonl"), key=os.path.getmtime):
        replica, rank = int(path.name[1]), int(path.name.split("_s")[1].split("_")[0])
        logs.setdefault((replica, rank), []).append([json.loads(line) for line in path.read_text().splitlines()])
    return logs


def test_diloco_on_an_elastic_mesh_replays_exactly_the_syncs_members(run: tuple[str, Path, str]) -> None:
    case, out, output = run
    sync, nproc, mid_sync, wire = CASES[case]
    fragments, delay, mid_phase_step = SYNCS[sync]
    policy = hsdp.DiLoCo(every=EVERY, fragments=fragments, delay=delay)
    offsets = {policy.offset(f): f for f in range(fragments)}  # phase -> the fragment whose sync starts there
    victims = (1, 2) if mid_sync else (2,)
    for victim in victims:
        assert re.search(rf"\[coordinator\] .*replica {victim} left", output), output[-6000:]
        assert re.search(rf"\[coordinator\] .*replica {victim} rejoined \(incarnation 2, healed from replica 0\)",
                         output), output[-6000:]
    if mid_sync:  # the failed sync
        assert len(re.findall(r"\[coordinator\] .*step \d+ discarded", output)) == 1, output[-6000:]
    logs = _logs(out)
    assert sorted(logs) == [(r, s) for r in range(REPLICAS) for s in range(nproc[r])]
    survivor = [r for r in logs[(0, 0)][0] if "step" in r]
    syncs = {r["step"]: r["replicas"] for r in survivor if r["landed"]}
    # No phase is lost: each fragment's sync started after every inner step reaching its offset, and landed
    # `delay` steps later, and only then.
    starts = [k for k in range(survivor[-1]["step"] + 1) if (k + 1) % EVERY in offsets]
    assert {r["step"]: r["started"] for r in survivor if r["started"]} == \
        {k: [offsets[(k + 1) % EVERY]] for k in starts}
    assert {r["step"]: r["landed"] for r in survivor if r["landed"]} == \
        {k + delay: [offsets[(k + 1) % EVERY]] for k in starts if k + delay <= survivor[-1]["step"]}
    # Replica 1 reached one sync's start late (the worker's LATE_S): the others waited for it there, it did not.
    late = next(r for r in logs[(1, 0)][0] if "late" in r)
    waited = {rep: next(r["waited"] for r in logs[(rep, 0)][0] if r.get("step") == late["late"]) for rep in (0, 1, 2)}
    assert min(waited[0], waited[2]) > late["seconds"] / 2 > waited[1], (late, waited)
    mid_phase = next(r["t"] for r in logs[(2, 0)][0] if "fault" in r)
    first_after = next(r for r in survivor if r["landed"] and r["step"] > mid_phase_step)
    assert first_after["t"] - mid_phase < 10, (first_after, mid_phase)  # the survivors did not wait for the restart
    if mid_sync:  # replica 1 died starting a sync after its last logged step; the survivors redid it alone
        died = [r for r in logs[(1, 0)][0] if "step" in r][-1]["step"] + 1  # the inner step whose sync it died in
        assert any("fault" in r and r["fault"] == "mid-sync" for r in logs[(1, 0)][0])
        assert syncs[died + delay] == [0, 2], (died, syncs)
    else:
        assert [0, 1] in syncs.values(), syncs  # a sync of the survivors alone (on 2, 1, 1: 2 ranks + 1 rank)
    entered = {}  # victim -> (the inner step it was healed after, the step the sync it entered landed)
    for victim in victims:
        assert len(logs[(victim, 0)]) == 2  # one restart
        for rank in range(nproc[victim]):
            k = logs[(victim, rank)][1][0]["joined"] - 1
            # At a sync boundary: a fragment's start (landing `delay` steps on), or the survivors' redo of a landing.
            land = k if victim in syncs.get(k, []) else k + delay
            assert (k + 1) % EVERY in offsets or k in syncs, (victim, k)
            assert victim in syncs[land], (victim, k, syncs)
            entered[victim] = (k, land)
    params, losses = _replay(policy, nproc, logs, syncs, entered)
    tolerance = 1e-5 if wire == "fp32" else INT8_BOUND
    distance = 0.0
    for (replica, rank), incarnations in logs.items():
        for record in (r for lines in incarnations for r in lines if "step" in r):
            assert record["loss"] == pytest.approx(losses[(record["step"], replica, rank)], abs=tolerance), \
                (replica, rank, record["step"])
        saved = torch.load(out / f"params_r{replica}_s{rank}.pt")
        for name, value in params[replica].items():
            torch.testing.assert_close(saved[name], value, rtol=tolerance, atol=tolerance,
                                       msg=f"{replica}/{rank} {name}")
            distance = max(distance, (saved[name] - value).abs().max().item())
    if wire == "int8":  # the wire was int8 (not the fp32 replay exactly), and the replicas agree bitwise (the worker
        assert distance > 1e-6, distance  # checked them): every member applied the same dequantised average
    if len(set(nproc)) > 1:  # the degrees mattered: a replay weighting replicas by rank count fails (0.1 measured)
        by_ranks, _ = _replay(policy, nproc, logs, syncs, entered, by_ranks=True)
        assert max((params[0][n] - by_ranks[0][n]).abs().max().item() for n in params[0]) > 1e-3
    if case == "streaming-2-1-1":  # the joiner's weights mattered: a replay healing it with its source's weights fails
        from_source, _ = _replay(policy, nproc, logs, syncs, entered, from_source=True)
        assert max((params[0][n] - from_source[0][n]).abs().max().item() for n in params[0]) > 1e-4


def test_the_closing_sync_leaves_every_replica_the_global_copy_and_the_writer_checkpoints_it(
        run: tuple[str, Path, str]) -> None:
    """``opt.sync_replicas()`` after the last step (as ``hsdp train`` ends): every rank of every replica leaves with
    the same weights, which moved where inner steps were not synced yet, and one replica alone then checkpoints
    with no step of the job open and the others gone: the checkpoint's model is that global copy, and with the int8
    wire it keeps that replica's residuals (their layout is the last sync's pieces: reading the current step's
    would wait for a quorum that never comes)."""
    case, out, _ = run
    wire = CASES[case][3]
    finals = {path.name: torch.load(path) for path in sorted(out.glob("final_r*_s*.pt"))}
    assert len(finals) == sum(CASES[case][1])
    reference = finals["final_r0_s0.pt"]
    for name, final in finals.items():
        for key, value in final.items():
            assert torch.equal(value, reference[key]), (name, key)
    before = torch.load(out / "params_r0_s0.pt")
    moved = max((reference[k] - before[k]).abs().max().item() for k in before)
    # Whole-model DiLoCo stops right after its sync (nothing trained since: the sync only adopts the global copy,
    # which it holds already); Streaming DiLoCo's other fragment trained since its own sync, and one is in flight.
    assert moved == 0.0 if SYNCS[CASES[case][0]][0] == 1 else moved > 1e-6, moved
    saved = read_weights(out / "checkpoint").tensors
    assert set(reference) <= set(saved), sorted(set(reference) - set(saved))
    for key, value in reference.items():
        torch.testing.assert_close(saved[key], value, rtol=0, atol=0, msg=key)
    metadata, _ = read_metadata_file(str(next(out.glob("checkpoint/**/.metadata"))))
    keys, writer = list(metadata.state_dict_metadata), _writer(case)
    residuals = [k for k in keys if ".residual." in k]
    assert bool(residuals) == (wire == "int8"), residuals
    assert all(k.startswith(f"diloco.replica.{writer}.residual.") for k in residuals), residuals
    # The writer's inner AdamW state sits where a load on another replica count reads it (``optim.state``), whichever
    # replica wrote it (a writer other than replica 0 once kept it under its own replica's keys only).
    assert [k for k in keys if k.startswith("optim.state.") and k.endswith(".exp_avg")], keys


def _replay(policy: hsdp.DiLoCo, nproc: tuple[int, ...], logs: dict[tuple[int, int], list[list[dict]]],
            syncs: dict[int, list[int]], entered: dict[int, tuple[int, int]], by_ranks: bool = False,
            from_source: bool = False
            ) -> tuple[dict[int, dict[str, torch.Tensor]], dict[tuple[int, int, int], float]]:
    """:func:`_simulate` on one thread (tiny ops: with 2 threads on a loaded 2-core machine it takes 30x longer)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _simulate(policy, nproc, logs, syncs, entered, by_ranks, from_source)
    finally:
        torch.set_num_threads(threads)


def test_a_joiner_runs_the_healing_members_plan_from_the_sync_under_way() -> None:
    """``outer_plan.py`` in one process, the transactions stubbed (what the launches above cannot time): the plan a
    member sends crosses the heal's ``torch.load(weights_only=True)``; a joiner healed in the members' redo of a
    landing takes part in it as a sync of its own, then starts the next fragment as they do; a live replica
    healed in its own landing's vote (the coordinator dropped it) abandons the rest of its own plan for the
    members'; at an elastic job's start (no plan sent) every replica syncs the fragment due."""
    policy = hsdp.DiLoCo(every=3, fragments=2, delay=1)
    members = SyncPlan.after_step([1], [0], policy.delay)
    members.at = 0  # healed in the redo of fragment 1's landing
    buffer = io.BytesIO()
    torch.save({"plan": members.rest()}, buffer)
    sent = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)["plan"]
    outer, calls = _stubbed(policy)
    outer.run(SyncPlan.joined(sent, outer.due()))
    assert calls == [("transact", 1), ("open", 0)] and [s.fragment for s in outer.pending] == [0]
    assert outer.last == SyncStep((0,), (1,)) and outer.plan is None

    outer, calls = _stubbed(policy)
    outer.pending = [PendingSync(1, 0, [], [], opened=True)]

    def dropped(sync: PendingSync) -> bool:  # its vote: rejoined and healed into the members' start of fragment 1
        calls.append(("close", sync.fragment))
        outer.pending, outer.joined = [], SyncPlan.joined([[[START, 1]], None], 0)
        return False

    outer._close = dropped  # type: ignore[method-assign]
    assert not outer.run(SyncPlan.after_step([1], [0], policy.delay))
    assert calls == [("close", 1), ("open", 1)] and outer.last == SyncStep((1,), ())  # not its own start of 0
    outer, calls = _stubbed(policy)
    outer.inner_steps = 0
    outer.enter()
    assert calls == [("transact", 1)]  # the job's start: the fragment due at phase 0


def _stubbed(policy: hsdp.DiLoCo) -> tuple[OuterState, list[tuple[str, int]]]:
    """An ``OuterState`` with its transactions stubbed, recording them (``outer_plan.py``'s walker alone)."""
    outer, calls = OuterState.__new__(OuterState), []
    outer.policy, outer.pending, outer.plan, outer.joined, outer.inner_steps = policy, [], None, None, 1
    outer._open = lambda f: calls.append(("open", f)) or PendingSync(f, policy.delay, [], [])  # type: ignore
    outer.transact = lambda f: calls.append(("transact", f)) or True  # type: ignore[method-assign]
    outer.mark_written = lambda: None  # type: ignore[method-assign]
    return outer, calls


def _simulate(policy: hsdp.DiLoCo, nproc: tuple[int, ...], logs: dict[tuple[int, int], list[list[dict]]],
              syncs: dict[int, list[int]], entered: dict[int, tuple[int, int]], by_ranks: bool = False,
              from_source: bool = False
              ) -> tuple[dict[int, dict[str, torch.Tensor]], dict[tuple[int, int, int], float]]:
    """One process: Streaming DiLoCo's replicas as the logs say they met. Each replica takes the inner steps it
    logged (on its ``nproc[r]`` ranks' batches concatenated; ``by_ranks``: its weight times that count, what a
    sync must not do). After inner step k: the syncs started ``delay`` steps before land
    (with ``delay`` 0, after the start below): over the members that committed it (``syncs[k]``), their
    pseudo-gradients sent at its start, averaged with their weights, step the fragment's global copy through the
    outer optimizer, and each member's weights of that fragment become it; a replica healed after step k takes
    the global copy as its weights (``from_source``: the lowest-numbered committed member's weights, what a heal
    must not do) and that member's inner optimizer state, and its weights restart at 0; the
    fragment whose offset the phase reached sends each present replica's pseudo-gradient (global - local) with
    its weight: its inner steps since that fragment's last start (or its heal). The losses each rank saw, and each
    replica's final weights."""
    torch.manual_seed(0)  # the first sync's heal made every replica replica 0
    global_model = ParityNet()
    names = next(lines[0]["fragments"] for lines in logs[(0, 0)])  # each fragment's parameter names
    outer = torch.optim.SGD([p for p in global_model.parameters() if p.requires_grad], lr=0.7, momentum=0.9,
                            nesterov=True)
    local = {r: copy.deepcopy(global_model) for r in range(REPLICAS)}
    inner = {r: torch.optim.AdamW(local[r].parameters(), lr=1e-2) for r in range(REPLICAS)}
    fragment = [_fragment(global_model, n) for n in names]
    trained: dict[int, list[int]] = {}  # inner step -> the replicas that logged it
    for (replica, rank), incarnations in logs.items():
        for record in (r for lines in incarnations for r in lines if "step" in r and rank == 0):
            trained.setdefault(record["step"], []).append(replica)
    since = {r: [0] * policy.fragments for r in range(REPLICAS)}  # inner steps since each fragment's start
    sent: dict[int, dict[int, tuple[int, list[torch.Tensor]]]] = {}  # fragment -> replica -> (weight, deltas)
    losses: dict[tuple[int, int, int], float] = {}

    def land(f: int, members: list[int]) -> None:
        parts = [sent[f][r] for r in members if r in sent[f]]  # a replica healed in a redo sent nothing: weight 0
        total = sum(w for w, _ in parts)
        if total:
            for i, p in enumerate(fragment[f]):
                p.grad = sum(w * deltas[i] for w, deltas in parts) / total
            outer.step()
            outer.zero_grad(set_to_none=True)
        for r in members:
            with torch.no_grad():
                for p, q in zip(fragment[f], _fragment(local[r], names[f]), strict=True):
                    q.copy_(p)

    for k in range(max(trained) + 1):
        for r in sorted(trained.get(k, [])):
            _inner_step(local[r], inner[r], k, r, nproc[r], losses)
            since[r] = [n + 1 for n in since[r]]
        for f in _starting(policy, k - policy.delay) if policy.delay and k >= policy.delay else []:
            land(f, syncs[k])
        healed = [v for v, (at, _) in entered.items() if at == k]
        for victim in healed:
            source = min(r for r in syncs[entered[victim][1]] if r not in healed)
            local[victim].load_state_dict(local[source].state_dict())
            if not from_source:
                with torch.no_grad():
                    for p, q in zip(global_model.parameters(), local[victim].parameters(), strict=True):
                        q.copy_(p)
            inner[victim].load_state_dict(copy.deepcopy(inner[source].state_dict()))
            since[victim] = [0] * policy.fragments
        for f in _starting(policy, k):
            present = set(trained.get(k, [])) | set(healed)
            sent[f] = {r: (since[r][f] * (nproc[r] if by_ranks else 1), [p.detach() - q.detach() for p, q in
                                         zip(fragment[f], _fragment(local[r], names[f]), strict=True)])
                       for r in present}
            for r in present:
                since[r][f] = 0
            if not policy.delay:
                land(f, syncs[k])
    return {r: {n: p.detach().clone() for n, p in m.named_parameters()} for r, m in local.items()}, losses


def _starting(policy: hsdp.DiLoCo, k: int) -> list[int]:
    """The fragments whose sync starts after inner step ``k`` (the phase reaches their offset)."""
    return [f for f in range(policy.fragments) if policy.offset(f) == (k + 1) % policy.every]


def _fragment(model: torch.nn.Module, names: list[str]) -> list[torch.nn.Parameter]:
    """``model``'s trainable parameters named in ``names`` (a tied parameter under either of its names)."""
    named = dict(model.named_parameters(remove_duplicate=False))
    return [named[n] for n in names if named[n].requires_grad]


def _inner_step(model: torch.nn.Module, opt: torch.optim.Optimizer, k: int, replica: int, ranks: int,
                losses: dict[tuple[int, int, int], float]) -> None:
    """Replica ``replica``'s inner step ``k`` on its ranks' batches concatenated; each rank's loss before it."""
    parts = [batch(k, REPLICAS * replica + s) for s in range(ranks)]
    with torch.no_grad():
        for s, (x, y) in enumerate(parts):
            losses[(k, replica, s)] = loss_fn(model(x), y).item()
    loss_fn(model(torch.cat([x for x, _ in parts])), torch.cat([y for _, y in parts])).backward()
    opt.step()
    opt.zero_grad()
