"""Checkpoints of a training run and resuming from them, exactly.

A checkpoint (``hsdp.save_checkpoint`` into ``<run>/checkpoints``) holds the sharded model and AdamW state
and, per rank, the step and the RNG states. Nothing else is needed to continue bit for bit: the learning
rate is a function of the step (``hsdp.apps.train.optimizer.lr_at``) and the data position is the step too
(``TokenStream.batch(i)`` depends only on the seed, ``i`` and the rank).
"""

from __future__ import annotations

from typing import Any

from hsdp.apps.train.ranks import RankChannel
from hsdp.apps.train.rundir import RunDir
from hsdp.checkpoint import CheckpointOptions, capture_rng_state, restore, restore_rng_state, save_checkpoint
from hsdp.engine.model import ShardedModel
from hsdp.engine.optim.sharded_optimizer import ShardedOptimizer


def save(run: RunDir, model: ShardedModel, optimizer: ShardedOptimizer, step: int, keep: int) -> str:
    """Save the state after ``step`` steps as ``checkpoints/step_<step>``; returns its directory. A collective."""
    extra: dict[str, Any] = {"step": step, "rng": capture_rng_state()}
    return save_checkpoint(run.checkpoints, model, optimizer, extra=extra, step=step,
                           options=CheckpointOptions(keep_last=keep))


def resume(run: RunDir, model: ShardedModel, optimizer: ShardedOptimizer, channel: RankChannel) -> tuple[int, str]:
    """Load the newest valid checkpoint and this rank's RNG states; returns ``(step, directory)``, or
    ``(0, "")`` when the run has no checkpoint yet (a fresh start, so a job script under torchrun can always
    pass ``--resume``; ``hsdp train`` starting the ranks itself refuses that case before spawning them, see
    :func:`hsdp.apps.train.rundir.resume_problem`). A collective."""
    has_checkpoint = channel.broadcast(bool(run.checkpoint_steps()) if channel.is_root else None)
    if not has_checkpoint:
        return 0, ""
    loaded = restore(run.checkpoints, model, optimizer)
    extra = loaded.extra
    if isinstance(extra, dict) and "rng" in extra:
        restore_rng_state(extra["rng"])
    step = extra["step"] if isinstance(extra, dict) and "step" in extra else loaded.step
    if not isinstance(step, int):
        raise ValueError(f"checkpoint {loaded.path} records no step: resume from a checkpoint hsdp train wrote")
    return step, loaded.path
