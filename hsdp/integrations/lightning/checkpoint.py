"""Lightning checkpoints as hsdp's sharded checkpoints, Lightning's own state inside them.

A Lightning checkpoint path (``trainer.save_checkpoint(path)``, ``ModelCheckpoint``'s files,
``fabric.save(path, state)``) becomes an hsdp run directory holding one checkpoint::

    epoch=0-step=4.ckpt/
        latest -> step_000004
        step_000004/   manifest.json, extra.json, DCP shards (model + optimizer, original names)

The model and optimizer go through ``hsdp.save_checkpoint`` (each shard written once, crash-safe, loadable on
any mesh, ``hsdp export PATH --to model.safetensors`` for a plain ``load_state_dict``). Everything else
Lightning saves (loop progress, epoch and step counters, callbacks' and LR schedulers' state, hyper-parameters;
in Fabric, every entry of ``state`` that is neither the model nor an optimizer) is rank 0's, serialised with
``torch.save`` into the checkpoint's ``extra.json``, so it is committed atomically with the shards and covered
by the manifest's checksums. Loading decodes it with ``torch.load(weights_only=...)`` as Lightning does (torch's
default, ``True``, loads tensors and plain containers only) and hands it to every rank.

The run directory's lease (``hsdp.checkpoint.lease``) is held while saving only: Lightning keeps many paths
in one folder and removes old ones itself, and a lease file left beside each would look like a checkpoint to
``ckpt_path="last"``.
"""

from __future__ import annotations

import base64
import io
import os
from typing import Any

import torch

from hsdp.checkpoint import CheckpointOptions, load_checkpoint, save_checkpoint
from hsdp.checkpoint.lease import release_lease
from hsdp.engine.collectives import Comm
from hsdp.engine.model import ShardedModel
from hsdp.engine.optim.sharded_optimizer import ShardedOptimizer
from hsdp.integrations.lightning.shared import broadcast_object

LIGHTNING_KEY = "lightning"  # the entry of extra.json holding Lightning's state


def save_lightning_checkpoint(path: str | os.PathLike, model: ShardedModel, optimizer: ShardedOptimizer | None,
                              metadata: dict[str, Any], *, step: int | None, options: CheckpointOptions) -> str:
    """Save ``model``, ``optimizer`` and rank 0's ``metadata`` into ``path``; returns the checkpoint directory.
    A collective (every rank calls it)."""
    blob = encode(metadata) if model.mesh.rank == 0 else None
    written = save_checkpoint(path, model, optimizer, extra={LIGHTNING_KEY: blob}, step=step, options=options)
    if model.mesh.rank == 0:
        release_lease(path)
    return written


def load_lightning_checkpoint(path: str | os.PathLike, model: ShardedModel, optimizer: ShardedOptimizer | None, *,
                              options: CheckpointOptions, weights_only: bool | None) -> dict[str, Any]:
    """Load ``model`` and ``optimizer`` from ``path`` (any mesh); returns Lightning's state on every rank
    (``{}`` for a checkpoint written by hsdp itself). A collective."""
    extra = load_checkpoint(path, model, optimizer, options=options)
    blob = extra.get(LIGHTNING_KEY) if isinstance(extra, dict) else None
    # Saved by rank 0 only (Lightning's state is the same on every rank): rank 0's reaches the others.
    blob = broadcast_object(Comm(model.mesh), blob, src=0)
    return {} if blob is None else decode(blob, weights_only)


def encode(metadata: dict[str, Any]) -> str:
    """``torch.save`` bytes as ASCII text, for the JSON of ``extra.json``."""
    buffer = io.BytesIO()
    torch.save(metadata, buffer)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def decode(text: str, weights_only: bool | None) -> dict[str, Any]:
    return torch.load(io.BytesIO(base64.b64decode(text)), map_location="cpu", weights_only=weights_only)
