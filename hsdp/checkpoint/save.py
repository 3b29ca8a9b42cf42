"""``save_checkpoint``: a sharded DCP save committed atomically into a run directory.

Protocol (each step ends in an agreement, so an error on one rank raises on all):
  1. rank 0 takes (or renews) the run directory's lease, refusing while another job holds it (see
     :mod:`hsdp.checkpoint.lease`), then picks the step and a temporary directory ``step_000010.tmp-<nonce>``;
  2. every rank writes with DCP: each shard once (on a grid replicas hold identical shards and DCP's planner
     keeps one copy of each, spread over the writers; on a heterogeneous mesh the replicas' chunks differ
     and replica 0's are written, see :mod:`hsdp.checkpoint.replica_planner`), files fsynced;
  3. rank 0 writes ``extra.json`` (every rank's ``extra``); the files are hashed, each rank a share;
  4. rank 0 checks that DCP's metadata references only listed files within their sizes, writes
     ``manifest.json`` (sizes, SHA-256), confirms the lease is still this job's, renames the directory to
     ``step_000010`` and only then moves ``latest`` to it, each step fsynced; finally older checkpoints
     beyond ``keep_last`` are deleted.

A crash (a rank SIGKILLed while writing, a node lost) at any point leaves a ``*.tmp-*`` directory that
loading ignores and the next successful save deletes; ``latest`` still names the previous checkpoint.
"""

from __future__ import annotations

import json
import os
import uuid
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from hsdp.checkpoint import diloco
from hsdp.checkpoint.dcp_io import METADATA, check_storage, read_metadata_file
from hsdp.checkpoint.errors import CheckpointError
from hsdp.checkpoint.lease import confirm_lease, hold_lease
from hsdp.checkpoint.manifest import MANIFEST, FileEntry, Manifest, hash_file
from hsdp.checkpoint.names import check_types, optimizer_kind, save_state, tied_aliases
from hsdp.checkpoint.options import CheckpointOptions
from hsdp.checkpoint.replica_planner import ReplicaSavePlanner, writer_degrees
from hsdp.checkpoint.resolve import is_checkpoint_dir
from hsdp.checkpoint.rundir import atomic_write, commit_dir, next_step, prune, step_dir_name, write_latest
from hsdp.checkpoint.spec import EXTRA
from hsdp.engine.agreement import on_rank0, run_agreed
from hsdp.engine.collectives import Comm
from hsdp.engine.faults.watchdog import Watchdog
from hsdp.engine.mesh import HSDPMesh
from hsdp.engine.model import ShardedModel
from hsdp.engine.optim.sharded_optimizer import ShardedOptimizer


def save_checkpoint(path: str | os.PathLike, model: ShardedModel, optimizer: ShardedOptimizer | None = None, *,
                    extra: Any = None, step: int | None = None, options: CheckpointOptions | None = None) -> str:
    """Save ``model`` (and ``optimizer``) into the run directory ``path``; returns the checkpoint directory.

    A collective: every rank calls it. The checkpoint goes to ``path/step_<step>`` (``step`` defaults to
    one more than the newest checkpoint there) and ``path/latest`` moves to it only once it is complete.
    ``extra`` is any JSON-serialisable value *per rank* (step, ``capture_rng_state()``, data position):
    ``load_checkpoint`` gives each rank back its own. JSON, not pickle, so loading never runs code. An LR
    scheduler's ``state_dict()`` is plain data and fits there too.
    Parameters and optimizer state keep their original names and shapes (FSDP2's layout, see
    ``hsdp.checkpoint.names``). Saving the same step again replaces that checkpoint.
    The first save takes the run directory's lease (``<path>.lease``, see ``hsdp.checkpoint.lease``), held
    until the process exits: another job saving there meanwhile gets a ``CheckpointError`` naming this one.
    Loading never needs the lease. A DiLoCo model's checkpoint holds every replica's weights and inner optimizer
    state, the global copy (its model weights), the outer state and the phase (``hsdp.checkpoint.diloco``).
    On an elastic mesh (``init_mesh(elastic=True)``) "every rank" is the ranks of
    one replica (its torchrun job's world), which save its state alone: the other replicas hold the same at a
    step boundary, and nothing waits for a step's quorum.
    """
    options = options or CheckpointOptions()
    check_types(model, optimizer)
    diloco.check(model, optimizer)
    comm = Comm(model.mesh)
    with comm.helper("hsdp.save_checkpoint"):  # every rank must call it: checked before any collective
        return _save(comm, path, model, optimizer, extra, step, options)


def _save(comm: Comm, path: str | os.PathLike, model: ShardedModel, optimizer: ShardedOptimizer | None,
          extra: Any, step: int | None, options: CheckpointOptions) -> str:
    mine = run_agreed(comm, "save_checkpoint", lambda: _encode_args(path, extra, step), CheckpointError)
    gathered = [json.loads(b) for b in comm.all_gather_bytes(mine)]
    if len({json.dumps(g["step"]) for g in gathered}) > 1:
        raise CheckpointError(f"save_checkpoint: ranks passed different steps {[g['step'] for g in gathered]}: "
                              f"pass the same step on every rank")
    watchdog = model.mesh.watchdog
    target = on_rank0(comm, "save_checkpoint: preparing the run directory", lambda: _prepare(path, step, watchdog),
                      CheckpointError)
    tmp = target["tmp"]
    model.reshard()  # the module must hold the sharded parameters
    # DiLoCo: every replica's weights and inner state under its own keys, the global copy in ``model``.
    state = diloco.save_state(model, optimizer) if diloco.is_diloco(optimizer) else save_state(model, optimizer)
    run_agreed(comm, f"save_checkpoint: writing {tmp}", lambda: _write(tmp, state, model.mesh), CheckpointError)
    extras = {"world_size": comm.size("world"), "ranks": [g["extra"] for g in gathered]}
    names = on_rank0(comm, "save_checkpoint: writing extra",
                     lambda: _write_extra(tmp, extras, target["nonce"]), CheckpointError)
    share = names[comm.mesh.rank:: comm.size("world")]
    hashes = run_agreed(comm, "save_checkpoint: hashing", lambda: _hash(tmp, share), CheckpointError)
    files = {k: v for b in comm.all_gather_bytes(json.dumps(hashes).encode()) for k, v in json.loads(b).items()}
    degrees = writer_degrees(model.mesh)  # an elastic replica saves alone: its own degree, no quorum wait
    manifest = Manifest(target["step"], comm.size("world"), (len(degrees), model.mesh.sharding_degree),
                        {k: FileEntry(*v) for k, v in files.items()},
                        None if optimizer is None else optimizer_kind(optimizer), tied_aliases(model), degrees)
    return on_rank0(comm, "save_checkpoint: committing", lambda: _commit(target, manifest, options), CheckpointError)


def _encode_args(path: Any, extra: Any, step: Any) -> bytes:
    if not path or not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"save_checkpoint needs a run directory path, got {path!r}")
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
        raise ValueError(f"step={step!r}: pass a non-negative int, or None for one more than the newest checkpoint")
    try:
        return json.dumps({"extra": extra, "step": step}).encode()
    except (TypeError, ValueError) as e:
        raise ValueError(f"extra must be JSON-serialisable ({e}): use dicts, lists, str, int, float, bool and None; "
                         f"tensors via .tolist(), RNG states via hsdp.capture_rng_state()") from e


def _prepare(path: str | os.PathLike, step: int | None, watchdog: Watchdog | None) -> dict[str, Any]:
    run_dir = os.path.abspath(os.fspath(path))
    if os.path.exists(run_dir) and not os.path.isdir(run_dir):
        raise ValueError(f"{run_dir} is a file: pass a directory to keep checkpoints in")
    if os.path.isdir(run_dir) and is_checkpoint_dir(run_dir):
        raise ValueError(f"{run_dir} is a checkpoint directory: pass its parent, the run directory")
    hold_lease(run_dir, watchdog=watchdog)  # before anything is written: a refused job leaves no trace
    os.makedirs(run_dir, exist_ok=True)
    step = next_step(run_dir) if step is None else step
    # A random nonce: two attempts at one step never share a directory. uuid4 reads os.urandom, so saving
    # leaves the random generators of the training loop untouched (exact resume depends on that).
    nonce = uuid.uuid4().hex[:12]
    final = os.path.join(run_dir, step_dir_name(step))
    tmp = f"{final}.tmp-{nonce}"
    os.makedirs(tmp)
    return {"run_dir": run_dir, "step": step, "final": final, "tmp": tmp, "nonce": nonce}


def _write(tmp: str, state: dict[str, Any], mesh: HSDPMesh) -> None:
    # One chunk layout per key (replica_planner.py): on a heterogeneous mesh the replicas' chunks overlap.
    dcp.save(state, storage_writer=FileSystemWriter(tmp, sync_files=True), planner=ReplicaSavePlanner(mesh))


def _write_extra(tmp: str, extras: dict[str, Any], nonce: str) -> list[str]:
    atomic_write(os.path.join(tmp, EXTRA), json.dumps(extras).encode(), nonce)
    return sorted(n for n in os.listdir(tmp) if n != MANIFEST)


def _hash(tmp: str, names: list[str]) -> dict[str, tuple[int, str]]:
    out = {}
    for name in names:
        entry, _ = hash_file(os.path.join(tmp, name))
        out[name] = (entry.size, entry.sha256)
    return out


def _commit(target: dict[str, Any], manifest: Manifest, options: CheckpointOptions) -> str:
    tmp, final = target["tmp"], target["final"]
    if METADATA not in manifest.files:
        raise ValueError(f"{tmp}: DCP wrote no {METADATA}: the save did not complete")
    metadata, _ = read_metadata_file(os.path.join(tmp, METADATA))
    check_storage(metadata, {n: e.size for n, e in manifest.files.items()}, tmp)
    atomic_write(os.path.join(tmp, MANIFEST), manifest.to_json(), target["nonce"])
    confirm_lease(target["run_dir"])  # taken over while writing: the other job's directory now, commit nothing
    commit_dir(tmp, final, target["nonce"])
    write_latest(target["run_dir"], os.path.basename(final), target["nonce"])
    prune(target["run_dir"], options.keep_last, keep=os.path.basename(final))
    return final
