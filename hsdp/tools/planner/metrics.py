"""What a training script reports to ``hsdp tune``: one JSON file per run, at ``$HSDP_METRICS_FILE``.

A script that trains with hsdp needs three lines to be tunable::

    recorder = hsdp.tools.planner.metrics.StepRecorder(model, optimizer, micro_batches=k, warmup=2)
    for batch in ...:
        with recorder.step():          # times the step on every rank (the slowest rank counts)
            ...forward, backward, optimizer.step()...
    recorder.write()                   # rank 0 writes $HSDP_METRICS_FILE (no-op when unset)

The file holds the measured step times, this layout's per-rank state bytes (``hsdp.state_bytes``), the
collectives hsdp issued per step, the bytes each node's link carried (on an emulated cluster), the model's
units and shapes (so ``hsdp tune`` needs no model description) and, when the script measured one, a
compute profile (:func:`profile_compute`). Every rank must call ``step()`` and ``write()`` (collectives).
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from hsdp.engine.collectives import Comm
from hsdp.engine.memory import state_bytes
from hsdp.engine.mesh import HSDPMesh
from hsdp.engine.model import ShardedModel
from hsdp.tools.planner.introspect import spec_from_module
from hsdp.tools.planner.model import ComputeProfile
from hsdp.tools.step_timing import StepTimer, peak_rss_bytes

METRICS_ENV = "HSDP_METRICS_FILE"
FORMAT = "hsdp-metrics/1"


def peak_memory_bytes(device: torch.device) -> float:
    """This process's peak memory: the CUDA allocator's on GPUs, else its peak resident set."""
    return float(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else peak_rss_bytes()


def profile_compute(mesh: HSDPMesh, forward: Callable[[], torch.Tensor], params: list[torch.nn.Parameter],
                    iters: int = 2) -> ComputeProfile:
    """Time ``forward()`` (returns the loss) and its backward on the *unwrapped* model, plus an AdamW step
    over ``params``, on every rank of ``mesh`` at once (so the timing sees the same CPU or GPU contention as
    training); the median over ``iters`` after one warm-up, the slowest rank. Leaves gradients ``None``."""
    return profile_ranks(mesh, forward, params, iters)[0]


def profile_ranks(mesh: HSDPMesh, forward: Callable[[], torch.Tensor], params: list[torch.nn.Parameter],
                  iters: int = 2) -> tuple[ComputeProfile, list[float]]:
    """:func:`profile_compute`, and every rank's own forward+backward seconds (rank order): on an unwrapped
    model no collective paces the ranks, so these tell a slow rank from a fast one on any device (the batch
    weights of :mod:`hsdp.tools.planner.balance`)."""
    comm = Comm(mesh)
    fwd, bwd = [], []
    for i in range(iters + 1):
        comm.barrier()
        t0 = time.perf_counter()
        loss = forward()
        t1 = _settled(mesh)
        loss.backward()
        t2 = _settled(mesh)
        if i:
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
    copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for c, p in zip(copies, params, strict=True):
        c.grad, p.grad = p.grad, None
    opt = torch.optim.AdamW(copies, foreach=True)
    opt.step()  # allocates the state
    comm.barrier()
    t0 = time.perf_counter()
    opt.step()
    per_element = (time.perf_counter() - t0) / max(1, sum(p.numel() for p in copies))
    rows = comm.all_gather_floats([statistics.median(fwd), statistics.median(bwd), per_element])
    return ComputeProfile(*(max(r[i] for r in rows) for i in range(3))), [r[0] + r[1] for r in rows]


def _settled(mesh: HSDPMesh) -> float:
    """``perf_counter()`` once the device has run what was queued (the kernels are the time being measured)."""
    if mesh.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def _waited(model: ShardedModel) -> float:
    """Seconds the host has been blocked in the model's collectives since its stats were reset."""
    return sum(op.get("waited", 0.0) for ops in model.comm_stats().values() for op in ops.values())


class StepRecorder:
    """Times training steps of a ShardedModel and writes the metrics file ``hsdp tune`` reads.

    ``warmup`` steps are timed but not reported (allocator and gloo warm-up). ``tokens`` is tokens per rank
    per micro-batch (``batch x seq``): with ``seq_len``/``micro_batch`` it describes the spec written.
    ``sync`` names how micro-batches synchronise (see :class:`hsdp.tools.planner.options.TrainOptions`);
    ``name`` labels the model in reports (default: its class).
    State bytes are read right after the first step, so zero gradients *before* each forward, not after
    the optimizer step, or the gradients will not be counted.

    Per rank, over the measured steps: its own wall seconds (``step_s_per_rank``, about equal on every rank,
    as the collectives pace them), its *busy* seconds (``busy_s_per_rank``: wall less the time the host was
    blocked in the model's collectives; where a wait blocks the host, i.e. on CPU ranks, else ``None``), and
    its peak memory (``peak_memory_bytes_per_rank``: the CUDA allocator's on GPUs, the resident set on CPUs),
    what :func:`hsdp.tools.planner.balance.propose_weights` reads.
    """

    def __init__(self, model: ShardedModel, optimizer: torch.optim.Optimizer | None = None, *,
                 micro_batches: int = 1, warmup: int = 2, seq_len: int = 1, micro_batch: int = 1,
                 sync: str = "deferred", name: str | None = None) -> None:
        if not isinstance(model, ShardedModel):
            raise ValueError("StepRecorder reads hsdp's units and collectives: pass the ShardedModel")
        self.model, self.optimizer = model, optimizer
        self.micro_batches, self.warmup = micro_batches, warmup
        self.seq_len, self.micro_batch, self.sync, self.name = seq_len, micro_batch, sync, name
        self._timer = StepTimer(Comm(model.mesh), warmup)  # its own Comm: timing stays out of comm_stats
        self._state: dict[str, int] | None = None
        self._own: list[tuple[float, float]] = []  # this rank's (wall, blocked) seconds per step, warm-up included

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        if self._timer.next_is_first_measured:
            self.model.reset_comm_stats()  # count the collectives of the measured steps only
        with self._timer.step():
            waited, start = _waited(self.model), time.perf_counter()
            yield
            self._own.append((time.perf_counter() - start, _waited(self.model) - waited))
        # State bytes after the first complete step: gradients and optimizer state exist, not yet zeroed.
        if self._state is None:
            self._state = state_bytes(self.model, self.optimizer).as_dict()

    def result(self, profile: ComputeProfile | None = None, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        """The metrics as a dict (a collective: every rank calls it; all get the same dict)."""
        measured = self._timer.measured
        if not measured:
            raise ValueError(f"no measured steps: run more than warmup={self.warmup} steps inside step()")
        steps = len(measured)
        state = self._state or state_bytes(self.model, self.optimizer).as_dict()
        own = self._own[self.warmup:]
        wall = statistics.median(w for w, _ in own)
        busy = statistics.median(w - b for w, b in own)
        per_rank = self._timer.comm.all_gather_floats([float(state["total"]), peak_rss_bytes(), wall, busy,
                                                       float(peak_memory_bytes(self.model.mesh.device))])
        blocks = self.model.mesh.device.type == "cpu"  # where a wait blocks the host, busy time is measured
        comm = {g: {op: {k: v / steps for k, v in s.items()} for op, s in ops.items()}
                for g, ops in self.model.comm_stats().items()}
        spec = spec_from_module(self.model, self.seq_len, self.micro_batch, name=self.name)
        mesh = self.model.mesh
        return {
            "format": FORMAT, "world_size": mesh.world_size, "sharding_degree": mesh.sharding_degree,
            "nproc_per_node": int(os.environ.get("LOCAL_WORLD_SIZE", mesh.world_size)),
            "micro_batches": self.micro_batches, "step_s": measured, "median_step_s": statistics.median(measured),
            "state_bytes": state, "state_bytes_per_rank": [r[0] for r in per_rank],
            "peak_rss_bytes_per_rank": [r[1] for r in per_rank], "step_s_per_rank": [r[2] for r in per_rank],
            "busy_s_per_rank": [r[3] for r in per_rank] if blocks else None,
            "peak_memory_bytes_per_rank": [r[4] for r in per_rank],
            "inter_node_bytes_per_step": [[b / steps for b in node] for node in self._timer.link_bytes_per_node()],
            "comm_per_step": comm,
            "model": {"name": spec.name, "seq_len": self.seq_len, "micro_batch": self.micro_batch,
                      "units": [{"name": u.name, "shapes": [list(s) for s in u.shapes],
                                 "frozen": [list(s) for s in u.frozen],
                                 "flops_per_token": u.forward_flops_per_token} for u in spec.units]},
            "profile": None if profile is None else vars(profile), "backend": dist.get_backend(),
            "options": {**_engine_options(self.model), "micro_batches": self.micro_batches, "sync": self.sync},
            **(extra or {}),
        }

    def write(self, path: str | None = None, profile: ComputeProfile | None = None,
              extra: dict[str, Any] | None = None) -> dict[str, Any]:
        """Gather the metrics and write them on rank 0 to ``path`` (default ``$HSDP_METRICS_FILE``; nothing
        is written when neither is set). Returns the metrics on every rank."""
        result = self.result(profile, extra)
        target = path or os.environ.get(METRICS_ENV)
        if target and dist.get_rank() == 0:
            with open(target, "w") as f:
                json.dump(result, f)
        return result


def _engine_options(model: ShardedModel) -> dict[str, Any]:
    """The settings the cost model needs, read off the units (:class:`hsdp.tools.planner.options.TrainOptions`)."""
    units = [u for u in model.units if u.params] or model.units
    u = units[-1]
    dtype = u.sharded_flat.dtype
    hop = type(u.hop).__name__
    hop_dtype = getattr(u.hop, "dtype", None) or u.policy.reduce(dtype)
    return {
        "reshard_after_forward": any(x.reshard_after_forward for x in units),
        "param_bytes": dtype.itemsize,
        "compute_bytes": u.policy.compute(dtype).itemsize,
        "reduce_bytes": u.policy.reduce(dtype).itemsize,
        "replicate_dtype": "int8" if "Int8" in hop else {4: "fp32", 2: "bf16"}.get(hop_dtype.itemsize, "same"),
        "shard_optimizer_across_replicas": model.shards_optimizer_across_replicas,
    }
