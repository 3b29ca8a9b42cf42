"""Elastic replicas: a dead or stopped replica costs a step, not the job, and a restarted one rejoins from a peer.

``hsdp launch --elastic --nodes 3 --nproc-per-node 2``: three replicas of two ranks, each its own torchrun job
(``--max-restarts 1``), a coordinator on node 0, every node in its network namespace (with root and iproute2;
on the loopback otherwise). ``tests/programs/elastic_worker.py`` is the training loop. At step 10 of its first
incarnation, node 2's ranks die in backward (SIGKILL), or its rank 0 is stopped (SIGSTOP; rank 1's watchdog
then ends the replica, the store rank 0 hosts no longer answering; that case also accumulates two
micro-batches per step, the hop deferred to the last); its torchrun restarts it (a stopped rank after
torchrun's 30 s SIGTERM grace), with no checkpoint. Checked:

- the survivors discard the interrupted step (``model.last_step.committed`` False, on both) and commit their
  next step within 10 s of the fault (the replicate groups' own timeout is 60 s: a stopped peer's collective
  is given up on the coordinator's notice, not on a timeout);
- the restarted replica is admitted at a later step, healed from replica 0 (the coordinator says so), and all
  three train on together (two committed steps of all three), after which ``check_replicas`` passes on every
  rank; the launch exits 0 and leaves no process (nor namespace) behind;
- no step is applied twice or partially: every rank's losses and the final parameters equal one plain process
  replaying exactly the committed steps, each on the concatenated batches of the replicas it lists (1e-5);
- the replica-sharded optimizer is refused on an elastic mesh, before any collective.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch
from launched import run_launch
from models import ParityNet, batch, loss_fn

from hsdp.tools.launch.netns import find_tools, list_namespaces

PROGRAM = Path(__file__).parent / "programs" / "elastic_worker.py"
REPLICAS, RANKS, VICTIM, FAULT_STEP = 3, 2, 2, 10
HEARTBEAT_TIMEOUT_S = 4  # the coordinator's: above its default 3 s, which a busy 2-core machine can miss
ACCUM = {"kill": 1, "stop": 2}  # the stopped-replica case also accumulates two micro-batches per step
RUN_TIMEOUT_S = 300


def _run(out: Path, fault: str) -> str:
    """The launch, checked to end well: status 0, nothing left behind; its output."""
    tools = find_tools() if os.geteuid() == 0 else None
    before = set(list_namespaces(tools)) if tools is not None else set()
    flags = ["--elastic", "--nodes", str(REPLICAS), "--nproc-per-node", str(RANKS), "--max-restarts", "1",
             "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT_S),
             "--require-emulation" if tools is not None else "--no-emulation"]
    env = {"OMP_NUM_THREADS": "1", "ELASTIC_OUT": str(out), "ELASTIC_FAULT": fault, "ELASTIC_VICTIM": str(VICTIM),
           "ELASTIC_FAULT_STEP": str(FAULT_STEP), "ELASTIC_ACCUM": str(ACCUM[fault])}
    code, output, left = run_launch(flags, [str(PROGRAM)], env, RUN_TIMEOUT_S)
    assert code == 0, output[-6000:]
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


def _replay(steps: list[dict], accum: int) -> tuple[dict[str, torch.Tensor], dict[tuple[int, int, int], list[float]]]:
    """One process: every committed step on the concatenated batches of its replicas (and micro-batches, all of
    one size: the mean over them is the mean of their means); the losses each rank saw."""
    torch.manual_seed(0)  # the first quorum healed every replica from replica 0
    model = ParityNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = {}
    for record in steps:
        k, members = record["step"], record["replicas"]
        parts = {(r, s, m): batch(1000 * m + k, REPLICAS * r + s)
                 for r in range(REPLICAS) for s in range(RANKS) for m in range(accum)}
        with torch.no_grad():
            for r in range(REPLICAS):
                for s in range(RANKS):
                    losses[(k, r, s)] = [loss_fn(model(parts[(r, s, m)][0]), parts[(r, s, m)][1]).item()
                                         for m in range(accum)]
        if not record["committed"]:
            continue
        chosen = [parts[(r, s, m)] for r in members for s in range(RANKS) for m in range(accum)]
        loss_fn(model(torch.cat([x for x, _ in chosen])), torch.cat([y for _, y in chosen])).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, losses


@pytest.mark.parametrize("fault", ["kill", "stop"])
def test_a_failed_replica_costs_a_step_and_rejoins_from_a_peer(tmp_path: Path, fault: str) -> None:
    output = _run(tmp_path, fault)
    assert re.search(rf"\[coordinator\] .*replica {VICTIM} left", output), output[-6000:]
    assert re.search(rf"\[coordinator\] .*replica {VICTIM} rejoined \(incarnation 2, healed from replica 0\)",
                     output), output[-6000:]
    assert "summary of elastic job 'default'" in output and "1 join(s), 1 departure(s)" in output, output[-3000:]
    if fault == "stop":  # the stopped rank 0 hosts its replica's store: rank 1's watchdog ends the replica
        assert "the job's store has not answered for" in output, output[-6000:]
    logs = _records(tmp_path)
    survivor = [r for r in logs[(0, 0)][0] if "step" in r]
    by_step = {r["step"]: r for r in survivor}
    assert by_step[FAULT_STEP]["committed"] is False  # the interrupted step is discarded
    fault_at = next(r["t"] for r in logs[(VICTIM, 0)][0] if "fault" in r)
    after = [r for r in survivor if r["step"] > FAULT_STEP and r["committed"]]
    # Without the victim, or with it already back (a restart can beat the heartbeat timeout).
    assert after[0]["replicas"] in ([0, 1], [0, 1, 2]) and after[0]["t"] - fault_at < 10, (after[0], fault_at)
    assert "an elastic mesh's replicas come and go" in logs[(0, 0)][0][0]["refused"]
    joined = logs[(VICTIM, 0)][1][0]["joined"]
    assert joined > FAULT_STEP and by_step[joined]["replicas"] == [0, 1, 2]
    for replica in range(REPLICAS):  # every replica agrees on the committed history it took part in
        for rank in range(RANKS):
            mine = [r for r in logs[(replica, rank)][-1] if "step" in r]
            assert [(r["step"], r["committed"], r["replicas"]) for r in mine] == [
                (r["step"], r["committed"], r["replicas"]) for r in survivor if r["step"] >= mine[0]["step"]]
    params, losses = _replay(survivor, ACCUM[fault])
    for (replica, rank), incarnations in logs.items():
        for record in (r for lines in incarnations for r in lines if "step" in r):
            assert record["losses"] == pytest.approx(losses[(record["step"], replica, rank)], abs=1e-5), (replica, rank)
        saved = torch.load(tmp_path / f"params_r{replica}_s{rank}.pt")
        for name, value in params.items():
            torch.testing.assert_close(saved[name], value, rtol=1e-5, atol=1e-5, msg=f"{replica}/{rank} {name}")
