"""hsdp: Hybrid Sharded Data Parallel training for PyTorch.

Parameters, gradients and optimizer state are sharded across the ranks of a node (fast links) and the
sharded model is replicated across nodes (slow links)::

    import hsdp
    mesh = hsdp.init_mesh()                      # reads the torchrun environment
    model = hsdp.ShardedModel(model, mesh=mesh)  # shard degree = ranks per node
    opt = hsdp.ShardedOptimizer(model, torch.optim.AdamW(model.parameters(), lr=3e-4))
"""

from hsdp.checkpoint import (
    CheckpointError,
    CheckpointOptions,
    capture_rng_state,
    export_safetensors,
    load_checkpoint,
    restore_rng_state,
    save_checkpoint,
)
from hsdp.clip import clip_grad_norm_
from hsdp.data import data_parallel_rank, data_parallel_size, distributed_sampler
from hsdp.memory import StateBytes, state_bytes
from hsdp.mesh import HSDPMesh, init_mesh, rank_grid
from hsdp.model import ShardedModel
from hsdp.optim import ShardedOptimizer
from hsdp.policy import MixedPrecision
from hsdp.replicas import ReplicaDivergence, check_replicas
from hsdp.state_dict import full_state_dict
from hsdp.watchdog import FaultPolicy

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "CheckpointOptions",
    "FaultPolicy",
    "HSDPMesh",
    "MixedPrecision",
    "ReplicaDivergence",
    "ShardedModel",
    "ShardedOptimizer",
    "StateBytes",
    "capture_rng_state",
    "check_replicas",
    "clip_grad_norm_",
    "data_parallel_rank",
    "data_parallel_size",
    "distributed_sampler",
    "export_safetensors",
    "full_state_dict",
    "init_mesh",
    "load_checkpoint",
    "rank_grid",
    "restore_rng_state",
    "save_checkpoint",
    "state_bytes",
]
