"""Per-step metrics of a training run: what is measured, and the files rank 0 writes them to.

One record per optimizer step, written to ``metrics.jsonl`` and ``metrics.csv`` in the run directory (and
to TensorBoard under ``tb/`` when the ``tensorboard`` package is installed, and to Weights & Biases with
``log.wandb = true``):

  ``step`` (1-based), ``loss`` (training loss averaged over the step's micro-batches and all ranks),
  ``eval_loss`` (held-out loss, on evaluation steps only), ``lr``, ``grad_norm`` (before clipping),
  ``tokens`` (in the global batches so far: the T ranks of a tensor-parallel group share one batch, counted
  once), ``step_s`` and ``tokens_per_s`` (this step, rank 0's clock), ``shard_bytes`` / ``replicate_bytes``
  (this rank's sent bytes in the intra-node shard group and the inter-node replicate group: ``wire_bytes``
  of ``model.comm_stats()``), ``shard_s`` / ``replicate_s`` (time in those collectives from issue to
  completed wait, overlapped with compute or not),
  ``exposed_comm_s`` (the time the rank waited for collectives instead of computing: measured on CPUs,
  where a wait blocks; ``None`` on GPUs, where the stream waits and the profiler trace shows it) and
  ``mem_bytes`` (peak memory so far: CUDA allocator peak on GPUs, the process's peak resident set on CPUs) and,
  with ``parallel.replica_sync = "diloco"`` only, ``synced`` (whether the step ended with the replicas' sync: its
  ``replicate_bytes`` are the sync's all-reduce, those of the other steps 0; the last of ``train.steps`` syncs
  every fragment, ``synced_all``).

On ``--resume`` the files keep the records up to the checkpoint's step and the resumed steps follow, so a
resumed run's files read like an uninterrupted run's.
"""

from __future__ import annotations

import csv
import json
import os
import resource
import sys
from collections.abc import Sequence
from typing import Any, Protocol

import torch

FIELDS = ("step", "loss", "eval_loss", "lr", "grad_norm", "tokens", "step_s", "tokens_per_s", "shard_bytes",
          "replicate_bytes", "shard_s", "replicate_s", "exposed_comm_s", "mem_bytes", "synced")
JSONL_NAME = "metrics.jsonl"
CSV_NAME = "metrics.csv"
TB_DIR = "tb"
_TB_SCALARS = ("loss", "eval_loss", "lr", "grad_norm", "tokens_per_s", "shard_bytes", "replicate_bytes",
               "mem_bytes")


def comm_totals(stats: dict[str, dict[str, dict[str, float]]], waits_block: bool = True) -> dict[str, float | None]:
    """Sent bytes and seconds per group from ``model.comm_stats()``: ``{"shard_bytes": ..., "shard_s": ...,
    "replicate_bytes": ..., "replicate_s": ..., "exposed_comm_s": ...}``. ``waits_block``: whether waiting
    for a collective blocks the host (CPU tensors); else the exposed time is not measured (``None``)."""
    out: dict[str, float | None] = {}
    for group in ("shard", "replicate"):
        ops = stats.get(group, {}).values()
        out[f"{group}_bytes"] = float(sum(op["wire_bytes"] for op in ops))
        out[f"{group}_s"] = float(sum(op["seconds"] for op in ops))
    waited = sum(op.get("waited", 0.0) for ops in stats.values() for op in ops.values())
    out["exposed_comm_s"] = float(waited) if waits_block else None
    return out


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this process: the CUDA allocator's on GPUs, else the peak resident set size."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # macOS reports bytes, Linux KiB


def read_metrics(run_dir: str) -> list[dict[str, Any]]:
    """The records of ``run_dir/metrics.jsonl`` (empty when there is none). A cut last line (its writer was
    killed while writing it) is left out."""
    path = os.path.join(run_dir, JSONL_NAME)
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        lines = [line for line in f if line.strip()]
    records = [json.loads(line) for line in lines[:-1]]
    try:
        records += [json.loads(line) for line in lines[-1:]]
    except ValueError:
        if lines[-1].endswith("\n"):  # a complete line that is not JSON: not ours to skip
            raise
    return records


def _tensorboard(log_dir: str, purge_step: int | None) -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # tensorboard is optional; JSONL and CSV carry everything
        return None
    return SummaryWriter(log_dir=log_dir, purge_step=purge_step)


class RecordSink(Protocol):
    """Another destination of the per-step records (e.g. :class:`hsdp.apps.train.wandb_sink.WandbSink`)."""

    def write(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def drop_cut_line(path: str) -> None:
    """Cut a last line that has no newline (its writer was killed while writing it) off the file ``path``."""
    try:
        f = open(path, "rb+")  # noqa: SIM115
    except FileNotFoundError:
        return
    with f:
        end = f.seek(0, os.SEEK_END)
        pos = end
        while pos > 0:  # backwards in blocks, to the last newline
            start = max(0, pos - 65536)
            f.seek(start)
            block = f.read(pos - start)
            if pos == end and block.endswith(b"\n"):
                return
            cut = block.rfind(b"\n")
            if cut >= 0:
                f.truncate(start + cut + 1)
                return
            pos = start
        f.truncate(0)


class MetricsWriter:
    """Rank 0's metric files. ``resume_step``: keep the records up to that step (``None``: start empty).
    ``sinks`` receive each new record too (not the kept ones: they had them before the interruption) and
    are closed with the files. ``fields``: the CSV's columns (an elastic run adds its own). ``append``: go on
    after the files' last line, rewriting nothing (an elastic job's next writer: a rewrite cut short by a
    crash would lose the history); a line cut by a killed writer is dropped first."""

    def __init__(self, run_dir: str, resume_step: int | None = None, sinks: Sequence[RecordSink] = (),
                 fields: Sequence[str] = FIELDS, append: bool = False) -> None:
        self._sinks = list(sinks)
        jsonl, table = os.path.join(run_dir, JSONL_NAME), os.path.join(run_dir, CSV_NAME)
        kept = []
        if append:
            for path in (jsonl, table):
                drop_cut_line(path)
        elif resume_step is not None:
            kept = [r for r in read_metrics(run_dir) if r["step"] <= resume_step]
        header = not append or not os.path.exists(table) or os.path.getsize(table) == 0
        mode = "a" if append else "w"
        self._jsonl = open(jsonl, mode, encoding="utf-8")  # noqa: SIM115
        self._csv_file = open(table, mode, encoding="utf-8", newline="")  # noqa: SIM115
        self._csv = csv.DictWriter(self._csv_file, fieldnames=fields, extrasaction="ignore")
        if header:
            self._csv.writeheader()
        for record in kept:
            self._write_files(record)
        self._tb = _tensorboard(os.path.join(run_dir, TB_DIR), None if resume_step is None else resume_step + 1)

    def _write_files(self, record: dict[str, Any]) -> None:
        self._jsonl.write(json.dumps(record) + "\n")
        self._csv.writerow(record)

    def write(self, record: dict[str, Any]) -> None:
        """Append one step's record (flushed: a killed run keeps every finished step)."""
        self._write_files(record)
        self._jsonl.flush()
        self._csv_file.flush()
        if self._tb is not None:
            for name in _TB_SCALARS:
                if record.get(name) is not None:
                    self._tb.add_scalar(f"train/{name}", record[name], record["step"])
        for sink in self._sinks:
            sink.write(record)

    def close(self) -> None:
        self._jsonl.close()
        self._csv_file.close()
        if self._tb is not None:
            self._tb.close()
        for sink in self._sinks:
            sink.close()

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
