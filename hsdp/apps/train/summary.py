"""The end-of-run summary of ``hsdp train``: throughput, memory per rank, bytes per step per group.

Every rank contributes one record (:func:`rank_record`); rank 0 prints three tables and writes them to
``summary.json``. Communication is per optimizer step: ``shard`` is the intra-node group (all-gather,
reduce-scatter), ``replicate`` the inter-node group (the gradient hop). Per node, the replicate bytes of
the node's ranks add up to the HSDP floor ``2(R-1)/R x P x b`` for a plain all-reduce (P parameters of b
bytes on the wire, R replicas; with the optimizer sharded across replicas ``(R-1)/R x P x (b + 4)``), shown
next to the measurement (slightly above it: chunk padding and one flag per parameter ride along).

With tensor parallelism (``parallel.tensor_parallel`` T > 1, an R x S x T mesh) a node holds S x T ranks, each
sending its shard of its TP-local tensors (and a 1/T piece of the parameters every TP rank holds whole), so the
node's S x T records still add up to the same floor with P the model's total parameter count. Tensor
parallelism's own activation traffic (torch's collectives inside the blocks) is not in hsdp's counts.
"""

from __future__ import annotations

import json
import os
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

import hsdp
from hsdp.apps.train.config import RunConfig
from hsdp.apps.train.config_replica_sync import is_diloco, sync_floor
from hsdp.apps.train.metrics import peak_memory_bytes
from hsdp.apps.train.replica_sync import summary_fields
from hsdp.apps.train.result import LoopResult

_WIRE_BYTES = {"fp32": 4, "bf16": 2}  # per element on the inter-node hop; int8 has no closed form here


def rank_record(model: hsdp.ShardedModel, optimizer: hsdp.ShardedOptimizer, result: LoopResult) -> dict[str, Any]:
    """This rank's place in the mesh, model-state bytes, peak memory and bytes per step (the median step)."""
    mesh = model.mesh
    node = int(os.environ.get("GROUP_RANK", mesh.replicate_rank))  # torchrun's node rank
    return {"rank": mesh.rank, "node": node, "shard": mesh.shard_rank, "tp": mesh.tp_rank,
            **hsdp.state_bytes(model, optimizer).as_dict(), "peak_bytes": peak_memory_bytes(mesh.device),
            "shard_bytes_per_step": result.bytes_per_step("shard"),
            "replicate_bytes_per_step": result.bytes_per_step("replicate")}


def mesh_text(mesh: hsdp.HSDPMesh) -> str:
    """``"2 x 2"`` (replicas x shards), ``"2 x 2 x 2"`` (x tensor-parallel ranks) when T > 1, ``"[2, 1]"`` (each
    replica's shard degree) for replicas of different sizes."""
    if mesh.elastic is not None:
        return f"elastic {replica_count(mesh)} x {mesh.sharding_degree} (replica {mesh.elastic.replica_id})"
    if mesh.heterogeneous:
        return str(list(mesh.replicas.degrees))
    tp = f" x {mesh.tp_degree}" if mesh.tp_degree > 1 else ""
    return f"{mesh.replicate_degree} x {mesh.sharding_degree}{tp}"


def replica_count(mesh: hsdp.HSDPMesh) -> int:
    """R: the mesh's replicas; an elastic job's configured ones (never its live members, which would wait for a
    step's quorum)."""
    return mesh.elastic.configured if mesh.elastic is not None else mesh.replicate_degree


def inter_node_floor(cfg: RunConfig, n_params: int, replicas: int) -> float | None:
    """``2(R-1)/R x P x b``: the inter-node bytes one node sends per step with a plain all-reduce hop (P: all the
    model's parameters, whatever tensor parallelism splits: a node holds all of them); with
    ``parallel.shard_optimizer_across_replicas`` ``(R-1)/R x P x (b + 4)``: a reduce-scatter in the hop dtype (the
    int8 hop's: ``b = 1 + 4/256``), then an all-gather of the stepped slices in the parameter dtype (fp32 shards);
    with ``parallel.replica_sync = "diloco"`` one all-reduce of the weights per H = ``diloco_every`` steps, in the
    DiLoCo wire dtype: ``2(R-1)/R x P x b / H``, the mean step's (int8 all-gathers: ``(R-1) x P x (1 + 4/256)
    / H``)."""
    if is_diloco(cfg.parallel):
        return sync_floor(cfg.parallel.diloco_wire_dtype, replicas, n_params) / cfg.parallel.diloco_every
    wire = _WIRE_BYTES.get(cfg.parallel.replica_hop)
    if cfg.parallel.replica_hop == "int8" and cfg.parallel.shard_optimizer_across_replicas:
        wire = 1 + 4 / hsdp.Int8ErrorFeedbackHop().block_size  # its reduce-scatter: int8 blocks, one fp32 scale each
    if wire is None:
        return None  # the all-gathering int8 hop's bytes grow with R: no floor
    if cfg.parallel.mixed_precision == "bf16" and cfg.parallel.replica_hop == "fp32":
        wire = 2  # the hop inherits bf16 from the reduce dtype
    if cfg.parallel.shard_optimizer_across_replicas:
        return (replicas - 1) / replicas * n_params * (wire + 4)
    return 2 * (replicas - 1) / replicas * n_params * wire


def node_records(ranks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per node: its ranks' bytes per step added up."""
    nodes: dict[int, dict[str, Any]] = {}
    for r in ranks:
        n = nodes.setdefault(r["node"], {"node": r["node"], "ranks": 0, "shard_bytes_per_step": 0.0,
                                         "replicate_bytes_per_step": 0.0})
        n["ranks"] += 1
        n["shard_bytes_per_step"] += r["shard_bytes_per_step"]
        n["replicate_bytes_per_step"] += r["replicate_bytes_per_step"]
    return [nodes[k] for k in sorted(nodes)]


def build_summary(cfg: RunConfig, mesh: hsdp.HSDPMesh, n_params: int, result: LoopResult,
                  ranks: list[dict[str, Any]], start_step: int) -> dict[str, Any]:
    """The JSON-serialisable summary (what ``summary.json`` holds)."""
    losses = [r["loss"] for r in result.records if r.get("committed", True)]  # elastic: trained steps only
    evals = [r["eval_loss"] for r in result.records if r["eval_loss"] is not None]
    return {
        "mesh": {"replicas": replica_count(mesh), "shards": mesh.sharding_degree, "world": mesh.world_size,
                 **({"shard_degrees": list(mesh.replicas.degrees)} if mesh.heterogeneous else {}),
                 **({"tp": mesh.tp_degree} if mesh.tp_degree > 1 else {})},
        "model": {"preset": cfg.model.preset, "kind": cfg.model.kind, "params": n_params,
                  **({"path": cfg.model.path} if cfg.model.path else {})},
        "steps": {"first": start_step + 1, "last": start_step + result.steps, "planned": cfg.train.steps},
        "loss_first": losses[0] if losses else None, "loss_last": losses[-1] if losses else None,
        "eval_loss_last": evals[-1] if evals else None,
        "tokens": result.tokens, "seconds": result.seconds,
        "tokens_per_s": result.tokens / result.seconds if result.seconds else 0.0,
        "ranks": ranks, "nodes": node_records(ranks),
        "inter_node_floor_bytes_per_step": inter_node_floor(cfg, n_params, replica_count(mesh)),
        "checkpoints": result.checkpoints, "trace": result.trace,
        "batch_weights": result.batch, **summary_fields(cfg, result.records, n_params, mesh),
    }


def mib(n: float) -> str:
    """A summary table's MiB column: bytes as ``1,234.56``."""
    return f"{n / 2**20:,.2f}"


def kib(n: float) -> str:
    """A summary table's KiB column: bytes as ``1,234.5``."""
    return f"{n / 2**10:,.1f}"


def run_table(summary: dict[str, Any], data: str) -> Table:
    t = Table(title="hsdp train", show_header=False)
    t.add_column(style="bold")
    t.add_column()
    m, s = summary["mesh"], summary["steps"]
    tp = f" x {m['tp']} tensor-parallel" if m.get("tp", 1) > 1 else ""
    shards = f"{m['shard_degrees']} shards" if "shard_degrees" in m else f"{m['shards']} shards"
    t.add_row("mesh", Text(f"{m['replicas']} replicas x {shards}{tp} ({m['world']} ranks)"))
    model = summary["model"]
    # An hf folder's path names the model (its preset is unused); Text: a path may contain "[...]".
    t.add_row("model", Text(f"{model['kind']} '{model.get('path') or model['preset']}', {model['params']:,} "
                            f"parameters"))
    t.add_row("data", Text(data))  # Text: a path may contain "[...]", which rich would read as markup
    t.add_row("steps", f"{s['first']}..{s['last']} of {s['planned']}")
    if summary["loss_first"] is not None:
        t.add_row("train loss", f"{summary['loss_first']:.3f} -> {summary['loss_last']:.3f}")
    if summary["eval_loss_last"] is not None:
        t.add_row("held-out loss", f"{summary['eval_loss_last']:.3f} (last evaluation)")
    t.add_row("throughput", f"{summary['tokens_per_s']:,.0f} tokens/s ({summary['tokens']:,} tokens in "
                            f"{summary['seconds']:.1f} s of steps)")
    batch = summary.get("batch_weights")
    if batch:
        how = "measured (auto)" if batch["mode"] == "auto" else "configured"
        if batch["mode"] == "auto" and not batch["calibration"]:
            how = "auto, not calibrated (the run ended first): even"
        t.add_row("batch weights", f"{batch['weights']} {how}; sequences per rank {batch['batch_sizes']}")
    elastic = summary.get("elastic")
    if elastic:
        members = ", ".join(f"{m['step']}: {m['replicas']}" for m in elastic["membership"])
        t.add_row("elastic", f"{elastic['committed']} steps committed, {len(elastic['discarded'])} discarded "
                             f"{elastic['discarded']}; members from step {members}")
    return t


def rank_table(ranks: list[dict[str, Any]]) -> Table:
    t = Table(title="Per rank (MiB; KiB sent per step)")
    tp = any(r.get("tp", 0) for r in ranks)  # a tp column only on an R x S x T mesh
    for name in ("rank", "node", "shard", *(("tp",) if tp else ()), "params", "grads", "optim", "peak mem",
                 "intra", "inter"):
        t.add_column(name, justify="right", no_wrap=True)
    for r in sorted(ranks, key=lambda r: r["rank"]):
        t.add_row(str(r["rank"]), str(r["node"]), str(r["shard"]), *((str(r["tp"]),) if tp else ()),
                  mib(r["params"]), mib(r["grads"]), mib(r["optimizer"]), mib(r["peak_bytes"]),
                  kib(r["shard_bytes_per_step"]), kib(r["replicate_bytes_per_step"]))
    return t


def _steps_text(steps: list[int]) -> str:
    return ", ".join(map(str, steps[:6])) + (", ..." if len(steps) > 6 else "") if steps else "none"


def node_table(summary: dict[str, Any]) -> Table:
    floor = summary["inter_node_floor_bytes_per_step"]
    caption = "" if floor is None else f"inter-node floor (see inter_node_floor) = {kib(floor)} KiB per node"
    sync = summary.get("replica_sync")
    if sync:  # DiLoCo: the per-step columns are means over the session
        caption += (f"; DiLoCo: {kib(sync['inter_node_floor_bytes_per_sync'])} KiB per sync, one every "
                    f"{sync['every']} steps (synced after steps {_steps_text(sync['synced_steps'])})")
    t = Table(title="Per node and step (KiB)", caption=caption)
    for name in ("node", "ranks", "intra-node (shard)", "inter-node (replicate)"):
        t.add_column(name, justify="right", no_wrap=True)
    for n in summary["nodes"]:
        t.add_row(str(n["node"]), str(n["ranks"]), kib(n["shard_bytes_per_step"]),
                  kib(n["replicate_bytes_per_step"]))
    return t


def print_summary(console: Console, summary: dict[str, Any], data: str) -> None:
    console.print(run_table(summary, data))
    console.print(rank_table(summary["ranks"]))
    console.print(node_table(summary))


def write_summary(path: str, summary: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=1)
