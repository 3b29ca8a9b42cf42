"""``hsdp train parallel.elastic=true``: replica jobs sharing one run directory, one writer at a time.

Each replica is its own job of ``python -m hsdp.apps.train parallel.elastic=true`` ranks (its own rendezvous
store, as one torchrun per node), beside an hsdp coordinator in this process, as in ``tests/test_elastic.py``.
The coordinator here holds a step's quorum or decision while the test acts (kills a replica, restarts it), so
every run takes the same path whatever the machine's speed. Checked:

- a replica killed (SIGKILL, every rank) while the step it wrote was being decided (each replica's 2 ranks split
  its layers, ``parallel.tensor_parallel = 2``): that step is discarded and
  logged once, with ``committed`` false, by the survivor, which writes the run alone from then on (the lease
  passes to it at once), checkpoints included; the restarted replica rejoins at a step boundary, healed, and
  writes again (the lowest id); the job finishes with status 0 on every rank; ``metrics.jsonl`` holds each step
  exactly once, with the members, the batch really averaged (batch weights 1 : 3 per replica: each member's
  share of the global batch) and the writer the rule names, and tokens counting
  the committed steps only; the summary counts committed and discarded steps and the membership changes; the
  checkpoints load into the model, and no lease is left behind;
- below the minimum (2 of 2 replicas, one killed) the survivor raises ``QuorumLost``, checkpoints its last
  finished step, says why and exits with status 3 (under DiLoCo: the step whose sync the job stopped in);
- elastic Streaming DiLoCo with the int8 wire on replicas of 2 and 1 ranks ends with the closing sync, then the
  writer alone evaluates and checkpoints;
- the refusals before anything starts (configuration, no torchrun, no coordinator), the lease's rule for the
  replicas of one job (taken over at once, passed on quietly, another job still refused).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch.distributed as dist

from hsdp.apps.train import command
from hsdp.apps.train.config_io import resolve_config
from hsdp.apps.train.elastic_run import QUORUM_LOST_EXIT_STATUS, launch_problem, membership
from hsdp.apps.train.metrics import MetricsWriter, read_metrics
from hsdp.checkpoint.export import read_weights
from hsdp.checkpoint.lease import confirm_lease, hold_lease, lease_path, lease_problem, release_lease
from hsdp.engine.replicate.elastic.protocol import key
from hsdp.models import GPT
from hsdp.tools.coordinator.server import Coordinator

JOB, BLOCK, BATCH = "train", 16, 2
NEVER = 1 << 30


class GatedCoordinator(Coordinator):
    """A coordinator that publishes no quorum for a step from ``quorum_gate`` on and no decision from
    ``decision_gate`` on, until the test moves the gates (heartbeats are still watched meanwhile)."""

    quorum_gate = NEVER
    decision_gate = NEVER

    def _maybe_decide_quorum(self) -> None:
        if self.state.step < self.quorum_gate:
            super()._maybe_decide_quorum()

    def _maybe_decide_commit(self) -> None:
        if self.state.step < self.decision_gate:
            super()._maybe_decide_commit()

    def dead(self, replica: int) -> bool:
        inc = self.state.members.get(replica)
        return inc is None or not self._alive(inc)

    def joining(self, replica: int, probe: dist.Store) -> bool:
        """A new incarnation of ``replica`` is ready to be admitted (registered, beating, its optimizer built)."""
        inc = self.state.pending.get(replica)
        return (inc is not None and min(inc.beats) >= 0 and self._alive(inc)
                and probe.check([key(JOB, "ready", replica, inc.number)]))


@contextlib.contextmanager
def _coordinator(replicas: int, min_replicas: int, ranks: tuple[int, ...] | None = None
                 ) -> Iterator[tuple[GatedCoordinator, str, dist.Store]]:
    """The coordinator serving in a thread, its address, and the test's own connection to its store (``ranks``:
    each replica's rank count, declared as ``hsdp coordinator --nproc-per-replica`` does)."""
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    # start_grace: step 1 waits for every replica however slow their start (else fewer may begin the job).
    coord = GatedCoordinator(master, JOB, replicas=replicas, min_replicas=min_replicas, start_grace=120.0,
                             ranks=ranks)
    stop = threading.Event()
    thread = threading.Thread(target=coord.serve, args=(stop.is_set,), daemon=True)
    thread.start()
    probe = dist.TCPStore("127.0.0.1", master.port, is_master=False, wait_for_workers=False)
    try:
        yield coord, f"127.0.0.1:{master.port}", probe
    finally:
        stop.set()
        thread.join()


def _args(tmp_path: Path, steps: int, checkpoint_every: int) -> list[str]:
    corpus = tmp_path / "corpus.txt"
    if not corpus.exists():
        corpus.write_text("".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(600)))
    return ["parallel.elastic=true", f"data.source={corpus}", "model.preset=tiny", f"model.block_size={BLOCK}",
            f"train.batch_size={BATCH}", f"train.steps={steps}", f"train.checkpoint_every={checkpoint_every}",
            "train.eval_every=6", "train.eval_batches=1", "train.log_every=4", "train.sample_tokens=4",
            "optim.warmup_steps=2", "--out", str(tmp_path / "run")]


class Replica:
    """One replica's job: its ranks (``python -m hsdp.apps.train``) and the store they meet on."""

    def __init__(self, replica: int, ranks: int, address: str, args: list[str], logs: Path) -> None:
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self.procs, self.logs = [], []
        for rank in range(ranks):
            env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(ranks), "LOCAL_RANK": str(rank),
                   "LOCAL_WORLD_SIZE": str(ranks), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(self.store.port),
                   "TORCHELASTIC_USE_AGENT_STORE": "True", "OMP_NUM_THREADS": "1", "HSDP_COORDINATOR": address,
                   "HSDP_REPLICA_ID": str(replica), "HSDP_ELASTIC_JOB": JOB}
            log = logs / f"replica{replica}_rank{rank}_{time.monotonic_ns()}.log"
            self.logs.append(log)
            with open(log, "w") as out:
                self.procs.append(subprocess.Popen([sys.executable, "-m", "hsdp.apps.train", *args], env=env,
                                                   cwd=logs, stdout=out, stderr=subprocess.STDOUT))

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
            p.wait()

    def wait(self, deadline: float) -> list[int]:
        try:
            return [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in self.procs]
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"a replica did not finish:\n{self.output()[-4000:]}")

    def output(self) -> str:
        return "\n".join(log.read_text() for log in self.logs)

    def said(self) -> str:
        """The output with every run of white space one space (rich wraps lines at 80 columns in a pipe)."""
        return " ".join(self.output().split())


def _until(what: str, ready: Callable[[], bool], deadline: float, jobs: list[Replica]) -> None:
    while not ready():
        if time.monotonic() > deadline or any(p.poll() is not None for job in jobs for p in job.procs):
            for job in jobs:
                job.kill()
            pytest.fail(f"waiting for {what}:\n" + "\n".join(job.output()[-3000:] for job in jobs))
        time.sleep(0.02)


def _votes_in(probe: dist.Store, step: int, ranks: int, replicas: tuple[int, ...]) -> bool:
    """Every rank of ``replicas`` voted that its inter-node reduction of ``step`` completed."""
    return all(int(probe.add(key(JOB, "ok", step, r), 0)) >= ranks for r in replicas)


def _held_at(coord: Coordinator, probe: dist.Store, step: int, replicas: tuple[int, ...]) -> bool:
    """Every replica asked for ``step``'s quorum, which the gate holds back."""
    return coord.state.step == step and coord.state.quorum is None and probe.check(
        [key(JOB, "want", step, r) for r in replicas])


def summary_batch(run: Path) -> dict:
    """What ``summary.json`` says about the split of the global batch."""
    batch = json.loads((run / "summary.json").read_text())["batch_weights"]
    return {"weights": batch["weights"], "batch_sizes": batch["batch_sizes"]}


def _loads(ckpt: Path) -> None:
    cfg = resolve_config(None, [f"model.block_size={BLOCK}"])
    model = GPT(cfg.model.shape(256))
    model.load_state_dict(read_weights(str(ckpt)).tensors, strict=True)


def test_a_killed_replica_costs_a_step_hands_the_run_to_a_survivor_and_writes_again_after_rejoining(
        tmp_path: Path) -> None:
    ranks, steps = 2, 12
    # Each replica's 2 ranks split its layers (tensor parallelism: one data-parallel rank per replica), and batch
    # weights 1 : 3 per replica split the global batch of 4: replica 0 reads 1 sequence, replica 1 3; a step's
    # gradient weighs its members' pieces only.
    args = [*_args(tmp_path, steps, checkpoint_every=4), "parallel.batch_weights=[1,3]", "parallel.tensor_parallel=2"]
    deadline = time.monotonic() + 150
    with _coordinator(replicas=2, min_replicas=1) as (coord, address, probe):
        coord.decision_gate = 4  # elastic step 4 = train step 5: hold its decision
        first = [Replica(r, ranks, address, args, tmp_path) for r in range(2)]
        _until("both replicas' votes on step 5", lambda: _votes_in(probe, 4, ranks, (0, 1)), deadline, first)
        first[0].kill()  # replica 0, the writer, dies after voting: step 5 is discarded (a member is gone)
        _until("the coordinator to drop replica 0", lambda: coord.dead(0), deadline, first[1:])
        coord.quorum_gate, coord.decision_gate = 8, NEVER  # replica 1 trains steps 6-8 alone, then waits
        _until("replica 1 alone at step 9", lambda: _held_at(coord, probe, 8, (1,)), deadline, first[1:])
        again = Replica(0, ranks, address, args, tmp_path)
        _until("the restarted replica 0 to register", lambda: coord.joining(0, probe), deadline, [first[1], again])
        coord.quorum_gate = NEVER  # admitted at step 9, healed from replica 1
        statuses = {"replica 1": first[1].wait(deadline), "restarted replica 0": again.wait(deadline)}
    for name, job in (("replica 1", first[1]), ("restarted replica 0", again)):
        assert statuses[name] == [0] * ranks, (name, statuses[name], job.output()[-4000:])
    run = tmp_path / "run"
    records = read_metrics(str(run))
    assert [r["step"] for r in records] == list(range(1, steps + 1))  # every step once: one writer per line
    both, alone = [0, 1], [1]
    assert [(r["committed"], r["replicas"], r["writer"]) for r in records] == (
        [(True, both, 0)] * 4 + [(False, both, 1)] + [(True, alone, 1)] * 3 + [(True, both, 0)] * 4)
    whole, ones = BATCH * 2, 3 * BATCH * 2 // 4  # the global batch; replica 1's share alone
    assert [r["global_batch"] for r in records] == [whole] * 4 + [0] + [ones] * 3 + [whole] * 4
    assert summary_batch(run) == {"weights": [1.0, 3.0], "batch_sizes": [1, 3]}
    assert records[4]["grad_norm"] is None and all(r["grad_norm"] > 0 for r in records if r["committed"])
    assert records[-1]["tokens"] == sum(r["global_batch"] for r in records) * BLOCK
    assert records[5]["eval_loss"] is not None and records[11]["eval_loss"] is not None
    assert (run / "metrics.csv").read_text().splitlines()[0].endswith("committed,replicas,global_batch,writer")
    summary = json.loads((run / "summary.json").read_text())
    assert summary["elastic"] == {"replica": 0, "replicas": 2, "committed": 11, "discarded": [5],
                                  "membership": [{"step": 1, "replicas": both}, {"step": 6, "replicas": alone},
                                                 {"step": 9, "replicas": both}], "writers": [0, 1]}
    assert summary["steps"]["first"] == 9 and summary["mesh"] == {"replicas": 2, "shards": 1, "tp": 2, "world": 2}
    assert (run / "sample.txt").exists() and (run / "config.toml").exists()
    ckpts = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert ckpts == ["latest", "step_000004", "step_000008", "step_000012"], ckpts  # by replicas 0, 1, 0
    manifest = json.loads((run / "checkpoints" / "step_000008" / "manifest.json").read_text())
    # One replica's ranks saved it: 1 replica of 1 shard rank (x 2 tp ranks).
    assert manifest["world_size"] == ranks and manifest["mesh"] == [1, 1]
    _loads(run / "checkpoints")
    assert not os.path.exists(lease_path(run / "checkpoints"))
    assert records[8]["loss"] < records[0]["loss"] - 0.5  # the restarted replica's own loss: healed, not new
    assert "replica 0 of 2 joins at step 9 with replicas [0, 1], healed from replica 1" in again.said()
    out = first[1].said()
    assert "replica 1: steps 1..12 done; the run directory's summary is written by replica 0" in out
    assert "step 5: discarded (a member failed); replicas [0, 1]" in out and "step 6: replicas [1]" in out


def test_below_the_minimum_every_rank_stops_and_the_survivor_checkpoints_its_last_step(tmp_path: Path) -> None:
    # With the bf16 hop: the hop variants run on the elastic replicate groups as on a grid.
    args = [*_args(tmp_path, steps=50, checkpoint_every=0), "train.eval_every=0", "parallel.replica_hop=bf16"]
    deadline = time.monotonic() + 100
    with _coordinator(replicas=2, min_replicas=2) as (coord, address, probe):
        coord.quorum_gate = 3  # train step 4: both wait for its quorum
        jobs = [Replica(r, 1, address, args, tmp_path) for r in range(2)]
        _until("both replicas at step 4", lambda: _held_at(coord, probe, 3, (0, 1)), deadline, jobs)
        jobs[1].kill()
        _until("the coordinator to see replica 1 dead", lambda: coord.dead(1), deadline, jobs[:1])
        coord.quorum_gate = NEVER  # one live replica, below the minimum of 2: the job stops
        status = jobs[0].wait(deadline)
        claimed = int(probe.add(key(JOB, "train", "final"), 0))
    out = jobs[0].said()
    assert status == [QUORUM_LOST_EXIT_STATUS], jobs[0].output()[-4000:]
    assert "replica 0 stopped after step 3: hsdp elastic: the coordinator stopped the job at step 3" in out
    assert "below the minimum of 2" in out and "Exit status 3" in out and claimed == 1
    run = tmp_path / "run"
    assert [r["step"] for r in read_metrics(str(run))] == [1, 2, 3]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step_000003"]
    _loads(run / "checkpoints")
    summary = json.loads((run / "summary.json").read_text())
    assert "below the minimum" in summary["elastic"]["quorum_lost"] and summary["elastic"]["committed"] == 3
    assert all(r["replicate_bytes"] > 0 for r in read_metrics(str(run)))  # the bf16 hop crossed the groups


def test_below_the_minimum_under_diloco_the_checkpoint_is_of_the_step_whose_sync_stopped(tmp_path: Path) -> None:
    """Under DiLoCo the layer's steps are syncs, not train steps: the job stops in step 4's sync (H = 4), after its
    inner step, and the checkpoint is of step 4 (it once took the sync's number, 1, for the train step's)."""
    args = [*_args(tmp_path, steps=50, checkpoint_every=0), "train.eval_every=0", "parallel.replica_sync=diloco",
            "parallel.diloco_every=4"]
    deadline = time.monotonic() + 100
    with _coordinator(replicas=2, min_replicas=2) as (coord, address, probe):
        coord.quorum_gate = 1  # the first sync (elastic step 0 admitted them): both wait for it
        jobs = [Replica(r, 1, address, args, tmp_path) for r in range(2)]
        _until("both replicas at the first sync", lambda: _held_at(coord, probe, 1, (0, 1)), deadline, jobs)
        jobs[1].kill()
        _until("the coordinator to see replica 1 dead", lambda: coord.dead(1), deadline, jobs[:1])
        coord.quorum_gate = NEVER
        status = jobs[0].wait(deadline)
    assert status == [QUORUM_LOST_EXIT_STATUS], jobs[0].output()[-4000:]
    assert "replica 0 stopped after step 4: hsdp elastic: the coordinator stopped the job" in jobs[0].said()
    run = tmp_path / "run"
    assert [r["step"] for r in read_metrics(str(run))] == [1, 2, 3]  # step 4's record: never finished
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step_000004"]
    _loads(run / "checkpoints")


def test_elastic_streaming_diloco_on_degrees_2_1_with_the_int8_wire_ends_synced_and_checkpointed(
        tmp_path: Path) -> None:
    """The decentralized recipe in small: replicas of 2 and 1 ranks, Streaming DiLoCo (H 4, 2 fragments, delay 1,
    mix 0.5) with the int8 wire. Step 7 is mid-phase with a sync in flight: it ends with ``sync_replicas`` over both
    replicas, after which the writer (replica 0) alone evaluates and checkpoints while replica 1 has left."""
    steps = 7
    args = [*_args(tmp_path, steps, checkpoint_every=4), "parallel.sharding_degree=[2,1]",
            "parallel.replica_sync=diloco", "parallel.diloco_every=4", "parallel.diloco_fragments=2",
            "parallel.diloco_delay=1", "parallel.diloco_mix=0.5", "parallel.diloco_wire_dtype=int8"]
    deadline = time.monotonic() + 120
    with _coordinator(replicas=2, min_replicas=2, ranks=(2, 1)) as (coord, address, _):
        jobs = [Replica(r, ranks, address, args, tmp_path) for r, ranks in ((0, 2), (1, 1))]
        statuses = [job.wait(deadline) for job in jobs]
        while not coord.state.completed and time.monotonic() < deadline:  # its next poll sees the last one finish
            time.sleep(0.02)
        completed = coord.state.completed
    for job, status in zip(jobs, statuses, strict=True):
        assert status == [0] * len(status), job.output()[-4000:]
    assert "replica(s) [0, 1] finished training after step" in completed, completed
    run = tmp_path / "run"
    records = read_metrics(str(run))
    assert [r["step"] for r in records] == list(range(1, steps + 1)) and all(r["committed"] for r in records)
    last = records[-1]
    # The closing sync: the fragment in flight landed, then both fragments synced at once (int8: bytes crossed).
    assert last["synced_all"] and sorted(last["sync_started"])[-2:] == [0, 1] and last["replicate_bytes"] > 0
    assert not any(r.get("synced_all") for r in records[:-1]) and last["eval_loss"] is not None
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step_000004", "step_000007"]
    _loads(run / "checkpoints")
    assert json.loads((run / "summary.json").read_text())["replica_sync"]["wire_dtype"] == "int8"


def test_elastic_refusals_before_anything_starts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    # A list of degrees combines with elastic (declared to the coordinator: tests/test_elastic.py's kill case).
    for override, fix in [("parallel.shard_optimizer_across_replicas=true", "shard_optimizer_across_replicas = false")]:
        with pytest.raises(ValueError, match=f"does not combine with parallel.elastic = true.*{fix}.*"
                                             f"or parallel.elastic = false"):
            resolve_config(None, ["parallel.elastic=true", override])
    # Batch weights as a list combine with elastic (tests/test_elastic.py); "auto" calibrates over every rank.
    with pytest.raises(ValueError, match=r"parallel.batch_weights = 'auto': not with parallel.elastic = true.*"
                                         r"give the weights as a list"):
        resolve_config(None, ["parallel.elastic=true", "parallel.batch_weights=auto"])
    with pytest.raises(ValueError, match=r"train.resume = True: not with parallel.elastic = true yet.*--out.*"
                                         r"hsdp train --resume parallel.elastic=false"):
        resolve_config(None, ["parallel.elastic=true", "train.resume=true"])
    with pytest.raises(ValueError, match=r"log.wandb = True: not with parallel.elastic = true yet"):
        resolve_config(None, ["parallel.elastic=true", "log.wandb=true"])
    cfg = resolve_config(None, ["parallel.elastic=true"])
    assert launch_problem(resolve_config(None, []), under_torchrun=False) is None
    for name in ("RANK", "WORLD_SIZE", "HSDP_COORDINATOR", "HSDP_REPLICA_ID"):
        monkeypatch.delenv(name, raising=False)
    assert "use `hsdp launch --elastic -- -m hsdp.apps.train parallel.elastic=true ...`" in launch_problem(
        cfg, under_torchrun=False)
    assert "set HSDP_COORDINATOR=host:port" in launch_problem(cfg, under_torchrun=True)
    monkeypatch.setenv("HSDP_COORDINATOR", "127.0.0.1:1")
    assert "set HSDP_REPLICA_ID to 0, 1" in launch_problem(cfg, under_torchrun=True)
    assert command.main(["parallel.elastic=true", "--out", str(tmp_path / "run")]) == 2
    assert "hsdp train: error: parallel.elastic = true runs every replica as its own torchrun job" in (
        capsys.readouterr().err)
    assert os.listdir(tmp_path) == []  # refused before anything is written


def test_the_lease_passes_between_the_replicas_of_one_job_and_refuses_other_jobs(tmp_path: Path) -> None:
    run = str(tmp_path / "checkpoints")
    label = "hsdp elastic job 'train' at 127.0.0.1:1"
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        other = {"job": "", "host": "h", "pid": sleeper.pid, "pid_space": "", "token": "theirs", "since": 0.0}
        Path(lease_path(run)).write_text(json.dumps({**other, "shared": label}))  # a live replica of the job
        assert lease_problem(run, shared=label) is None and lease_problem(run) is not None
        lease = hold_lease(run, shared=label)  # taken over at once, no warning (pytest turns warnings into errors)
        assert json.loads(Path(lease_path(run)).read_text())["token"] == lease.holder.token
        Path(lease_path(run)).write_text(json.dumps({**other, "shared": label}))  # it takes it back
        lease._renewed = 0.0  # the watchdog's next check is due
        assert lease.check() is None and lease.passed_on  # passed on quietly: no failure of this replica
        with pytest.raises(ValueError, match="was passed to another process of job"):
            confirm_lease(run)  # ... but no save of this one commits any more
        assert hold_lease(run, shared=label).holder.token != "theirs"  # and it may take it back later
        release_lease(run)
        Path(lease_path(run)).write_text(json.dumps({**other, "shared": "hsdp elastic job 'x' at h:2"}))
        with pytest.raises(ValueError, match="two jobs must not write checkpoints into one run directory"):
            hold_lease(run, shared=label)  # another elastic job's live lease
    finally:
        sleeper.kill()
        sleeper.wait()


def test_membership_of_records() -> None:
    records = [{"step": 1, "committed": True, "replicas": [0, 1], "writer": 0},
               {"step": 2, "committed": False, "replicas": [0, 1], "writer": 1},
               {"step": 3, "committed": True, "replicas": [1], "writer": 1}]
    assert membership(records) == {"committed": 2, "discarded": [2], "writers": [0, 1],
                                   "membership": [{"step": 1, "replicas": [0, 1]}, {"step": 3, "replicas": [1]}]}


def test_a_next_writer_appends_after_the_last_whole_line(tmp_path: Path) -> None:
    with MetricsWriter(str(tmp_path), fields=("step", "loss"), append=True) as first:
        first.write({"step": 1, "loss": 2.0})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 2, "lo')  # the writer was killed in the middle of a line
    with open(tmp_path / "metrics.csv", "a") as f:
        f.write("2,1.")
    assert [r["step"] for r in read_metrics(str(tmp_path))] == [1]
    with MetricsWriter(str(tmp_path), 1, fields=("step", "loss"), append=True) as second:  # nothing rewritten
        second.write({"step": 2, "loss": 1.5})
    assert read_metrics(str(tmp_path)) == [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5}]
    assert (tmp_path / "metrics.csv").read_text().splitlines() == ["step,loss", "1,2.0", "2,1.5"]
