"""Tensor-parallel parameters at wrap time: what torch's ``parallelize_module`` left, checked and described.

hsdp composes with torch's tensor parallelism the way FSDP2 does on a 2-D mesh: the user parallelizes the
model's layers with ``torch.distributed.tensor.parallel.parallelize_module`` on ``mesh.tp_mesh`` (their
parameters become DTensors ``Shard(d)`` or ``Replicate()`` on it), then wraps it with ``ShardedModel``, which
shards each rank's TP-local tensor in dim-0 chunks over the shard group and all-gathers / reduces only in the
shard and replicate groups (``layout.py``'s ``TPSplit``). Parameters left plain on a 3-D mesh are replicated
across the tp ranks (``Replicate()`` on the tp dim).

Everything here runs before the first collective of wrapping, so a bad model fails on every rank at once.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from hsdp.engine.mesh import HSDPMesh
from hsdp.engine.runtime.layout import TPSplit


def tp_split(param: nn.Parameter, mesh: HSDPMesh) -> TPSplit | None:
    """How tensor parallelism split ``param`` on ``mesh`` (``None`` on a 2-D mesh); see :func:`check_tp_params`."""
    if not mesh.has_tp:
        return None
    if not isinstance(param, DTensor):
        return TPSplit(Replicate(), tuple(param.shape), mesh.tp_degree, mesh.tp_rank)
    placement = param.placements[0]
    if isinstance(placement, Shard) and placement.dim < 0:
        placement = Shard(placement.dim + param.dim())
    return TPSplit(placement, tuple(param.shape), mesh.tp_degree, mesh.tp_rank)


def check_tp_params(named: list[tuple[str, nn.Parameter]], mesh: HSDPMesh) -> None:
    """Refuse, naming the fix, DTensor parameters hsdp cannot shard: any on a 2-D mesh, any not on the mesh's
    tp sub-mesh, and placements other than one ``Shard(d)`` or ``Replicate()``."""
    for name, p in named:
        if not isinstance(p, DTensor):
            continue
        if not mesh.has_tp:
            raise ValueError(
                f"parameter {name!r} is already a DTensor (placements {tuple(p.placements)}): for tensor "
                f"parallelism build the mesh with hsdp.init_mesh(sharding_degree=S, tensor_parallel_degree=T) "
                f"and parallelize the model on mesh.tp_mesh before wrapping; otherwise pass plain tensors")
        if p.device_mesh != mesh.tp_mesh:
            raise ValueError(
                f"parameter {name!r} is a DTensor on {p.device_mesh}, not on this mesh's tp sub-mesh "
                f"{mesh.tp_mesh}: call parallelize_module(model, mesh.tp_mesh, plan) with the HSDPMesh you wrap with")
        placement = p.placements[0]
        if not isinstance(placement, Shard | Replicate) or type(placement) not in (Shard, Replicate):
            raise ValueError(
                f"parameter {name!r} has tp placement {placement}: hsdp shards parameters that tensor "
                f"parallelism split with Shard(d) or kept Replicate() (ColwiseParallel, RowwiseParallel, "
                f"SequenceParallel, ...)")
