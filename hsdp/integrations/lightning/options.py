"""What both Lightning strategies share: hsdp's settings, validated when the strategy is built, and the two
steps that use them, building the mesh and wrapping the model.

Every check here runs in the strategy's constructor, before Lightning has started any process group, so a
bad value fails the same way on every rank instead of hanging one of them in a collective.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from hsdp.checkpoint import CheckpointOptions
from hsdp.engine.faults.policy import FaultPolicy
from hsdp.engine.hops import ReplicaHop
from hsdp.engine.init import materialize
from hsdp.engine.mesh import MESH_DIM_NAMES, TP_MESH_DIM_NAMES, HSDPMesh
from hsdp.engine.mesh_init import DEFAULT_FAULT_POLICY, DEFAULT_TIMEOUT, init_mesh
from hsdp.engine.model import ShardedModel
from hsdp.engine.policy import MixedPrecision, check_policies
from hsdp.engine.wrap import WrapPolicy

# The dims of the mesh Lightning's ModelParallelStrategy builds: data_parallel does not say which ranks
# share a node (shard) and which span nodes (replicate), so hsdp cannot take it.
LIGHTNING_DIM_NAMES = ("data_parallel", "tensor_parallel")
# A Lightning checkpoint path is one checkpoint: Lightning's ModelCheckpoint decides which paths to keep, so
# each path (an hsdp run directory) keeps only its newest save (the previous one is deleted once it is
# committed: overwriting ``last.ckpt`` stays crash-safe).
DEFAULT_CHECKPOINT_OPTIONS = CheckpointOptions(keep_last=1)


@dataclass(frozen=True)
class HSDPOptions:
    """hsdp's settings for a Lightning strategy (see ``HSDPStrategy`` for each one's meaning)."""

    sharding_degree: int | None = None
    tensor_parallel_degree: int | None = None
    mixed_precision: MixedPrecision | None = None
    replica_hop: ReplicaHop | None = None
    shard_optimizer_across_replicas: bool = False
    wrap: WrapPolicy = None
    reshard_after_forward: bool = True
    device_mesh: DeviceMesh | None = None
    fault_policy: FaultPolicy | None = DEFAULT_FAULT_POLICY
    timeout: timedelta = DEFAULT_TIMEOUT
    checkpoint_options: CheckpointOptions = DEFAULT_CHECKPOINT_OPTIONS

    def __post_init__(self) -> None:
        for name in ("sharding_degree", "tensor_parallel_degree"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"HSDPStrategy({name}={value!r}): pass a positive int, or None for hsdp's default "
                                 f"(ranks per node)")
        check_policies(self.mixed_precision, self.replica_hop, where="HSDPStrategy")
        if not isinstance(self.checkpoint_options, CheckpointOptions):
            raise ValueError("HSDPStrategy(checkpoint_options=...): pass an hsdp.CheckpointOptions")
        if self.device_mesh is not None:
            check_device_mesh(self.device_mesh, self.sharding_degree, self.tensor_parallel_degree)


def check_device_mesh(device_mesh: object, sharding_degree: int | None, tp_degree: int | None) -> None:
    """``ValueError`` naming the fix for a mesh hsdp cannot use (Lightning's own, in particular)."""
    if not isinstance(device_mesh, DeviceMesh):
        raise ValueError(f"HSDPStrategy(device_mesh=...) takes a torch DeviceMesh, got {type(device_mesh).__name__}")
    names = tuple(device_mesh.mesh_dim_names or ())
    if names == LIGHTNING_DIM_NAMES:
        raise ValueError(
            "HSDPStrategy(device_mesh=...) got Lightning's ('data_parallel', 'tensor_parallel') mesh, which does not "
            "say which ranks share a node: drop device_mesh and pass HSDPStrategy(sharding_degree=S, "
            "tensor_parallel_degree=T) (S = ranks per node / T keeps shard groups in a node), or build the mesh with "
            "init_device_mesh(device_type, (R, S), mesh_dim_names=('replicate', 'shard')) (or (R, S, T) with "
            "('replicate', 'shard', 'tp'))")
    if names not in (MESH_DIM_NAMES, TP_MESH_DIM_NAMES):
        raise ValueError(f"HSDPStrategy(device_mesh=...) needs mesh_dim_names {MESH_DIM_NAMES} or {TP_MESH_DIM_NAMES}, "
                         f"got {names or None}: build it with init_device_mesh(..., mesh_dim_names=('replicate', "
                         f"'shard')), or drop device_mesh and pass sharding_degree=")
    if sharding_degree is not None or tp_degree is not None:
        raise ValueError("HSDPStrategy: pass either device_mesh or sharding_degree/tensor_parallel_degree, not both")


def build_mesh(options: HSDPOptions) -> HSDPMesh:
    """hsdp's mesh over the process group Lightning set up (a collective: every rank calls it)."""
    return init_mesh(options.sharding_degree, tensor_parallel_degree=options.tensor_parallel_degree,
                     device_mesh=options.device_mesh, timeout=options.timeout, fault_policy=options.fault_policy)


def same_mesh(a: HSDPMesh, b: HSDPMesh) -> bool:
    """The same mesh object, or two hsdp meshes over one ``DeviceMesh`` (``init_mesh(device_mesh=...)`` by the user
    and by the strategy). A heterogeneous mesh has no ``DeviceMesh`` (``None`` for every one of them): only the
    object itself is the same mesh."""
    return a is b or (a.device_mesh is not None and a.device_mesh is b.device_mesh)


def wrap_module(module: nn.Module, mesh: HSDPMesh, options: HSDPOptions,
                precision: MixedPrecision | None) -> ShardedModel:
    """``hsdp.ShardedModel`` over ``module`` with the strategy's settings; a module built on the meta device
    (``fabric.init_module(empty_init=True)``, ``trainer.init_module(empty_init=True)``) is then materialised by
    its modules' ``reset_parameters()`` (the same seed on every rank, as hsdp checks). Idempotent: a module that
    is already a ShardedModel (a second ``trainer.fit``) is returned as it is."""
    if isinstance(module, ShardedModel):
        if not same_mesh(module.mesh, mesh):
            raise ValueError(f"{type(module).__name__} is already a ShardedModel on another mesh: build a fresh model "
                             f"for this strategy, or reuse the strategy that wrapped it")
        return module
    model = ShardedModel(module, mesh=mesh, wrap=options.wrap, reshard_after_forward=options.reshard_after_forward,
                         mixed_precision=precision, replica_hop=options.replica_hop,
                         shard_optimizer_across_replicas=options.shard_optimizer_across_replicas)
    if any(p.device.type == "meta" for p in model.parameters()):
        materialize(model)
    return model
