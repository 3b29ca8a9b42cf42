"""The replicate x shard (x tp) process mesh: which ranks shard together, which replicate, which split layers.

Rank layout: with world size W and sharding degree S, replica ``r`` is the row of consecutive ranks
``[r*S, (r+1)*S)``. torchrun numbers the ranks of one node consecutively, so with ``S`` equal to the ranks
per node every shard group stays inside a node (fast links) and every replicate group spans the nodes
(one rank per node, slow links).

With tensor parallelism of degree T the mesh is 3-D, ``(R, S, T)`` row-major: the T ranks of one tensor-
parallel group are adjacent (the fastest links, TP's activation traffic is on the critical path), shard
groups stride over them inside the node, and replicate groups span the nodes. The T ranks of one group read
the same batch: the data-parallel size is R x S.

Replicas of different shard degrees (``sharding_degree=[4, 2, 2]``, nodes of different sizes or memory) form
no grid: each replica is its own 1-D shard mesh (2-D ``("shard", "tp")`` with tensor parallelism: replica
``q`` is then the ``d_q x T`` consecutive ranks after the previous replicas', tp ranks adjacent as on a grid),
and hsdp's replicate layer (``replicate/``) reduces gradients across them, per tp coordinate.

This module is the mesh object the engine passes around; ``mesh_init.py`` builds it (``init_mesh``: the
process group, the checks before any collective, the elastic admission). The pure arithmetic of degrees lives
in ``mesh_layout.py`` and ``replicate/degrees.py``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from hsdp.engine.faults.watchdog import Watchdog
from hsdp.engine.hop_worker import HopWorker
from hsdp.engine.replicate.elastic.layer import ElasticLayer
from hsdp.engine.replicate.fixed import FixedLayer, grid_layer

MESH_DIM_NAMES = ("replicate", "shard")
TP_MESH_DIM_NAMES = ("replicate", "shard", "tp")


@dataclass(frozen=True)
class HSDPMesh:
    """The ranks hsdp communicates among: replicas of sharded ranks (and tensor-parallel ranks).

    A *grid* mesh is a ``DeviceMesh`` with dims ``("replicate", "shard")``, or ``("replicate", "shard", "tp")``
    with tensor parallelism; a *heterogeneous* one (``init_mesh(sharding_degree=[2, 1])``) has replicas of
    different shard degrees and no grid (``device_mesh`` is ``None``). Both are described by :attr:`replicas`
    (``replicate/layer.py``), which the runtime reads; see ``docs/design/replicate_layer.md``.

    ``shard_group`` holds the ranks that split each parameter (all-gather and reduce-scatter run there);
    on a grid ``replicate_group`` holds the ranks that own the same shard on other nodes (the gradient
    all-reduce runs there; a heterogeneous mesh reduces pieces over the layer's groups instead); ``tp_group``
    (3-D only) holds the ranks that split each layer (torch's tensor parallelism, ``parallelize_module`` on
    ``device_mesh["tp"]``); hsdp itself never communicates in it except to finish a tensor-parallel gradient.

    Sharded parameters live on :attr:`param_mesh`, this rank's replica only: the replicate dim is hsdp's, not
    a DTensor dim.
    """

    device_mesh: DeviceMesh | None
    # This process's fault watchdog (started by init_mesh unless fault_policy=None); engine parts that
    # need it (collective bookkeeping, periodic checks) reach it through the mesh, never a global.
    watchdog: Watchdog | None = field(default=None, compare=False, repr=False)
    # CPUs: the thread that issues inter-node hops behind their reduce-scatters (hop_worker.py). Per mesh, so
    # that every model on the mesh keeps one order of the inter-node group's collectives.
    hop_worker: HopWorker = field(default_factory=HopWorker, compare=False, repr=False)
    # Set for a heterogeneous or elastic mesh; a grid's layer is derived from its DeviceMesh (replicas).
    layer: FixedLayer | ElasticLayer | None = field(default=None, compare=False, repr=False)

    @functools.cached_property
    def replicas(self) -> FixedLayer | ElasticLayer:
        """The replicas (their shard degrees), this rank's place among them, and the groups of one rank per
        replica that reduce gradients across them."""
        # cached_property writes the instance __dict__ directly, which a frozen dataclass allows.
        if self.layer is not None:
            return self.layer
        assert self.device_mesh is not None
        return grid_layer(self.device_mesh)

    @property
    def heterogeneous(self) -> bool:
        """Whether the replicas differ in shard degree (no ``DeviceMesh`` grid describes the mesh)."""
        return not self.replicas.regular

    @property
    def elastic(self) -> ElasticLayer | None:
        """The elastic replicate layer (``init_mesh(elastic=True)``: replicas that leave and rejoin), else None."""
        return self.replicas if isinstance(self.replicas, ElasticLayer) else None

    @property
    def device(self) -> torch.device:
        """This rank's device: the current CUDA device on a CUDA mesh, else the CPU."""
        if self.param_mesh.device_type == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device(self.param_mesh.device_type)

    @property
    def param_mesh(self) -> DeviceMesh:
        """The mesh of this rank's replica, on which every sharded parameter, gradient and optimizer-state
        DTensor lives: 1-D ``("shard",)``, or 2-D ``("shard", "tp")`` with tensor parallelism (FSDP2's 2-D
        layout). Global shapes, ``numel()``, norms and ``full_tensor()`` are then those of the replica, which
        after the inter-node hop holds the same values as every other replica, whatever its size."""
        return self.replicas.param_mesh

    @property
    def shard_group(self) -> dist.ProcessGroup:
        """The process group of this rank's replica: the ranks that split each parameter (all-gather,
        reduce-scatter)."""
        return self.replicas.shard_group

    @property
    def replicate_group(self) -> dist.ProcessGroup:
        """The grid's ``"replicate"`` group (the same shard rank of every replica)."""
        if self.device_mesh is None:
            raise RuntimeError("a heterogeneous mesh has no single replicate group: reduce across replicas over "
                               "mesh.replicas' piece groups (hsdp does; this is a bug if hsdp asked)")
        return self.device_mesh.get_group("replicate")

    @property
    def _tp_owner(self) -> DeviceMesh | None:
        """The mesh whose ``"tp"`` dim holds this rank's tensor-parallel group: the 3-D grid's, or on replicas of
        different shard degrees this replica's own ``("shard", "tp")`` mesh; ``None`` without tensor parallelism."""
        if self.device_mesh is not None:
            return self.device_mesh if self.device_mesh.ndim == 3 else None
        replica = self.replicas.param_mesh
        return replica if replica.ndim == 2 else None

    @property
    def has_tp(self) -> bool:
        """Whether the mesh has a ``"tp"`` dim (3-D, or 2-D replica meshes), even of size 1."""
        return self._tp_owner is not None

    @property
    def tp_group(self) -> dist.ProcessGroup | None:
        """The tensor-parallel group (``None`` without a tp dim)."""
        owner = self._tp_owner
        return owner.get_group("tp") if owner is not None else None

    @property
    def tp_mesh(self) -> DeviceMesh | None:
        """The 1-D ``"tp"`` sub-mesh to give ``parallelize_module`` (``None`` without a tp dim)."""
        owner = self._tp_owner
        return owner["tp"] if owner is not None else None

    @property
    def sharding_degree(self) -> int:
        """This rank's replica's shard degree (the same for every replica on a grid)."""
        return self.replicas.degree

    @property
    def replicate_degree(self) -> int:
        """The number of replicas."""
        return self.replicas.count

    @property
    def tp_degree(self) -> int:
        """The tensor-parallel degree T (1 without a tp dim)."""
        owner = self._tp_owner
        return owner.size(owner.ndim - 1) if owner is not None else 1

    @property
    def shard_rank(self) -> int:
        """This rank's index in its shard group: which dim-0 chunk of every parameter it holds."""
        return self.replicas.shard_rank

    @property
    def replicate_rank(self) -> int:
        """This rank's replica's index (replicas in rank order)."""
        return self.replicas.index

    @property
    def tp_rank(self) -> int:
        """This rank's index in its tensor-parallel group (0 without a tp dim)."""
        owner = self._tp_owner
        return owner.get_local_rank("tp") if owner is not None else 0

    @property
    def rank(self) -> int:
        """This rank's global rank in the process group."""
        return dist.get_rank()

    @property
    def world_size(self) -> int:
        """The ranks of the process group (an elastic mesh: of this replica's own job)."""
        return dist.get_world_size()

    @property
    def data_parallel_size(self) -> int:
        """Ranks reading distinct data: every replica's ranks (the T ranks of a tensor-parallel group read the
        same batch): R x S on a grid; the configured replicas' on an elastic mesh."""
        return self.replicas.data_parallel_size

    @property
    def data_parallel_rank(self) -> int:
        """Shards split parameters, not the batch: every (replica, shard) position reads distinct data; a
        replica's ranks follow the previous replicas' (``replicate_rank x S + shard_rank`` on a grid)."""
        return self.replicas.start + self.shard_rank

    def __repr__(self) -> str:
        tp = f", tp={self.tp_degree}" if self.has_tp else ""
        shard = list(self.replicas.degrees) if self.heterogeneous else self.sharding_degree
        return (
            f"HSDPMesh(replicate={self.replicate_degree}, shard={shard}{tp}, "
            f"rank={self.rank}, device={self.device})"
        )


def mesh_from_device_mesh(device_mesh: DeviceMesh) -> HSDPMesh:
    """Accept a user's 2-D ``DeviceMesh`` named ``("replicate", "shard")`` or 3-D one named ``("replicate",
    "shard", "tp")``."""
    names = tuple(device_mesh.mesh_dim_names or ())
    if names not in (MESH_DIM_NAMES, TP_MESH_DIM_NAMES) or device_mesh.ndim != len(names):
        raise ValueError(
            f"expected a DeviceMesh with mesh_dim_names={MESH_DIM_NAMES} (or {TP_MESH_DIM_NAMES} with tensor "
            f"parallelism), got ndim={device_mesh.ndim} and names={names or None}: build it with "
            f"init_device_mesh(device_type, (R, S), mesh_dim_names=('replicate', 'shard')) or "
            f"(R, S, T) with ('replicate', 'shard', 'tp'), or use hsdp.init_mesh"
        )
    return HSDPMesh(device_mesh)


def check_degree_agrees(sharding_degree: int | None, mesh: HSDPMesh) -> None:
    """A ``sharding_degree`` given next to a mesh must be the mesh's (before any collective)."""
    if sharding_degree is not None and sharding_degree != mesh.sharding_degree:
        raise ValueError(f"sharding_degree={sharding_degree} disagrees with the mesh's shard dim "
                         f"({mesh.sharding_degree}): pass only one of them")
