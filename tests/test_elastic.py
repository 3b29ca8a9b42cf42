"""Elastic replicas: a dead or stopped replica costs a step, not the job, and a restarted one rejoins from a peer.

``hsdp launch --elastic --nodes 3 --nproc-per-node 2``: three replicas of two ranks, each its own torchrun job
(``--max-restarts 1``), a coordinator on node 0, every node in its network namespace (with root and iproute2;
on the loopback otherwise). ``tests/programs/elastic_worker.py`` is the training loop. At step 6 of its first
incarnation, node 2's ranks die in backward (SIGKILL), or its rank 0 is stopped (SIGSTOP; rank 1's watchdog
then ends the replica, the store rank 0 hosts no longer answering; that case also accumulates two
micro-batches per step, the hop deferred to the last); its torchrun restarts it (a stopped rank after
torchrun's SIGTERM, which a helper process lets it take at once instead of after torchrun's 30 s grace), with no
checkpoint. Checked:

- the survivors discard the interrupted step (``model.last_step.committed`` False, on both) and commit their
  next step within 10 s of the fault (the replicate groups' own timeout is 60 s: a stopped peer's collective
  is given up on the coordinator's notice, not on a timeout);
- the restarted replica is admitted at a later step, healed from replica 0 (the coordinator says so), and all
  three train on together (two committed steps of all three), after which ``check_replicas`` passes on every
  rank; the launch exits 0 and leaves no process (nor namespace) behind;
- no step is applied twice or partially: every rank's losses and the final parameters equal one plain process
  replaying exactly the committed steps, each on the concatenated batches of the replicas it lists (1e-5);
- the replica-sharded optimizer is refused on an elastic mesh, before any collective.

The ``kill`` case also weights every backward by its rows (``model.set_batch_weight``), 2, 4 and 6 per rank on
replicas 0, 1, 2: each committed step's gradient is the weighted mean over that step's members only, which the
replay on the concatenated batches of the members is, and an unweighted replay is not (checked to differ). Its
replicas have different shard degrees, ``--nproc-per-node 2,1,1`` (the coordinator told each id's rank count):
the gradient is the mean over the members' ranks, reduced piece by piece over the quorum's degrees (a replay
averaging the replicas instead of their ranks is checked to differ), and the killed 1-rank replica is healed from
the 2-rank replica 0, its rows re-cut on the way (the first quorum heals both 1-rank replicas from it too); the
``stop-rank-1`` case runs replicas of 1, 1 and 2 ranks (the victim the 2-rank one: fewer processes on 2 cores),
and the job whose replica is restarted after it completed (killed in backward) replicas of one rank. The
``stop`` case (a stopped replica restarted and healed) and the starved replica's job (dropped alive, healed
without a restart) run tensor parallelism: each replica's 2 ranks are one shard position of two tp ranks
(``init_mesh(elastic=True, tensor_parallel_degree=2)``), and the replicate groups and the heal are per (shard,
tp) position.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
from pathlib import Path
from types import ModuleType

import pytest
import torch
from launched import run_launch, why_failed
from models import ParityNet, batch, logits, loss_fn, tiny_gpt

from hsdp.tools.launch.netns import find_tools, list_namespaces

PROGRAM = Path(__file__).parent / "programs" / "elastic_worker.py"
REPLICAS, RANKS, VICTIM, FAULT_STEP = 3, 2, 2, 6
HEARTBEAT_TIMEOUT_S = 4  # the coordinator's: above its default 3 s, which a busy 2-core machine can miss
# Each case's fault and worker settings: the stopped rank 0 also accumulates two micro-batches per step; a
# stopped rank 1 leaves its replica's rank 0 beating while it waits in the reduce-scatter inside the node, and
# the watchdog's bound (what ended that replica and so the survivors' wait before every rank beat) is 15 s there.
WEIGHTED_ROWS = "2,4,6"  # the kill case: rows per rank of replicas 0, 1, 2, and the batch weight of each
TP = {"ELASTIC_TP": "2"}  # the stop and starve cases: each replica one shard position of two tp ranks
HETERO = {"ELASTIC_NPROC": "2,1,1"}  # the kill case: replicas of 2, 1 and 1 ranks (shard degrees; stop-rank-1: 1,1,2)
CASES = {"kill": {"ELASTIC_FAULT": "kill", "ELASTIC_ROWS": WEIGHTED_ROWS, **HETERO},
         "stop": {"ELASTIC_FAULT": "stop", "ELASTIC_ACCUM": "2", **TP},
         "stop-rank-1": {"ELASTIC_FAULT": "stop", "ELASTIC_STOP_RANK": "1", "ELASTIC_WATCHDOG_S": "15",
                         "ELASTIC_NPROC": "1,1,2"}}
RUN_TIMEOUT_S = 300
# A SIGKILL to the survivors' next committed step (the step's time taken when it committed): 0.16-0.31 s in
# five runs here, under load too, the restarted victim kept from importing torch on the same 2 cores meanwhile
# (elastic_worker.py: on a cluster it restarts on its own node); without the liveness probe it is the 4 s heartbeat
# timeout and more. The bound: 1 s.
KILL_RECOVERY_S = 1.0


def _run(out: Path, case: dict[str, str]) -> str:
    """The launch, checked to end well: status 0, nothing left behind; its output."""
    tools = find_tools() if os.geteuid() == 0 else None
    before = set(list_namespaces(tools)) if tools is not None else set()
    flags = ["--elastic", "--nodes", str(REPLICAS), "--nproc-per-node", case.get("ELASTIC_NPROC", str(RANKS)),
             "--max-restarts", "1",
             "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT_S),
             "--require-emulation" if tools is not None else "--no-emulation"]
    env = {"OMP_NUM_THREADS": "1", "ELASTIC_OUT": str(out), "ELASTIC_VICTIM": str(VICTIM),
           "ELASTIC_FAULT_STEP": str(FAULT_STEP), **case}
    code, output, left = run_launch(flags, [str(PROGRAM)], env, RUN_TIMEOUT_S)
    assert code == 0, why_failed(output)
    assert left == [], f"processes left behind: {left}"
    if tools is not None:
        assert set(list_namespaces(tools)) <= before, output[-3000:]
    return output


def _records(out: Path) -> dict[tuple[int, int], list[list[dict]]]:
    """(replica, rank) -> each incarnation's log lines, in start order."""
    logs: dict[tuple[int, int], list[list[dict]]] = {}
    for path in sorted(out.glob("r*_s*_i*.jsonl"), key=os.path.getmtime):
        replica, rank = int(path.name[1]), int(path.name.split("_s")[1].split("_")[0])
        logs.setdefault((replica, rank), []).append([json.loads(line) for line in path.read_text().splitlines()])
    return logs


def _worker() -> ModuleType:
    """The worker program as a module (its optimizer choice)."""
    spec = importlib.util.spec_from_file_location("elastic_worker", PROGRAM)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _nproc(case: dict[str, str]) -> list[int]:
    """Each replica's rank count."""
    return [int(n) for n in case.get("ELASTIC_NPROC", ",".join([str(RANKS)] * REPLICAS)).split(",")]


def _replay(steps: list[dict], case: dict[str, str], weighted: bool = True, per_replica: bool = False
            ) -> tuple[dict[str, torch.Tensor], dict[tuple[int, int, int], list[float]]]:
    """One process: every committed step on the concatenated batches of its replicas (and micro-batches, of one
    size per replica: the mean over every row is the mean of the batches' mean losses weighted by their rows,
    what ``set_batch_weight(rows)`` asks for); not ``weighted``: the plain mean of the batches' mean losses;
    ``per_replica``: each replica's ranks weighing as much as one rank of any other (the mean over replicas, not
    ranks: what a reduction ignoring the replicas' degrees would compute). The losses each rank saw, by (step,
    replica, rank in the replica's job)."""
    accum, tp = int(case.get("ELASTIC_ACCUM", "1")), int(case.get("ELASTIC_TP", "1"))
    rows = [int(n) for n in case.get("ELASTIC_ROWS", "4,4,4").split(",")]
    nproc = _nproc(case)
    seq, positions = (4 if tp > 1 else 5), [n // tp for n in nproc]
    torch.manual_seed(0)  # the first quorum healed every replica from replica 0
    model = tiny_gpt() if tp > 1 else ParityNet()
    opt = _worker().optimizer(model.parameters(), tp)

    def loss_of(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return loss_fn(logits(model, x), y)

    losses = {}
    for record in steps:
        k, members = record["step"], record["replicas"]
        parts = {(r, s, m): batch(1000 * m + k, REPLICAS * r + s, rows[r], seq)
                 for r in range(REPLICAS) for s in range(positions[r]) for m in range(accum)}
        with torch.no_grad():
            for r in range(REPLICAS):
                for rank in range(nproc[r]):
                    losses[(k, r, rank)] = [loss_of(*parts[(r, rank // tp, m)]).item() for m in range(accum)]
        if not record["committed"]:
            continue
        chosen = [parts[(r, s, m)] for r in members for s in range(positions[r]) for m in range(accum)]
        if per_replica:
            shares = [rows[r] / positions[r] for r in members for _ in range(positions[r]) for _ in range(accum)]
            (sum(w * loss_of(x, y) for w, (x, y) in zip(shares, chosen, strict=True)) / sum(shares)).backward()
        elif weighted:
            loss_of(torch.cat([x for x, _ in chosen]), torch.cat([y for _, y in chosen])).backward()
        else:
            (sum(loss_of(x, y) for x, y in chosen) / len(chosen)).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, losses


@pytest.mark.parametrize("fault", list(CASES))
def test_a_failed_replica_costs_a_step_and_rejoins_from_a_peer(tmp_path: Path, fault: str) -> None:
    output = _run(tmp_path, CASES[fault])
    assert re.search(rf"\[coordinator\] .*replica {VICTIM} left", output), output[-6000:]
    assert re.search(rf"\[coordinator\] .*replica {VICTIM} rejoined \(incarnation 2, healed from replica 0\)",
                     output), output[-6000:]
    assert "summary of elastic job 'default'" in output and "1 join(s), 1 departure(s)" in output, output[-3000:]
    if fault == "stop":  # the stopped rank 0 hosts its replica's store: rank 1's watchdog ends the replica
        assert "the job's store has not answered for" in output, output[-6000:]
    logs = _records(tmp_path)
    if "ELASTIC_TP" in CASES[fault]:
        _check_tensor_parallel(logs)
    survivor = _survivor(logs)
    fault_at = next(r["t"] for r in logs[(VICTIM, 0)][0] if "fault" in r)
    # A killed replica's liveness ports refuse the coordinator's probe at once: the survivors go on within a
    # second; a stopped one answers the probe (slow is not dead) and is dropped at the heartbeat timeout.
    _check_one_step_lost(survivor, fault_at, bound=KILL_RECOVERY_S if fault == "kill" else 10)
    if fault == "kill":
        assert re.search(rf"replica {VICTIM} left \(its process is gone", output), output[-6000:]
    assert "an elastic mesh's replicas come and go" in logs[(0, 0)][0][0]["refused"]
    joined = logs[(VICTIM, 0)][1][0]["joined"]
    assert joined > FAULT_STEP and {r["step"]: r for r in survivor}[joined]["replicas"] == [0, 1, 2]
    for replica in range(REPLICAS):  # every replica agrees on the committed history it took part in
        for rank in range(_nproc(CASES[fault])[replica]):
            mine = [r for r in logs[(replica, rank)][-1] if "step" in r]
            assert [(r["step"], r["committed"], r["replicas"]) for r in mine] == [
                (r["step"], r["committed"], r["replicas"]) for r in survivor if r["step"] >= mine[0]["step"]]
    params = _check_replay(tmp_path, logs, survivor, CASES[fault], range(REPLICAS))
    if "ELASTIC_ROWS" in CASES[fault]:  # the weights mattered: ignoring them would fail the replay
        unweighted, _ = _replay(survivor, CASES[fault], weighted=False)
        assert max((params[n] - unweighted[n]).abs().max().item() for n in params) > 1e-3
    if "ELASTIC_NPROC" in CASES[fault]:  # so did the degrees: a mean over replicas, not ranks, would fail it
        per_replica, _ = _replay(survivor, CASES[fault], per_replica=True)
        assert max((params[n] - per_replica[n]).abs().max().item() for n in params) > 1e-3
        if fault == "kill":
            assert len(logs[(VICTIM, 0)]) == 2 and (VICTIM, 1) not in logs  # one rank, killed and healed from 2
            _check_heal_sent_to_the_joiner_only(logs, joined)


def test_a_live_replica_the_coordinator_dropped_rejoins_healed_without_a_restart(tmp_path: Path) -> None:
    case = {"ELASTIC_FAULT": "starve", **TP}
    output = _run(tmp_path, case)  # its ranks hold the GIL 6 s after step 6
    assert f"hsdp elastic: replica {VICTIM} (incarnation 1) is alive but the coordinator dropped it" in output
    assert re.search(rf"\[coordinator\] .*replica {VICTIM} left", output), output[-6000:]
    assert re.search(rf"\[coordinator\] .*replica {VICTIM} rejoined \(incarnation 2, healed from replica 0\)",
                     output), output[-6000:]
    logs = _records(tmp_path)
    _check_tensor_parallel(logs)
    assert all(len(logs[(VICTIM, rank)]) == 1 for rank in range(RANKS))  # one process each: no restart
    survivor = _survivor(logs, lost=None)  # it starved before asking for step 11: the others only waited for it
    fault_at = next(r["t"] for r in logs[(VICTIM, 0)][0] if "fault" in r)
    _check_one_step_lost(survivor, fault_at, bound=HEARTBEAT_TIMEOUT_S + 6)
    by_step = {r["step"]: r for r in survivor}
    for rank in range(RANKS):
        lines = logs[(VICTIM, rank)][0]
        healed = next(r["healed"] for r in lines if "healed" in r)  # its step 11 ran alone, then it rejoined
        assert healed > FAULT_STEP + 1 and by_step[healed]["replicas"] == [0, 1, 2]
        mine = [(r["step"], r["committed"], r["replicas"]) for r in lines if "step" in r]
        # What it took part in, as everyone saw it: every step up to the fault, then every one from the heal.
        assert [step for step, _, _ in mine] == [*range(FAULT_STEP + 1), *range(healed, mine[-1][0] + 1)]
        assert mine == [(step, by_step[step]["committed"], by_step[step]["replicas"]) for step, _, _ in mine]
    _check_replay(tmp_path, logs, survivor, case, range(REPLICAS))


def test_a_replica_restarted_after_the_job_completed_ends_cleanly(tmp_path: Path) -> None:
    last = FAULT_STEP + 4  # the survivors finish while the killed replica's restart waits to start
    case = {"ELASTIC_FAULT": "kill", "ELASTIC_LAST_STEP": str(last), "ELASTIC_NPROC": "1,1,1"}  # fewer processes
    output = _run(tmp_path, case)
    assert "[coordinator] " in output and f"job completed after step {last}" in output, output[-6000:]
    assert f"hsdp elastic: replica {VICTIM}: the elastic job 'default' completed" in output, output[-6000:]
    assert "start a new job from a checkpoint" not in output and "exited with status" not in output, output[-6000:]
    logs = _records(tmp_path)
    assert len(logs[(VICTIM, 0)]) == 1  # the restart ended before it logged anything: nothing to train
    survivor = _survivor(logs)
    assert survivor[-1]["step"] == last
    _check_replay(tmp_path, logs, survivor, case, range(VICTIM))


def _check_tensor_parallel(logs: dict[tuple[int, int], list[list[dict]]]) -> None:
    """Every incarnation of every rank ran on a tp dim of 2, its blocks' layers split over it."""
    for incarnations in logs.values():
        for lines in incarnations:
            assert lines[0]["tp"] == 2 and lines[0]["tp_split"] > 0, lines[0]


def _survivor(logs: dict[tuple[int, int], list[list[dict]]], lost: int | None = FAULT_STEP) -> list[dict]:
    """Replica 0's rank 0's step records, the step ``lost`` discarded (the victim died or stopped in it)."""
    survivor = [r for r in logs[(0, 0)][0] if "step" in r]
    assert lost is None or {r["step"]: r for r in survivor}[lost]["committed"] is False
    return survivor


def _check_heal_sent_to_the_joiner_only(logs: dict[tuple[int, int], list[list[dict]]], joined: int) -> None:
    """The rejoin's heal went from replica 0's ranks to the joiner's only, point to point: what replica 0 sent
    over it is what the joiner received, and replica 1, which holds the state already, took no part (a broadcast
    over the replicate group would have sent it the state too)."""
    def at(replica: int, rank: int, step: int, key: str) -> int:
        return next(r[key] for r in logs[(replica, rank)][-1] if r.get("step") == step)

    sent = sum(at(0, rank, joined, "heal_sent") - at(0, rank, joined - 1, "heal_sent") for rank in range(2))
    received = at(VICTIM, 0, joined, "heal_received")  # its second incarnation's: the rejoin's heal only
    assert sent == received > 0, (sent, received)
    assert at(1, 0, joined, "heal_received") == at(1, 0, joined - 1, "heal_received")
    assert at(1, 0, joined, "heal_sent") == 0


def _check_one_step_lost(survivor: list[dict], fault_at: float, lost: int = FAULT_STEP, bound: float = 10) -> None:
    """The survivors' next committed step after ``lost`` came within ``bound`` seconds of the fault, without the
    victim, or with it already back (a restart can beat the heartbeat timeout)."""
    after = [r for r in survivor if r["step"] > lost and r["committed"]]
    assert after[0]["replicas"] in ([0, 1], [0, 1, 2]) and after[0]["t"] - fault_at < bound, (
        after[0]["t"] - fault_at, after[0])


def _check_replay(out: Path, logs: dict[tuple[int, int], list[list[dict]]], survivor: list[dict],
                  case: dict[str, str], replicas: range) -> dict[str, torch.Tensor]:
    """No step applied twice or partially: every rank's losses and the saved parameters of ``replicas`` equal one
    process replaying exactly the committed steps (of ``case``'s worker settings); the replay's parameters."""
    params, losses = _replay(survivor, case)
    for (replica, rank), incarnations in logs.items():
        for record in (r for lines in incarnations for r in lines if "step" in r):
            assert record["losses"] == pytest.approx(losses[(record["step"], replica, rank)], abs=1e-5), (replica, rank)
        if replica not in replicas:
            continue
        saved = torch.load(out / f"params_r{replica}_s{rank}.pt")
        for name, value in params.items():
            torch.testing.assert_close(saved[name], value, rtol=1e-5, atol=1e-5, msg=f"{replica}/{rank} {name}")
    return params
