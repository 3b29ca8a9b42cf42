"""Elastic replicas: a dead or stopped replica costs a step, not the job, and a restarted one rejoins from a peer.

Three replicas of two ranks, each its own job (its own rendezvous store, as one torchrun per node), and an hsdp
coordinator in this process (``tests/programs/elastic_worker.py`` is the training loop). At step 3 the victim
replica's ranks die in backward (SIGKILL), or its rank 0 is stopped (SIGSTOP; its own watchdog then ends the
replica; that case also accumulates two micro-batches per step, the hop deferred to the last); this test plays
torchrun's part: once a rank of the victim exited it ends the rest and starts the
replica again, with no checkpoint. Checked:

- the survivors discard the interrupted step (``model.last_step.committed`` False, on both) and commit their
  next step within 10 s of the fault, with the two of them (the replicate groups' own timeout is 60 s: a
  stopped peer's collective is given up on the coordinator's notice, not on a timeout);
- the restarted replica is admitted at a later step, healed from replica 0, and all three train on together
  (two committed steps of all three), after which ``check_replicas`` passes on every rank;
- no step is applied twice or partially: every rank's losses and the final parameters equal one plain process
  replaying exactly the committed steps, each on the concatenated batches of the replicas it lists (1e-5);
- the replica-sharded optimizer is refused on an elastic mesh, before any collective.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from models import ParityNet, batch, loss_fn

from hsdp.engine.elastic.protocol import ElasticPolicy
from hsdp.tools.coordinator.server import Coordinator

PROGRAM = Path(__file__).parent / "programs" / "elastic_worker.py"
REPLICAS, RANKS, VICTIM, FAULT_STEP = 3, 2, 2, 3
POLICY = ElasticPolicy(heartbeat_interval=0.1, heartbeat_timeout=4.0, hop_timeout=60.0)  # as the worker's
ACCUM = {"kill": 1, "stop": 2}  # the stopped-replica case also accumulates two micro-batches per step


@pytest.fixture()
def coordinator() -> Iterator[str]:
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    coord = Coordinator(master, "test", replicas=REPLICAS, policy=POLICY)
    stop = threading.Event()
    thread = threading.Thread(target=coord.serve, args=(stop.is_set,), daemon=True)
    thread.start()
    yield f"127.0.0.1:{master.port}"
    stop.set()
    thread.join()


class Replica:
    """One replica's job: its ranks, and the store its own process group meets on (torchrun's agent's)."""

    def __init__(self, replica: int, address: str, out: Path, fault: str, accum: int) -> None:
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self.procs = []
        for rank in range(RANKS):
            env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(RANKS), "LOCAL_RANK": str(rank),
                   "LOCAL_WORLD_SIZE": str(RANKS), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(self.store.port),
                   "TORCHELASTIC_USE_AGENT_STORE": "True", "OMP_NUM_THREADS": "1", "HSDP_COORDINATOR": address,
                   "HSDP_REPLICA_ID": str(replica), "HSDP_ELASTIC_JOB": "test", "ELASTIC_OUT": str(out),
                   "ELASTIC_FAULT": fault, "ELASTIC_VICTIM": str(VICTIM), "ELASTIC_FAULT_STEP": str(FAULT_STEP),
                   "ELASTIC_ACCUM": str(accum)}
            self.procs.append(subprocess.Popen([sys.executable, str(PROGRAM)], env=env, stdout=subprocess.PIPE,
                                               stderr=subprocess.STDOUT, text=True))

    def any_exited(self) -> bool:
        return any(p.poll() is not None for p in self.procs)

    def end(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
            p.wait()

    def outputs(self) -> str:
        return "\n".join(p.stdout.read() for p in self.procs if p.stdout is not None)


def _run(address: str, out: Path, fault: str) -> tuple[list[Replica], Replica]:
    replicas = [Replica(r, address, out, fault, ACCUM[fault]) for r in range(REPLICAS)]
    deadline = time.monotonic() + 120
    while not replicas[VICTIM].any_exited():  # torchrun's part: a rank of the replica ended
        assert time.monotonic() < deadline, "the victim replica never failed"
        time.sleep(0.1)
    replicas[VICTIM].end()
    restarted = Replica(VICTIM, address, out, "", ACCUM[fault])
    for job in [*replicas[:VICTIM], restarted]:
        for p in job.procs:
            try:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                job.end()
                pytest.fail(f"a replica did not finish:\n{job.outputs()[-3000:]}")
    return replicas, restarted


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
def test_a_failed_replica_costs_a_step_and_rejoins_from_a_peer(coordinator: str, tmp_path: Path, fault: str) -> None:
    replicas, restarted = _run(coordinator, tmp_path, fault)
    for name, job in [("replica 0", replicas[0]), ("replica 1", replicas[1]), ("restarted", restarted)]:
        assert all(p.returncode == 0 for p in job.procs), (name, [p.returncode for p in job.procs],
                                                            job.outputs()[-4000:])
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
