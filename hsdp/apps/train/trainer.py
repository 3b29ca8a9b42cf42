"""The :class:`Trainer`: one rank's training run of ``hsdp train`` (and ``hsdp demo``) as one object.

It owns the wrapped model, its optimizer, the two token streams, the run directory, the rank channel,
rank 0's metrics writer and progress reporter, the profiler and the session's :class:`LoopResult`.
Construction builds them in a fixed order: mesh -> run directory -> corpus (with the model's own tokenizer
for ``model.kind = "hf"``) -> model (rank 0's initial weights are broadcast; an ``hf`` folder's model is built
on the meta device) -> tensor-parallel plan (``parallel.tensor_parallel`` > 1) -> ShardedModel -> its weights
when built on meta (the folder's, or its own initialisation) -> sharded AdamW -> token streams -> resume.

One step = ``grad_accum`` micro-batches (all but the last inside ``model.no_sync()``, so the inter-node
hop runs once per step), gradient clipping over the whole sharded gradient, an AdamW step at the
scheduled learning rate (with ``parallel.replica_sync = "diloco"`` no hop runs, and every H-th step the
optimizer syncs the replicas' weights: :mod:`hsdp.apps.train.replica_sync`). Each step's communication is
read from ``model.comm_stats()`` (reset at the step's start, so evaluation and sampling traffic are not
counted) and published as one metrics record.
Every public method is called on every rank in the same order: evaluation, metric averages, warnings and
checkpoints are collectives. A SIGTERM on any rank (``train.save_on_signal``) ends the loop on every rank
after the same step, with a checkpoint there (see ``hsdp.engine.preemption``).

With ``parallel.elastic`` this rank's job is one replica of an elastic job: "every rank" above means the
replica's ranks, the step numbers come from the coordinator, and one replica at a time writes the run
directory (:mod:`hsdp.apps.train.elastic_run`).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import time
from typing import Any

import torch
from rich.console import Console

import hsdp
from hsdp.apps.train import resume, summary
from hsdp.apps.train.calibration import Calibration
from hsdp.apps.train.config import RunConfig
from hsdp.apps.train.corpus import load_corpus
from hsdp.apps.train.elastic_run import ElasticWriter, prepare_elastic_run_dir
from hsdp.apps.train.lm import LANGUAGE_MODELS, describe, pad_sequence_to, parameter_count, sample
from hsdp.apps.train.metrics import MetricsWriter, comm_totals, peak_memory_bytes
from hsdp.apps.train.optimizer import build_optimizer, lr_at, set_lr
from hsdp.apps.train.profiling import StepProfiler, profile_window
from hsdp.apps.train.progress import Reporter
from hsdp.apps.train.rank_warnings import RankWarnings
from hsdp.apps.train.ranks import RankChannel
from hsdp.apps.train.replica_sync import is_diloco, step_fields, sync_at_end, wrap_options
from hsdp.apps.train.result import LoopResult
from hsdp.apps.train.rundir import prepare_run_dir
from hsdp.apps.train.wandb_sink import record_sinks
from hsdp.apps.train.weighted_stream import WeightedTokenStream, per_rank_weights
from hsdp.data.text import TokenStream
from hsdp.engine.preemption import StopSignals
from hsdp.engine.replicate.elastic.client import QuorumLost

_PRECISION = {"fp32": None, "bf16": hsdp.MixedPrecision(param_dtype=torch.bfloat16)}


def _due(step: int, every: int, last: int) -> bool:
    return every > 0 and (step % every == 0 or step == last)


def _init_mesh(cfg: RunConfig) -> hsdp.HSDPMesh:
    """R x S, or R x S x T with ``parallel.tensor_parallel`` T > 1 (``sharding_degree`` 0: the ranks per node,
    divided by T). T = 1 keeps the 2-D mesh, exactly as before tensor parallelism existed. A list of degrees
    (replicas of different sizes, in rank order) is passed to ``hsdp.init_mesh`` as it is."""
    par = cfg.parallel
    tp = par.tensor_parallel if par.tensor_parallel > 1 else None
    if par.elastic:  # one replica of an elastic job: its own torchrun job's ranks shard everything (x T)
        listed = par.degree_list
        mesh = hsdp.init_mesh(None if listed is not None else par.sharding_degree or None,
                              tensor_parallel_degree=tp, elastic=True)
        if listed is not None and mesh.replicas.data_parallel_degrees != listed:
            # The same on every rank of the replica (each read the coordinator's declaration): no rank waits.
            raise ValueError(f"parallel.sharding_degree = {list(listed)}, but the elastic job's replicas have "
                             f"degrees {list(mesh.replicas.data_parallel_degrees)} (the coordinator's "
                             f"--nproc-per-replica, / parallel.tensor_parallel): declare them to the coordinator "
                             f"(hsdp launch --elastic --nproc-per-node N,N,...), or drop the list")
        return mesh
    degree = list(par.degree_list) if par.degree_list is not None else (par.sharding_degree or None)
    return hsdp.init_mesh(degree, tensor_parallel_degree=tp)


def initial_weights(cfg: RunConfig, mesh: hsdp.HSDPMesh) -> list[float]:
    """The per-rank weights the training stream starts with: the configured list (one per replica spread over
    its ranks: :func:`per_rank_weights`), or, for "auto", the even split its calibration times."""
    weights = cfg.parallel.batch_weights
    if isinstance(weights, str):
        return [1.0] * mesh.data_parallel_size
    return per_rank_weights(weights, mesh.replicas.data_parallel_degrees)


def _to_device(module: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """``module`` on this rank's GPU under NCCL, else the CPU. Parameters on the meta device stay there (they
    get their shards after wrapping); only its real tensors, the buffers, move."""
    if not any(p.is_meta for p in module.parameters()):
        return module.to(device)
    for sub in module.modules():
        for name, buf in sub._buffers.items():
            if buf is not None and not buf.is_meta:
                sub._buffers[name] = buf.to(device)
    return module


class Trainer:
    """Train as ``cfg`` says on this rank; every rank of the job builds one (construction is a collective:
    it creates the mesh, agrees on the run directory, broadcasts the initial weights and resumes).
    Rank 0 alone prints (through ``console``) and writes the run directory's files."""

    def __init__(self, cfg: RunConfig, console: Console, warnings: RankWarnings) -> None:
        self.cfg = cfg
        self.console = console
        self.warnings = warnings  # flushed at logged steps: every rank's warnings, shown once by rank 0
        self.mesh = _init_mesh(cfg)
        self.channel = RankChannel(self.mesh)  # metric averages and records, outside the model's comm stats
        self.run = (prepare_elastic_run_dir if cfg.parallel.elastic else prepare_run_dir)(cfg, self.channel)
        self.lm = LANGUAGE_MODELS[cfg.model.kind]  # the one place the model kind is looked at
        self.corpus = load_corpus(cfg.data, self.lm.tokenizer(cfg.model))
        self.shape = self.lm.shape(cfg.model, self.corpus.tokenizer.vocab_size)
        # Rank 0's weights are broadcast; the seed makes them reproducible, and the same seed on every rank
        # gives the tensor-parallel plan identical whole weights to split (norms are taken as each rank has them)
        # and a meta-built model's initialisation the same draws on every rank.
        torch.manual_seed(cfg.train.seed)
        module = _to_device(self.lm.build(self.shape), self.mesh.device)
        self.description = describe(module, self.shape.block_size)  # before wrapping renames the class
        self.n_params = parameter_count(module)  # P: every parameter once, whatever T splits later
        if self.mesh.tp_degree > 1:
            module = self.lm.parallelize(module, self.mesh.tp_mesh)
        self.model = self._wrap(module)
        self.lm.initialize(self.model, self.shape)  # weights of a meta-built model; nothing for the others
        # Per-reader generator state from here on: dropout masks differ across data-parallel ranks, as their
        # data does, and agree across the T ranks of a tensor-parallel group, whose replicated activations
        # (the embeddings' output) must be masked alike for their gradients to agree.
        torch.manual_seed(cfg.train.seed + 1 + hsdp.data_parallel_rank(self.mesh))
        self.optimizer = build_optimizer(self.model, cfg.optim)
        self.train_stream, self.held_out = self._streams()
        # "auto": the first steps run at the even split and time each rank (calibration.py).
        self.calibration = Calibration() if cfg.parallel.batch_weights == "auto" else None
        self.start_step, self.resumed_from = self._resume()
        self.reporter = Reporter(console, cfg.train.steps, cfg.train.log_every, self.channel.is_root,
                                 self.start_step)
        self.profiler = self._profiler()
        self.writer: MetricsWriter | None = None  # rank 0's metric files, opened by train()
        # Elastic: which replica writes the run directory at each step, and its files.
        self.pen = ElasticWriter(cfg, self.run, self.channel, self._replica_sequences(), self.shape.block_size,
                                 lambda: self.model.last_step) if self.mesh.elastic else None
        self.result = LoopResult(batch=self._batch_info(), mean_bytes=is_diloco(cfg.parallel))

    # -- construction ---------------------------------------------------------------------------------------
    def _wrap(self, module: torch.nn.Module) -> hsdp.ShardedModel:
        par = self.cfg.parallel
        return hsdp.ShardedModel(module, mesh=self.mesh, wrap=self.lm.wrap,
                                 reshard_after_forward=par.reshard_after_forward,
                                 mixed_precision=_PRECISION[par.mixed_precision],
                                 shard_optimizer_across_replicas=par.shard_optimizer_across_replicas,
                                 **wrap_options(par))  # the per-step hop, or DiLoCo (replica_sync.py)

    def _streams(self) -> tuple[TokenStream | WeightedTokenStream, TokenStream]:
        """This rank's training and held-out batches (different seeds: different positions). With
        ``parallel.batch_weights`` the training batches are this rank's piece of each global batch
        (:mod:`hsdp.apps.train.weighted_stream`); evaluation stays even."""
        seed, batch, block = self.cfg.train.seed, self.cfg.train.batch_size, self.shape.block_size
        held_out = TokenStream(self.corpus.held_out, block, batch, seed=seed + 1, mesh=self.mesh)
        if self.cfg.parallel.batch_weights == "even":
            return TokenStream(self.corpus.train, block, batch, seed=seed, mesh=self.mesh), held_out
        if self.cfg.parallel.batch_weights == "auto" and self.mesh.device.type != "cpu":
            raise ValueError('parallel.batch_weights = "auto" times each rank\'s busy seconds (a step less its '
                             "blocked waits), which only CPU ranks measure: on GPUs give the weights as a list, "
                             "from hsdp tune or hsdp plan --nodes 2x8:h100,...")
        weights = initial_weights(self.cfg, self.mesh)
        return WeightedTokenStream(self.corpus.train, block, batch, weights, seed=seed, mesh=self.mesh,
                                   model=self.model), held_out

    def _replica_sequences(self) -> list[int]:
        """Each replica's sequences per optimizer step (its data-parallel ranks' micro-batches), in replica order:
        every replica the data is split over, present or not (elastic)."""
        stream = self.train_stream
        sizes = stream.batch_sizes if isinstance(stream, WeightedTokenStream) else \
            [self.cfg.train.batch_size] * self.mesh.data_parallel_size
        ends = list(itertools.accumulate(self.mesh.replicas.data_parallel_degrees, initial=0))
        return [sum(sizes[a:b]) * self.cfg.train.grad_accum for a, b in itertools.pairwise(ends)]

    @property
    def weighted(self) -> bool:
        """Whether the training batches are cut by batch weights (each rank's gradient counts its share)."""
        return isinstance(self.train_stream, WeightedTokenStream)

    def _batch_info(self) -> dict[str, Any] | None:
        """What ``summary.json`` says about the split: the weights and sequences per rank, the calibration."""
        stream = self.train_stream
        if not isinstance(stream, WeightedTokenStream):
            return None
        return {"mode": "auto" if self.calibration is not None else "list", "weights": list(stream.weights),
                "batch_sizes": stream.batch_sizes, "global_batch": stream.global_batch,
                "calibration": None if self.calibration is None else self.calibration.result}

    def _calibrate(self, step: int, seconds: float, waited: float | None) -> None:
        """"auto": count this step; after the last calibration step, re-split by the measured weights."""
        if self.calibration is None or self.calibration.done:
            return
        weights = self.calibration.add(step, seconds, waited, self.channel)
        if weights is None:
            return
        assert isinstance(self.train_stream, WeightedTokenStream)
        self.train_stream.reweight(weights)
        self.result.batch = self._batch_info()
        busy = self.calibration.result["busy_s_per_rank"] if self.calibration.result else []
        self.reporter.note(f"step {step}: batch weights {weights} (auto: 1 / busy seconds per rank "
                           f"{[round(b, 4) for b in busy]}), sequences per rank {self.train_stream.batch_sizes}")

    def _resume(self) -> tuple[int, str]:
        """``(step, checkpoint directory)`` to continue from; ``(0, "")`` for a fresh start."""
        if self.mesh.elastic is not None:  # healed at the optimizer: go on after the step it was healed to
            last = self.model.last_step  # None: the job's first replica (under DiLoCo, the last inner step)
            return (0 if last is None else last.step + 1), ""
        if not self.cfg.train.resume:
            return 0, ""
        return resume.resume(self.run, self.model, self.optimizer, self.channel)

    def _profiler(self) -> StepProfiler:
        end = self.cfg.train.stop_after or self.cfg.train.steps
        window = profile_window(self.start_step, end, self.cfg.train.profile_steps)
        # Elastic replicas' ranks repeat each other's numbers: their traces are named by data-parallel rank.
        rank = hsdp.data_parallel_rank(self.mesh) if self.mesh.elastic is not None else self.mesh.rank
        return StepProfiler(self.cfg.train.profile, window, self.run.profile, rank)

    @property
    def writes(self) -> bool:
        """Whether this rank's replica writes the run directory now: always, but on an elastic job only the last
        step's writer (the same on every rank of a replica)."""
        return self.pen is None or self.pen.writing

    @property
    def is_complete(self) -> bool:
        """Whether the run already reached ``train.steps`` (a resumed run that had finished)."""
        return self.start_step >= self.cfg.train.steps

    def announce(self) -> None:
        """Rank 0: the mesh, the model, the data and where the run starts."""
        if not self.channel.is_root:
            return
        self.console.print(f"hsdp train: {summary.mesh_text(self.mesh)} mesh, {self.description}", markup=False)
        self.console.print(f"data: {self.corpus.description}", markup=False)
        self.console.print(f"resumed from {self.resumed_from} (step {self.start_step})" if self.resumed_from
                           else f"run directory: {self.run.path}", markup=False)
        if self.pen is not None:
            self.console.print(self.pen.joined_text(self.start_step), markup=False)

    # -- one step -------------------------------------------------------------------------------------------
    def _forward_backward(self, step: int) -> torch.Tensor:
        """Run the step's micro-batches; returns this rank's mean loss (detached)."""
        accum = self.cfg.train.grad_accum
        total = torch.zeros((), dtype=torch.float64, device=self.mesh.device)  # summed on the device: no sync
        for micro in range(accum):
            x, y = self.train_stream.batch((step - 1) * accum + micro)  # the data position is a function of the step
            x, y = x.to(self.mesh.device), y.to(self.mesh.device)
            last = micro == accum - 1
            with contextlib.nullcontext() if last else self.model.no_sync():
                loss = self.lm.loss(self.model, x, y)
                # A batch weight averages over the ranks and micro-batches itself: backward the mean loss.
                (loss if self.weighted else loss / accum).backward()
            total += loss.detach().double()
        return total / accum

    def _optimizer_step(self, step: int) -> tuple[float, float, float, dict[str, Any]]:
        """One optimizer step; ``(this rank's loss, grad norm before clipping, seconds, DiLoCo's record fields)``
        (the last of ``train.steps`` syncs DiLoCo's replicas: ``replica_sync.sync_at_end``)."""
        start = time.perf_counter()
        set_lr(self.optimizer, lr_at(step, self.cfg.optim, self.cfg.train.steps))
        # Cleared here rather than after the step: the last step's gradients then count in the summary's
        # model-state bytes, as they occupy memory during every step.
        self.optimizer.zero_grad(set_to_none=True)
        loss = self._forward_backward(step)
        max_norm = self.cfg.optim.grad_clip or math.inf  # inf: measure the norm, scale nothing
        grad_norm = hsdp.clip_grad_norm_(self.model, max_norm)
        self.optimizer.step()
        sync = step_fields(self.cfg.parallel, self.optimizer)
        if step == self.cfg.train.steps:
            sync = sync_at_end(self.cfg.parallel, self.optimizer, sync)
        # The step's one read for the record: loss and norm in one copy, after the step (it also makes the
        # timing include the device's work).
        loss_value, norm_value = torch.stack([loss, grad_norm.double()]).tolist()
        return loss_value, norm_value, time.perf_counter() - start, sync

    def step(self, step: int, stop_requested: bool) -> tuple[dict[str, Any], bool]:
        """Run step ``step`` and measure it: its metrics record, and ``True`` when some rank asked to stop
        (the same on every rank: the request travels in the loss average)."""
        cfg = self.cfg
        self.model.reset_comm_stats()
        loss, grad_norm, seconds, sync = self._optimizer_step(step)
        comm = comm_totals(self.model.comm_stats(), waits_block=self.mesh.device.type == "cpu")
        # Each rank's mean loss weighted by its share of the global batch (1 for the even split): the mean
        # over every sequence of the step.
        stream = self.train_stream
        share = stream.batch_size / cfg.train.batch_size
        mean_loss, stop_votes = self.channel.mean([loss * share, float(stop_requested)])
        if not math.isfinite(mean_loss):
            raise FloatingPointError(f"the loss is {mean_loss} at step {step}: lower optim.lr or set optim.grad_clip")
        # world_size: the R x S data-parallel readers (a TP group reads one batch); the weighted split cuts the
        # same global batch.
        n_tokens = cfg.train.batch_size * stream.block_size * cfg.train.grad_accum * stream.world_size
        record = {"step": step, "loss": mean_loss, "eval_loss": None, "lr": lr_at(step, cfg.optim, cfg.train.steps),
                  "grad_norm": grad_norm, "tokens": step * n_tokens, "step_tokens": n_tokens, "step_s": seconds,
                  "tokens_per_s": n_tokens / max(seconds, 1e-9), **comm,
                  "mem_bytes": peak_memory_bytes(self.mesh.device), **sync}
        if self.pen is not None:  # elastic: what the coordinator decided, the batch really averaged
            record = self.pen.annotate(step, record)
        self._calibrate(step, seconds, comm["exposed_comm_s"])
        return record, stop_votes > 0

    @torch.no_grad()
    def evaluate(self) -> float:
        """Held-out loss: the same ``train.eval_batches`` batches per rank every time, averaged over them
        and the ranks."""
        self.model.eval()
        device = self.mesh.device
        losses = [self.lm.loss(self.model, *(b.to(device) for b in self.held_out.batch(i))).double().cpu()
                  for i in range(self.cfg.train.eval_batches)]
        self.model.train()
        return self.channel.mean([torch.stack(losses).mean().item()])[0]

    def after_step(self, record: dict[str, Any]) -> None:
        """Publish the step, flush warnings, checkpoint when due."""
        step, cfg = record["step"], self.cfg
        if self.writer is not None:
            self.writer.write({k: v for k, v in record.items() if k != "step_tokens"})
        note = self.pen.publish(record) if self.pen is not None else None
        if note:
            self.reporter.note(note)
        self.reporter.update(step, record["loss"], record["tokens_per_s"])
        if record["eval_loss"] is not None:
            self.reporter.note(f"step {step}: held-out loss {record['eval_loss']:.4f}")
        if step % cfg.train.log_every == 0 or step == cfg.train.steps:
            self.warnings.flush(self.channel)
        if _due(step, cfg.train.checkpoint_every, cfg.train.steps) and self.writes:
            self.checkpoint(step)
            self.reporter.note(f"step {step}: checkpoint {self.result.checkpoints[-1]}")

    def checkpoint(self, step: int) -> None:
        """Save the state after ``step`` (a collective)."""
        path = resume.save(self.run, self.model, self.optimizer, step, self.cfg.train.keep_checkpoints)
        self.result.checkpoints.append(path)
        self.result.checkpoint_step = step

    def stop(self) -> None:
        """After a SIGTERM on any rank: checkpoint the last step (unless it just was) so that ``--resume``
        continues there."""
        step = self.result.records[-1]["step"]
        if self.result.checkpoint_step != step and self.writes:  # elastic: this replica leaves; the writer saves
            self.checkpoint(step)
        self.result.stopped_by_signal = True
        saved = f"; checkpoint {self.result.checkpoints[-1]}" if self.result.checkpoint_step == step else ""
        self.reporter.note(f"step {step}: stopping on SIGTERM{saved}")

    # -- the session ----------------------------------------------------------------------------------------
    def _run_step(self, step: int, stop_requested: bool) -> bool:
        """Step, evaluate when due, publish; ``True`` when every rank stops here."""
        self.profiler.before(step)
        record, stopping = self.step(step, stop_requested)
        self.result.trace = self.profiler.after(step) or self.result.trace
        if _due(step, self.cfg.train.eval_every, self.cfg.train.steps) and self.writes:
            record["eval_loss"] = self.evaluate()
        self.result.add(record)
        self.after_step(record)
        if stopping:
            self.stop()
        return stopping

    def train(self) -> LoopResult:
        """Steps ``start_step + 1`` to ``train.steps`` (or ``train.stop_after``), or until a SIGTERM."""
        end = self.cfg.train.stop_after or self.cfg.train.steps
        if self.channel.is_root and self.pen is None:  # a resumed run keeps the records up to its checkpoint
            self.writer = MetricsWriter(self.run.path, self.start_step if self.cfg.train.resume else None,
                                        sinks=record_sinks(self.cfg, self.run.path))
        with self.reporter, self.writer or self.pen or contextlib.nullcontext():
            with StopSignals(self.cfg.train.save_on_signal) as signals:
                try:
                    for step in range(self.start_step + 1, end + 1):
                        if self._run_step(step, signals.requested):
                            break
                except QuorumLost as e:  # elastic, below the minimum: every rank of every replica
                    self._quorum_lost(e, step)
            self.result.trace = self.profiler.close() or self.result.trace
        return self.result

    def _quorum_lost(self, error: QuorumLost, current: int) -> None:
        """Stop after the last finished step, whose state every member holds alike; the replica that claims it
        checkpoints there (see :mod:`hsdp.apps.train.elastic_run`). ``current``: the train step it was raised in."""
        assert self.pen is not None and self.mesh.elastic is not None
        self.pen.quorum_lost = self.result.quorum_lost = str(error)
        self.optimizer.zero_grad(set_to_none=True)
        # Per step, train step k is elastic step k - 1, so every elastic step before the layer's is decided: the
        # last finished train step. Under DiLoCo the layer counts syncs, and the job stops in the current step's,
        # after its inner step: the weights are that step's (its syncs that committed landed; the one stopped
        # did not), so that is the step its checkpoint is of.
        step = current if is_diloco(self.cfg.parallel) else self.mesh.elastic.step
        if self.pen.claim_final() and step > 0:
            self.pen.hold()  # the lease, and the records the file lacks
            if self.result.checkpoint_step != step:
                self.checkpoint(step)
        self.result.lost_at = step

    def sample_text(self) -> str | None:
        """A continuation of ``train.sample_prompt`` (every rank takes part: each token is one forward)."""
        cfg = self.cfg.train
        if not cfg.sample_tokens:
            return None
        prompt = self.corpus.tokenizer.encode(cfg.sample_prompt) or [0]
        self.model.eval()
        device = self.mesh.device
        # Sequence parallel takes lengths divisible by T; the growing sample is padded (exact: causal).
        logits = pad_sequence_to(lambda idx: self.lm.logits(self.model, idx.to(device)), self.mesh.tp_degree)
        ids = sample(logits, prompt, cfg.sample_tokens, self.shape.block_size, seed=cfg.seed)
        self.model.train()
        return self.corpus.tokenizer.decode(ids)

    def summarize(self) -> dict[str, Any]:
        """The session's summary on every rank (rank 0 also writes ``summary.json``); a collective."""
        ranks = self.channel.gather(summary.rank_record(self.model, self.optimizer, self.result))
        out = summary.build_summary(self.cfg, self.mesh, self.n_params, self.result, ranks, self.start_step)
        if self.pen is not None:
            out["elastic"] = self.pen.summary(self.result.records)
        if self.channel.is_root and self.writes:
            summary.write_summary(self.run.summary, out)
        return out
