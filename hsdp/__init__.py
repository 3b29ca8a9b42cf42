"""hsdp: Hybrid Sharded Data Parallel training for PyTorch.

Parameters, gradients and optimizer state are sharded across the ranks of a node (fast links) and the
sharded model is replicated across nodes (slow links)::

    import hsdp
    mesh = hsdp.init_mesh()                      # reads the torchrun environment
    model = hsdp.ShardedModel(model, mesh=mesh)  # shard degree = ranks per node
    opt = hsdp.ShardedOptimizer(model, torch.optim.AdamW(model.parameters(), lr=3e-4))
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from hsdp.engine.class_swap import register_extensions as _register_extensions

# The framework classes whose own methods a wrapped model replaces: a wrapped Hugging Face or PEFT model's
# ``save_pretrained(dir)``, called on every rank, gathers the shards and rank 0 writes. Strings, imported only
# when such a model is wrapped (see [Note: class extensions] in hsdp/engine/class_swap.py, which imports nothing).
_register_extensions({
    "transformers:PreTrainedModel": "hsdp.integrations.hf_folder:PreTrainedSave",
    "peft:PeftModel": "hsdp.integrations.peft:PeftSave",
})

# The public names, each from the module that defines it. They are imported on first use (PEP 562), so
# `import hsdp` and the command line's torch-free subcommands (`hsdp version`, `hsdp plan`, `--help`) do not
# pay for importing torch.
_EXPORTS = {
    "CheckpointError": "hsdp.checkpoint",
    "CheckpointOptions": "hsdp.checkpoint",
    "capture_rng_state": "hsdp.checkpoint",
    "export_safetensors": "hsdp.checkpoint",
    "load_checkpoint": "hsdp.checkpoint",
    "restore_rng_state": "hsdp.checkpoint",
    "save_checkpoint": "hsdp.checkpoint",
    "ReplicaSavePlanner": "hsdp.checkpoint",
    "clip_grad_norm_": "hsdp.engine.clip",
    "data_parallel_rank": "hsdp.data.sampler",
    "data_parallel_size": "hsdp.data.sampler",
    "distributed_sampler": "hsdp.data.sampler",
    "WeightedBatchSampler": "hsdp.data.weighted_sampler",
    "StateBytes": "hsdp.engine.memory",
    "state_bytes": "hsdp.engine.memory",
    "HSDPMesh": "hsdp.engine.mesh",
    "init_mesh": "hsdp.engine.mesh_init",
    "rank_grid": "hsdp.engine.mesh_layout",
    "ShardedModel": "hsdp.engine.model",
    "ShardedOptimizer": "hsdp.engine.optim.sharded_optimizer",
    "ShardedGradScaler": "hsdp.engine.optim.grad_scaler",
    "MixedPrecision": "hsdp.engine.policy",
    "AllReduceHop": "hsdp.engine.hops",
    "Int8ErrorFeedbackHop": "hsdp.engine.hops",
    "ReplicaHop": "hsdp.engine.hops",
    "ReplicaDivergence": "hsdp.engine.replicas",
    "check_replicas": "hsdp.engine.model",
    "full_state_dict": "hsdp.engine.state_dict",
    "FaultPolicy": "hsdp.engine.faults.watchdog",
    "ElasticPolicy": "hsdp.engine.replicate.elastic.protocol",
    "DiLoCo": "hsdp.engine.replica_sync",
    "QuorumLost": "hsdp.engine.replicate.elastic.client",
    "PreemptionGuard": "hsdp.engine.preemption",
    "load_pretrained": "hsdp.engine.init",
    "materialize": "hsdp.engine.init",
}
# Public submodules (``hsdp.tp_plans.gpt_plan``), imported on first use like the names above; not in
# __all__, which lists the classes and functions.
_SUBMODULES = {
    "tp_plans": "hsdp.models.tp_plans",
}

if TYPE_CHECKING:
    from hsdp.checkpoint import (
        CheckpointError,
        CheckpointOptions,
        ReplicaSavePlanner,
        capture_rng_state,
        export_safetensors,
        load_checkpoint,
        restore_rng_state,
        save_checkpoint,
    )
    from hsdp.data.sampler import data_parallel_rank, data_parallel_size, distributed_sampler
    from hsdp.data.weighted_sampler import WeightedBatchSampler
    from hsdp.engine.clip import clip_grad_norm_
    from hsdp.engine.faults.policy import FaultPolicy
    from hsdp.engine.hops import AllReduceHop, Int8ErrorFeedbackHop, ReplicaHop
    from hsdp.engine.init import load_pretrained, materialize
    from hsdp.engine.memory import StateBytes, state_bytes
    from hsdp.engine.mesh import HSDPMesh
    from hsdp.engine.mesh_init import init_mesh
    from hsdp.engine.mesh_layout import rank_grid
    from hsdp.engine.model import ShardedModel, check_replicas
    from hsdp.engine.optim.grad_scaler import ShardedGradScaler
    from hsdp.engine.optim.sharded_optimizer import ShardedOptimizer
    from hsdp.engine.policy import MixedPrecision
    from hsdp.engine.preemption import PreemptionGuard
    from hsdp.engine.replica_sync import DiLoCo
    from hsdp.engine.replicas import ReplicaDivergence
    from hsdp.engine.replicate.elastic.client import QuorumLost
    from hsdp.engine.replicate.elastic.protocol import ElasticPolicy
    from hsdp.engine.state_dict import full_state_dict
    from hsdp.models import tp_plans as tp_plans


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        value = importlib.import_module(_SUBMODULES[name])
    elif name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    else:
        raise AttributeError(f"module 'hsdp' has no attribute {name!r}")
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS, *_SUBMODULES})


__version__ = "0.1.0"

__all__ = [
    "AllReduceHop",
    "CheckpointError",
    "CheckpointOptions",
    "DiLoCo",
    "ElasticPolicy",
    "FaultPolicy",
    "HSDPMesh",
    "Int8ErrorFeedbackHop",
    "MixedPrecision",
    "PreemptionGuard",
    "QuorumLost",
    "ReplicaDivergence",
    "ReplicaHop",
    "ReplicaSavePlanner",
    "ShardedGradScaler",
    "ShardedModel",
    "ShardedOptimizer",
    "StateBytes",
    "WeightedBatchSampler",
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
    "load_pretrained",
    "materialize",
    "rank_grid",
    "restore_rng_state",
    "save_checkpoint",
    "state_bytes",
]
