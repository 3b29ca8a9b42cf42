"""``hsdp train`` as one replica of an elastic job (``parallel.elastic = true``): steps, records, the one writer.

Each replica is its own torchrun job (``hsdp launch --elastic``, or one torchrun per node beside ``hsdp
coordinator``); all of them train into the same ``train.out_dir``. The rules:

* **Steps.** The coordinator numbers them: train step ``k`` (from 1) is elastic step ``k - 1``. A replica that
  joins is healed from a live one at ``ShardedOptimizer`` construction and goes on after ``model.last_step``; it
  never reads a checkpoint (``--resume`` is refused with elastic). Its batches follow from the step and its
  stable data-parallel rank (replica id x S + shard rank), as do the learning rate and the data position, so it
  reads what it would have read had it never left.
* **Records.** Every step's record adds ``committed`` (applied on every member, else discarded everywhere),
  ``replicas`` (the members' ids), ``global_batch`` (the sequences whose gradients were averaged: 0 for a
  discarded step, which adds no tokens and has no ``grad_norm``) and ``writer`` (the replica that wrote the line).
  ``loss`` is the writing replica's mean: a replica's ranks average among themselves only (a collective across
  replicas could fail between steps).
* **One writer at a time.** The writer of step k is the lowest replica id among k's members (the same on every
  member); its rank 0 alone writes k's record, and at k the periodic checkpoint and the held-out loss; the writer
  of the last step writes the sample and the summary. The writer changes only at a step boundary the coordinator
  orders: a lower id joined (the old writer wrote k - 1 before it asked for step k; the joiner writes only after
  k's decision), or the writer left. A writer taking over reads the file's last step and also writes the records
  after it that it still holds (the step its predecessor died in), so no step is written twice and none a member
  saw is lost.
* **The lease** (:mod:`hsdp.checkpoint.lease`) is the job's, shared by its replicas under one label (the job's name
  and an id the first replica to ask leaves on the coordinator's store): the writer holds it while it writes
  (``save_checkpoint`` needs it) and takes it over from the previous writer at once, live or not; a replica that
  stops writing gives it back; another job is refused as ever. So the replicas never refuse each other, and two
  jobs still never share a run directory.
* **Starting** (checked before the model is built). Until the coordinator publishes the job's first quorum no step
  of this job can have run, so a run directory that holds a run then is an older job's and is refused as for a
  fresh ``hsdp train``; once it is published, a replica joins the running job's directory, whose ``config.toml``
  must equal its own configuration. Another job's live lease is refused either way.
* **Below the minimum** the coordinator stops the job and every rank raises ``hsdp.QuorumLost``. ``hsdp train``
  stops after the last finished step, whose state every member holds alike (under DiLoCo, where the coordinator's
  steps are syncs: the step whose sync the job stopped in, its inner step taken); the first replica to claim it on the
  coordinator's store (the writer of the last step when the store is gone) checkpoints there and writes the
  summary; every rank exits with :data:`QUORUM_LOST_EXIT_STATUS`.
"""

from __future__ import annotations

import collections
import json
import os
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from hsdp.apps.train.config import RunConfig
from hsdp.apps.train.config_io import CONFIG_NAME, to_toml
from hsdp.apps.train.metrics import FIELDS, MetricsWriter, read_metrics
from hsdp.apps.train.ranks import RankChannel
from hsdp.apps.train.rundir import RunDir, start_problem
from hsdp.checkpoint.lease import hold_lease, lease_problem, release_lease
from hsdp.engine.agreement import on_rank0
from hsdp.engine.replicate.elastic.bootstrap import elastic_env
from hsdp.engine.replicate.elastic.layer import ElasticLayer
from hsdp.engine.replicate.elastic.protocol import key
from hsdp.engine.replicate.layer import StepRecord

QUORUM_LOST_EXIT_STATUS = 3  # as `hsdp coordinator` exits when it stopped a job below its minimum of replicas
ELASTIC_FIELDS = (*FIELDS, "committed", "replicas", "global_batch", "writer")  # metrics.csv's columns
RECENT = 16  # records a replica keeps for the gap a writer that died leaves (the step it died in)
LAUNCH = "hsdp launch --elastic -- -m hsdp.apps.train parallel.elastic=true"


def launch_problem(cfg: RunConfig, under_torchrun: bool) -> str | None:
    """Why this process cannot be a rank of one replica of an elastic job (``None``: it can, or the run is not
    elastic): ``hsdp train`` would start one job of all its ranks itself, or the coordinator's environment is
    missing. Checked before anything starts."""
    if not cfg.parallel.elastic:
        return None
    if not under_torchrun:
        return (f"parallel.elastic = true runs every replica as its own torchrun job beside an hsdp coordinator, "
                f"which hsdp train does not start itself: use `{LAUNCH} ...` (emulated nodes on this machine), or "
                f"`hsdp coordinator --port P --replicas N` and on every node HSDP_COORDINATOR=host:P "
                f"HSDP_REPLICA_ID=<node> torchrun ... -m hsdp.apps.train parallel.elastic=true")
    try:
        elastic_env(None)
    except ValueError as e:
        return f"parallel.elastic = true: {e}"
    return None


def shared_label(layer: ElasticLayer) -> str:
    """The label the job's replicas hold the run directory's lease under: the job's name and an id the first of
    them to ask leaves on the coordinator's store (the same for all, however each names the coordinator's host;
    another run of a job of that name, under another coordinator, gets another)."""
    run = layer.client.store.compare_set(key(layer.client.job, "train", "run"), "", uuid.uuid4().hex[:12])
    return f"hsdp elastic job {layer.client.job!r} run {run.decode()}"


def prepare_elastic_run_dir(cfg: RunConfig, channel: RankChannel) -> RunDir:
    """Check the run directory for this replica (rank 0 of it; a collective over the replica's ranks, which all
    raise rank 0's ``ValueError``); nothing is written: the first writer creates it (:class:`ElasticWriter`)."""
    layer = channel.mesh.elastic
    assert layer is not None
    on_rank0(channel.comm, "", lambda: _check_run_dir(cfg, layer))
    return RunDir(cfg.train.out_dir)


def _check_run_dir(cfg: RunConfig, layer: ElasticLayer) -> None:
    run = RunDir(cfg.train.out_dir)
    if not layer.client.store.check([key(layer.client.job, "quorum", 0)]):  # no step of this job has run yet
        problem = start_problem(cfg)
    else:
        problem = lease_problem(run.checkpoints, shared=shared_label(layer)) or _config_problem(cfg, run)
    if problem is None:
        problem = _job_config_problem(cfg, layer)
    if problem is not None:
        raise ValueError(problem)


def _job_config_problem(cfg: RunConfig, layer: ElasticLayer) -> str | None:
    """Whether this replica's configuration is the job's (the first replica to ask leaves its own on the
    coordinator's store): replicas of another job on the same coordinator and job name, which the coordinator
    cannot tell apart from late ones, are refused here instead of training with this job."""
    ours = json.dumps({"config": to_toml(cfg), "out_dir": cfg.train.out_dir})
    theirs = json.loads(layer.client.store.compare_set(key(layer.client.job, "train", "config"), "", ours))
    if theirs["config"] == to_toml(cfg):
        return None
    return (f"replica {layer.replica_id}: elastic job {layer.client.job!r} on the coordinator at "
            f"{layer.client.address} already trains another configuration (its first replica's, out_dir "
            f"{theirs['out_dir']!r}): start every replica of a job with the same configuration, or run a second "
            f"job under its own HSDP_ELASTIC_JOB (hsdp coordinator --job NAME) or coordinator")


def _config_problem(cfg: RunConfig, run: RunDir) -> str | None:
    path = os.path.join(run.path, CONFIG_NAME)
    try:
        with open(path, encoding="utf-8") as f:
            same = f.read() == to_toml(cfg)
    except FileNotFoundError:
        return None
    if same:
        return None
    return (f"replica joining the elastic job in {run.path!r}: its configuration differs from the run's {path} "
            f"(written by the job's first writer): start every replica with the same configuration")


def membership(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """What an elastic run's records say: the committed steps, the discarded ones, each change of the members
    (``{"step", "replicas"}``, the first step included) and the replicas that wrote them."""
    changes: list[dict[str, Any]] = []
    for r in records:
        if not changes or r["replicas"] != changes[-1]["replicas"]:
            changes.append({"step": r["step"], "replicas": r["replicas"]})
    return {"committed": sum(1 for r in records if r["committed"]),
            "discarded": [r["step"] for r in records if not r["committed"]], "membership": changes,
            "writers": sorted({r["writer"] for r in records})}


class ElasticWriter:
    """Which replica writes the run directory at each step, and that writer's files (see the module docstring).

    Every rank of every replica holds one and calls :meth:`annotate` and :meth:`publish` for each step, in the
    same order; :attr:`writing` (whether this replica writes the current step) comes from ``model.last_step``,
    so it is the same on the replica's ranks, and only their rank 0 touches files. ``sequences`` is each
    configured replica's share of a global batch, by replica id (its ranks' sequences x micro-batches: with batch
    weights the replicas' shares differ), ``block_size`` the tokens per sequence."""

    def __init__(self, cfg: RunConfig, run: RunDir, channel: RankChannel, sequences: Sequence[int],
                 block_size: int, last_step: Callable[[], StepRecord | None]) -> None:
        layer = channel.mesh.elastic
        assert layer is not None
        self.cfg, self.run, self.channel, self.layer = cfg, run, channel, layer
        self.last_step = last_step  # model.last_step (under DiLoCo: the inner step, the last sync's replicas)
        self.sequences, self.block_size = sequences, block_size
        self.writing = False
        self.quorum_lost = ""
        # Read now, while the coordinator is certainly up (a final checkpoint may need it after it stopped).
        self.label = shared_label(layer) if channel.is_root else ""
        self._holding = False  # this replica holds the lease and (rank 0) the open files
        self._recent: collections.deque[dict[str, Any]] = collections.deque(maxlen=RECENT)
        self._files: MetricsWriter | None = None
        self._tokens = 0
        self._members: list[int] | None = None

    @property
    def replica_id(self) -> int:
        return self.layer.replica_id

    def annotate(self, step: int, record: dict[str, Any]) -> dict[str, Any]:
        """``record`` of train step ``step`` with what the coordinator decided (``model.last_step``): committed,
        members, the batch really averaged; decides :attr:`writing` for the step."""
        last = self.last_step()
        if last is not None and self.replica_id not in last.replicas and last.step > step - 1:
            # The library rejoined a live replica the coordinator dropped, healed to step last.step; this loop
            # counts train steps itself and cannot skip ahead yet: end, so torchrun restarts it (it rejoins).
            raise RuntimeError(f"hsdp train: replica {self.replica_id} was dropped by the coordinator during train "
                               f"step {step} (a rank's heartbeat silent past the timeout) and healed to go on after "
                               f"step {last.step + 1}; hsdp train does not skip ahead in-process yet: ending this "
                               f"replica, which torchrun restarts (--max-restarts) to rejoin")
        if last is None or last.step != step - 1:
            raise RuntimeError(f"hsdp train: train step {step} ended elastic step {None if last is None else last.step}"
                               f": the loop and the coordinator disagree on the step (an hsdp bug)")
        self.writing = min(last.replicas) == self.replica_id
        sequences = sum(self.sequences[r] for r in last.replicas) if last.committed else 0
        tokens = sequences * self.block_size
        return {**record, "committed": last.committed, "replicas": list(last.replicas), "global_batch": sequences,
                "step_tokens": tokens, "tokens": None, "tokens_per_s": tokens / max(record["step_s"], 1e-9),
                "writer": min(last.replicas), **({} if last.committed else {"grad_norm": None})}

    def publish(self, record: dict[str, Any]) -> str | None:
        """After step ``record["step"]``: keep its record; the writer's rank 0 writes it (taking the lease and the
        files over first, with the steps the file lacks). A line for the progress report when the members
        changed (or the step was discarded), else ``None``."""
        self._recent.append(record)
        if not self.writing:
            self._put_down()
        elif not self._holding:
            self.hold()
        elif self.channel.is_root:
            self._write(record)
        return self._note(record)

    def hold(self) -> None:
        """Take the lease and open the files (rank 0; a collective over the replica's ranks), writing the records
        this replica holds that the file lacks."""
        if not self._holding:
            on_rank0(self.channel.comm, "", self._open)
            self._holding = True

    def _open(self) -> None:
        hold_lease(self.run.checkpoints, watchdog=self.channel.mesh.watchdog, shared=self.label)
        os.makedirs(self.run.path, exist_ok=True)
        config = os.path.join(self.run.path, CONFIG_NAME)
        if not os.path.exists(config):  # the job's first writer; replicas that join later compare with it
            with open(config, "w", encoding="utf-8") as f:
                f.write(to_toml(self.cfg))
        kept = read_metrics(self.run.path)
        last = kept[-1]["step"] if kept else 0
        self._tokens = (kept[-1].get("tokens") or 0) if kept else 0
        self._files = MetricsWriter(self.run.path, last if kept else None, fields=ELASTIC_FIELDS, append=True)
        for record in self._recent:
            if record["step"] > last:
                self._write(record)

    def _write(self, record: dict[str, Any]) -> None:
        assert self._files is not None
        self._tokens += record["step_tokens"]
        self._files.write({**{k: v for k, v in record.items() if k != "step_tokens"}, "tokens": self._tokens,
                           "writer": self.replica_id})

    def _put_down(self) -> None:
        if not self._holding:
            return
        self._holding = False
        if self._files is not None:
            self._files.close()
            self._files = None
        release_lease(self.run.checkpoints)  # nothing on ranks that do not hold it

    def _note(self, record: dict[str, Any]) -> str | None:
        changed = record["replicas"] != self._members
        self._members = record["replicas"]
        if record["committed"] and not changed:
            return None
        what = "replicas" if record["committed"] else "discarded (a member failed); replicas"
        return f"step {record['step']}: {what} {record['replicas']}"

    def joined_text(self, start_step: int) -> str:
        """Where this replica comes in: the step, the members, the replica it was healed from."""
        q = self.layer.quorum
        assert q is not None  # admitted at the optimizer's construction
        healed = f", healed from replica {q.source}" if self.replica_id in q.joiners else ""
        return (f"elastic job {self.layer.client.job!r}: replica {self.replica_id} of {self.layer.configured} joins "
                f"at step {start_step + 1} with replicas {list(q.members)}{healed}")

    def done_text(self, first: int, last: int) -> str:
        """What a replica that does not write the run's end says instead of the summary."""
        return (f"replica {self.replica_id}: steps {first}..{last} done; the run directory's summary is written by "
                f"replica {min(self._members or [self.replica_id])}")

    def claim_final(self) -> bool:
        """After ``QuorumLost``, on every rank of this replica: whether it writes the final checkpoint and the
        summary: the first replica to claim it on the coordinator's store (which serves on for a few seconds
        after it stopped the job), else, the store being gone, the writer of the last step."""
        won = None
        if self.channel.is_root:  # the replica's leader: local rank 0 of its job
            try:
                won = int(self.layer.client.store.add(key(self.layer.client.job, "train", "final"), 1)) == 1
            except (RuntimeError, TimeoutError):
                won = self.writing
        self.writing = bool(self.channel.broadcast(won))
        return self.writing

    def summary(self, records: Sequence[dict[str, Any]]) -> dict[str, Any]:
        """The summary's ``elastic`` part: the whole job's history from the file on the writer's rank 0, this
        session's records elsewhere."""
        if self.channel.is_root and self.writing:
            records = read_metrics(self.run.path)
        return {"replica": self.replica_id, "replicas": self.layer.configured, **membership(records),
                **({"quorum_lost": self.quorum_lost} if self.quorum_lost else {})}

    def close(self) -> None:
        """Close the files and give the lease back (when this replica holds them)."""
        self._put_down()

    def __enter__(self) -> ElasticWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def quorum_lost_text(replica: int, message: str, step: int, checkpoint: str | None) -> str:
    """What rank 0 of a replica prints when the coordinator stopped the job below its minimum."""
    saved = f"; checkpoint {checkpoint}" if checkpoint else ""
    return (f"replica {replica} stopped after step {step}: {message}{saved}. Exit status {QUORUM_LOST_EXIT_STATUS}. "
            f"Continue from the checkpoint without elastic (hsdp train --resume parallel.elastic=false), or start "
            f"a new elastic job in a new run directory with enough replicas")
