"""Sharded, resumable, crash-safe checkpoints on ``torch.distributed.checkpoint`` (DCP).

::

    hsdp.save_checkpoint("runs/a", model, opt, extra={"step": step, "rng": hsdp.capture_rng_state()})
    extra = hsdp.load_checkpoint("runs/a", model, opt)      # latest valid checkpoint, any mesh
    hsdp.restore_rng_state(extra["rng"])

* Format: DCP with FSDP2's layout (``{"model": ..., "optim": ...}``, original names and shapes), so
  checkpoints move between hsdp and FSDP2 both ways, and reshard to any replicate x shard mesh.
* Crash safety: written into a temporary directory, committed by rename after a manifest with sizes and
  SHA-256 of every file; ``latest`` moves last. See :mod:`hsdp.checkpoint.save`.
* Loading reads each shard once (replica 0) and broadcasts it to the other replicas. See
  :mod:`hsdp.checkpoint.load`.
* No arbitrary code runs on load: see :mod:`hsdp.checkpoint.dcp_io` for how DCP's pickled metadata is
  handled. ``extra`` is stored as JSON.
* ``export_safetensors`` / ``hsdp export``: consolidated weights for plain ``load_state_dict``.
* ``ReplicaSavePlanner(mesh)``: the DCP save planner ``save_checkpoint`` uses; pass it to a direct
  ``dcp.save`` of an hsdp model on a heterogeneous mesh (``init_mesh([2, 1])``), whose replicas' chunks
  overlap. See :mod:`hsdp.checkpoint.replica_planner`.
"""

from hsdp.checkpoint.errors import CheckpointError
from hsdp.checkpoint.export import export_safetensors, load_safetensors
from hsdp.checkpoint.load import LoadResult, load_checkpoint, restore
from hsdp.checkpoint.options import CheckpointOptions
from hsdp.checkpoint.replica_planner import ReplicaSavePlanner
from hsdp.checkpoint.rng import capture_rng_state, restore_rng_state
from hsdp.checkpoint.save import save_checkpoint

__all__ = [
    "CheckpointError",
    "CheckpointOptions",
    "LoadResult",
    "ReplicaSavePlanner",
    "capture_rng_state",
    "export_safetensors",
    "load_checkpoint",
    "load_safetensors",
    "restore",
    "restore_rng_state",
    "save_checkpoint",
]
