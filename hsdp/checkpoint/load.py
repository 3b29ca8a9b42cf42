"""``load_checkpoint``: verify, check against the model, read once per shard, broadcast to replicas.

Steps (every rank takes part in each agreement, so an error anywhere raises everywhere, never hangs):
  1. rank 0 resolves the path to candidate checkpoints (``latest``, then newest first);
  2. the ranks of replica 0 re-hash the candidate's files (each a share) against the manifest; the first
     candidate that passes is used, broken ones are skipped with a warning;
  3. rank 0 checks the checkpoint against the model and optimizer (keys, shapes, optimizer kind) and
     broadcasts a spec of what to read;
  4. the ranks of replica 0 read the tensors with DCP into fresh buffers (``process_group`` = their shard
     group, so DCP reshards to the current shard degree); replicated plain tensors are read by rank 0 only;
  5. the buffers are broadcast inside each replicate group (and plain tensors from rank 0), so replicas
     other than 0 read no checkpoint bytes at all and every byte crosses the slow links once. On a
     heterogeneous mesh (replicas of different shard degrees) a replica's chunks are not replica 0's, so
     every replica reads its own shards in step 4 (each within its shard group) and only the plain tensors
     are broadcast: each replica reads the sharded bytes once. A DiLoCo replica's own weights and inner
     optimizer state (:mod:`hsdp.checkpoint.diloco`) are read by that replica in step 4 and never broadcast;
  6. only then are the buffers loaded into the live model and optimizer (and a DiLoCo model's global copy,
     outer state and phase).
"""

from __future__ import annotations

import os
import time
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from hsdp.checkpoint.dcp_io import CheckpointReader, SafeLoadPlanner
from hsdp.checkpoint.diloco import for_replica
from hsdp.checkpoint.errors import CheckpointError
from hsdp.checkpoint.manifest import InvalidCheckpoint, verify_checksums
from hsdp.checkpoint.names import check_types
from hsdp.checkpoint.options import CheckpointOptions
from hsdp.checkpoint.resolve import Candidate, candidates, from_json, to_json
from hsdp.checkpoint.spec import build_spec
from hsdp.checkpoint.templates import Buffers, allocate, assemble
from hsdp.engine.agreement import agree, on_rank0, run_agreed
from hsdp.engine.collectives import Comm
from hsdp.engine.mesh import HSDPMesh
from hsdp.engine.model import ShardedModel
from hsdp.engine.optim.outer_checkpoint import load_outer_state_dict
from hsdp.engine.optim.sharded_optimizer import ShardedOptimizer


@dataclass(frozen=True)
class LoadResult:
    """What ``restore`` loaded: this rank's ``extra``, the directory, its step, the checkpoint bytes this
    rank read (``bytes_read``: metadata, verification and tensors; 0 on replicas other than 0 of a grid) and of
    those the tensor data DCP read (``tensor_bytes``)."""

    extra: Any
    path: str
    step: int | None
    bytes_read: int
    tensor_bytes: int
    seconds: float


def load_checkpoint(path: str | os.PathLike, model: ShardedModel, optimizer: ShardedOptimizer | None = None,
                    *, options: CheckpointOptions | None = None) -> Any:
    """Load a checkpoint into ``model`` (and ``optimizer``); returns this rank's ``extra``. A collective.

    ``path`` is a run directory (resolves ``latest``, falling back to the newest valid checkpoint with a
    warning) or one checkpoint directory (must be valid). Any mesh works: a checkpoint saved on 2x2 loads
    on 1x4, 4x1 or one process. ``extra`` is what this rank passed to ``save_checkpoint``; when the world
    size changed, rank 0's, with a warning. On any error (missing or broken files, a checkpoint of another
    model or optimizer) every rank raises ``CheckpointError`` and the model and optimizer are unchanged.
    With a DiLoCo model pass its optimizer: the global copy, outer state and phase live there (what a DiLoCo
    model loads from which checkpoint: ``hsdp.checkpoint.diloco``).
    """
    return restore(path, model, optimizer, options=options).extra


def restore(path: str | os.PathLike, model: ShardedModel, optimizer: ShardedOptimizer | None = None,
            *, options: CheckpointOptions | None = None) -> LoadResult:
    """:func:`load_checkpoint` returning a :class:`LoadResult` (extra, directory, step, bytes read)."""
    start = time.perf_counter()
    options = options or CheckpointOptions()
    check_types(model, optimizer)
    mesh = model.mesh
    comm = Comm(mesh)  # its own accounting: checkpoint traffic stays out of model.comm_stats()
    with comm.helper("hsdp.load_checkpoint"):  # every rank must call it: checked before any collective
        return _restore(comm, path, model, optimizer, options, start)


def _restore(comm: Comm, path: str | os.PathLike, model: ShardedModel, optimizer: ShardedOptimizer | None,
             options: CheckpointOptions, start: float) -> LoadResult:
    mesh = comm.mesh
    chosen, verify_bytes = _choose(comm, path, options)
    what = "load_checkpoint"
    spec = on_rank0(comm, what, lambda: build_spec(chosen, model, optimizer), CheckpointError)
    spec = for_replica(spec, mesh.replicate_rank)  # a DiLoCo replica's own state: see hsdp.checkpoint.diloco
    buffers = run_agreed(comm, what, lambda: allocate(spec, model), CheckpointError)
    metadata_bytes, tensor_bytes = run_agreed(comm, what, lambda: _read(spec, buffers, mesh), CheckpointError)
    _fan_out(comm, buffers)
    model_sd, optim_sd, outer_sd = assemble(spec, buffers, model)
    run_agreed(comm, what, lambda: _apply(model, optimizer, model_sd, optim_sd, outer_sd), CheckpointError)
    own = spec["bytes_read"] if mesh.rank == 0 else 0
    total = own + verify_bytes + metadata_bytes + tensor_bytes
    return LoadResult(_extra_for(spec, mesh), chosen.path, spec["step"], total, tensor_bytes,
                      time.perf_counter() - start)


def _choose(comm: Comm, path: str | os.PathLike, options: CheckpointOptions) -> tuple[Candidate, int]:
    """The first candidate whose files match their checksums (verified by replica 0, each rank a share)."""
    mesh = comm.mesh
    found = on_rank0(comm, "load_checkpoint", lambda: [to_json(c) for c in candidates(path)], CheckpointError)
    nbytes = 0
    for cand in map(from_json, found):
        if cand.manifest is None or options.verify != "checksum":
            return cand, nbytes
        error = None
        if mesh.replicate_rank == 0:
            mine = sorted(cand.manifest.files)[mesh.shard_rank:: mesh.sharding_degree]
            try:
                nbytes += verify_checksums(cand.path, cand.manifest, mine)
            except (InvalidCheckpoint, OSError) as e:
                error = e
        try:
            agree(comm, "load_checkpoint: verifying checksums", error, CheckpointError)
        except CheckpointError as e:
            if cand.explicit:
                raise
            if mesh.rank == 0:
                warnings.warn(f"ignoring invalid checkpoint: {e}", stacklevel=3)
            continue
        return cand, nbytes
    raise CheckpointError(f"load_checkpoint: no checkpoint in {path} passed verification (see the warnings)")


def _read(spec: dict[str, Any], buffers: Buffers, mesh: HSDPMesh) -> tuple[int, int]:
    """DCP read on replica 0 (every replica on a heterogeneous mesh): shards by every rank of its shard
    group, plain tensors by rank 0 alone; a replica's own entries (DiLoCo) by every rank of that replica.
    Returns the metadata and tensor bytes read."""
    reads_shared = mesh.replicate_rank == 0 or mesh.heterogeneous
    wanted = {k: v for k, v in buffers.values.items()
              if k in buffers.own or (reads_shared and (k in buffers.sharded or mesh.rank == 0))}
    if not wanted and not reads_shared:
        return 0, 0
    reader = CheckpointReader(spec["path"])
    dcp.load(wanted, storage_reader=reader, planner=SafeLoadPlanner(), process_group=mesh.shard_group)
    return reader.metadata_bytes, reader.data_bytes


def _flat_groups(tensors: list[torch.Tensor]) -> dict[torch.dtype, list[torch.Tensor]]:
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.dtype, []).append(t)
    return groups


def _broadcast(comm: Comm, tensors: list[torch.Tensor], group: str) -> None:
    """One broadcast per dtype of ``tensors`` packed flat, from the group's rank 0."""
    if comm.size(group) == 1:
        return
    for same in _flat_groups(tensors).values():
        flat = torch.cat([t.reshape(-1) for t in same]) if same else torch.empty(0)
        if flat.numel() == 0:
            continue
        comm.broadcast(flat, 0, group)
        offset = 0
        for t in same:
            t.copy_(flat[offset: offset + t.numel()].view_as(t))
            offset += t.numel()


def _fan_out(comm: Comm, buffers: Buffers) -> None:
    """Shards to the other replicas (replicate group; not on a heterogeneous mesh, whose replicas read their
    own), plain tensors from rank 0 to everyone."""
    keys = sorted(k for k in buffers.locals if k not in buffers.own)
    if not comm.mesh.heterogeneous:
        _broadcast(comm, [buffers.locals[k] for k in keys if k in buffers.sharded], "replicate")
    _broadcast(comm, [buffers.locals[k] for k in keys if k not in buffers.sharded], "world")


def _apply(model: ShardedModel, optimizer: ShardedOptimizer | None, model_sd: dict, optim_sd: dict | None,
           outer_sd: dict | None) -> None:
    with torch.no_grad():
        model.load_state_dict(model_sd)
    if optimizer is not None and optim_sd is not None:
        optimizer.load_state_dict(optim_sd)  # under DiLoCo the global copy is the loaded weights now
    if optimizer is not None and optimizer._hsdp_outer is not None and outer_sd is not None:
        load_outer_state_dict(optimizer._hsdp_outer, outer_sd)  # a DiLoCo checkpoint's global copy and phase


def _extra_for(spec: dict[str, Any], mesh: HSDPMesh) -> Any:
    saved = spec["extra"]
    if not isinstance(saved, dict) or "ranks" not in saved:
        return None
    ranks = saved["ranks"]
    if len(ranks) == mesh.world_size:
        return ranks[mesh.rank]
    if mesh.rank == 0 and len(set(map(repr, ranks))) > 1:
        warnings.warn(f"checkpoint saved by {len(ranks)} ranks, loaded by {mesh.world_size}: every rank gets rank "
                      f"0's extra (per-rank RNG states and data positions do not map across world sizes)",
                      stacklevel=3)
    return ranks[0]
