"""The replicate x shard (x tp) process mesh: which ranks shard together, which replicate, which split layers.

Rank layout: with world size W and sharding degree S, replica ``r`` is the row of consecutive ranks
``[r*S, (r+1)*S)``. torchrun numbers the ranks of one node consecutively, so with ``S`` equal to the ranks
per node every shard group stays inside a node (fast links) and every replicate group spans the nodes
(one rank per node, slow links).

With tensor parallelism of degree T the mesh is 3-D, ``(R, S, T)`` row-major: the T ranks of one tensor-
parallel group are adjacent (the fastest links, TP's activation traffic is on the critical path), shard
groups stride over them inside the node, and replicate groups span the nodes. The T ranks of one group read
the same batch: the data-parallel size is R x S.
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from hsdp.engine.faults.launcher import watch_launcher
from hsdp.engine.faults.watchdog import FaultPolicy, Watchdog, start_watchdog
from hsdp.engine.hop_worker import HopWorker

MESH_DIM_NAMES = ("replicate", "shard")
TP_MESH_DIM_NAMES = ("replicate", "shard", "tp")
# Read when sharding_degree is None; set per candidate layout by `hsdp tune`.
SHARDING_DEGREE_ENV = "HSDP_SHARDING_DEGREE"
DEFAULT_TIMEOUT = timedelta(minutes=10)
DEFAULT_FAULT_POLICY = FaultPolicy()


# ---------------------------------------------------------------------------------------------------------
# Pure rank-grid arithmetic (no processes needed).
# ---------------------------------------------------------------------------------------------------------
def validate_degree(world_size: int, sharding_degree: int) -> None:
    """Raise ``ValueError`` naming the fix when ``sharding_degree`` cannot tile ``world_size``."""
    if not isinstance(sharding_degree, int) or isinstance(sharding_degree, bool):
        raise ValueError(f"sharding_degree must be an int, got {sharding_degree!r}")
    if sharding_degree < 1:
        raise ValueError(
            f"sharding_degree={sharding_degree} is below 1: use 1 for plain replication (DDP) "
            f"or the number of ranks per node for HSDP"
        )
    if sharding_degree > world_size:
        raise ValueError(
            f"sharding_degree={sharding_degree} is larger than the world size {world_size}: "
            f"use at most {world_size} (full sharding)"
        )
    if world_size % sharding_degree:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ValueError(
            f"world size {world_size} is not divisible by sharding_degree={sharding_degree}: "
            f"choose one of {divisors}"
        )


def validate_tp_degree(world_size: int, sharding_degree: int, tp_degree: int, ranks_per_node: int,
                       allow_cross_node_shards: bool = False) -> None:
    """Raise ``ValueError`` naming the fix when ``(sharding_degree, tp_degree)`` cannot tile ``world_size``
    with tensor-parallel groups inside a node (TP's activation traffic needs the fast links) and, unless
    ``allow_cross_node_shards``, with shard groups inside a node too (``S x T <= ranks per node``)."""
    if not isinstance(tp_degree, int) or isinstance(tp_degree, bool) or tp_degree < 1:
        raise ValueError(f"tensor_parallel_degree must be an int >= 1, got {tp_degree!r}")
    if ranks_per_node % tp_degree:
        fits = [d for d in range(1, ranks_per_node + 1) if ranks_per_node % d == 0]
        raise ValueError(f"tensor_parallel_degree={tp_degree} does not divide the {ranks_per_node} ranks per node: "
                         f"a tensor-parallel group must lie inside one node; choose one of {fits}")
    if world_size % tp_degree:
        raise ValueError(f"world size {world_size} is not divisible by tensor_parallel_degree={tp_degree}")
    validate_degree(world_size // tp_degree, sharding_degree)
    if sharding_degree * tp_degree > ranks_per_node and not allow_cross_node_shards:
        fit = max(1, ranks_per_node // tp_degree)
        raise ValueError(f"sharding_degree={sharding_degree} x tensor_parallel_degree={tp_degree} is more than the "
                         f"{ranks_per_node} ranks per node, so shard groups would cross the slow links: use "
                         f"sharding_degree={fit}, or pass allow_cross_node_shards=True to init_mesh if you mean it")


def rank_grid(world_size: int, sharding_degree: int) -> list[list[int]]:
    """Global ranks as ``R`` rows (replicas) of ``S`` consecutive ranks (one shard group each)."""
    validate_degree(world_size, sharding_degree)
    s = sharding_degree
    return [list(range(r * s, (r + 1) * s)) for r in range(world_size // s)]


def grid_position(rank: int, sharding_degree: int) -> tuple[int, int]:
    """``(replicate_rank, shard_rank)`` of a global rank."""
    return divmod(rank, sharding_degree)


def ranks_per_node(world_size: int, env: Mapping[str, str] | None = None) -> int:
    """torchrun's ``LOCAL_WORLD_SIZE``, else the local GPU count, else the world (at most the world)."""
    env = os.environ if env is None else env
    if "LOCAL_WORLD_SIZE" in env:
        local = int(env["LOCAL_WORLD_SIZE"])
    elif torch.cuda.is_available():
        local = torch.cuda.device_count()
    else:
        local = world_size
    # A node can hold fewer ranks than it has GPUs; never exceed the world.
    return max(1, min(local, world_size))


def default_sharding_degree(world_size: int, env: Mapping[str, str] | None = None) -> int:
    """``$HSDP_SHARDING_DEGREE`` when set (how ``hsdp tune`` tries each layout without editing the script),
    else ranks per node: torchrun's ``LOCAL_WORLD_SIZE``, else the local GPU count, else the world."""
    env = os.environ if env is None else env
    if env.get(SHARDING_DEGREE_ENV):
        return _degree_from_env(env[SHARDING_DEGREE_ENV], world_size)
    local = ranks_per_node(world_size, env)
    if world_size % local:
        warnings.warn(f"{local} ranks per node do not divide the world size {world_size}: falling back to "
                      f"sharding_degree=1 (plain replication); pass sharding_degree= to choose", stacklevel=3)
        return 1
    return local


def node_crossing_warning(world_size: int, sharding_degree: int, ranks_per_node: int) -> str | None:
    """Why shard groups of ``sharding_degree`` straddle nodes of ``ranks_per_node`` consecutive ranks, naming
    the degrees that do not; ``None`` when every group lies within one node or spans whole nodes.

    A group spanning whole nodes (``S`` a multiple of the ranks per node) is a deliberate choice that ``hsdp
    plan`` may recommend; a group holding part of a node and part of the next (2 nodes x 3 ranks, ``S=2``:
    ranks 2 and 3) sends every all-gather and reduce-scatter over the slow link, unlike its neighbours.
    """
    s, local = sharding_degree, ranks_per_node
    if world_size <= local or local % s == 0 or s % local == 0:
        return None
    start = next(r * s for r in range(world_size // s) if (r * s) // local != ((r + 1) * s - 1) // local)
    aligned = [d for d in range(1, world_size + 1) if world_size % d == 0 and (local % d == 0 or d % local == 0)]
    fix = local if local in aligned else 1  # ranks per node, unless uneven nodes make it invalid
    return (f"sharding_degree={s} puts ranks of different nodes in one shard group (ranks {start}..{start + s - 1} "
            f"span nodes {start // local} and {(start + s - 1) // local} with {local} ranks per node, from "
            f"LOCAL_WORLD_SIZE): their all-gathers and reduce-scatters cross the slow link. Pass "
            f"sharding_degree={fix} to init_mesh or set {SHARDING_DEGREE_ENV}={fix}; any of {aligned} keeps "
            f"groups within a node or spanning whole nodes")


def device_type_for(backend: str, cuda_available: bool) -> str:
    """The device the mesh's tensors live on, from the process group's backend: ``"cuda"`` when CUDA tensors
    would go through NCCL (``"nccl"``, a backend map such as ``"cpu:gloo,cuda:nccl"``, or a default group
    whose backend is still ``"undefined"``) and a GPU is present, else ``"cpu"`` (an explicit ``"gloo"`` keeps
    CPU tensors even on a GPU machine)."""
    backend = backend.lower()
    wants_gpu = "nccl" in backend or backend in ("", "undefined")
    return "cuda" if cuda_available and wants_gpu else "cpu"


def _degree_from_env(text: str, world_size: int) -> int:
    # A bad value must fail on every rank before any collective, like a bad argument would.
    try:
        degree = int(text)
    except ValueError:
        raise ValueError(f"{SHARDING_DEGREE_ENV}={text!r} is not an integer: set it to a divisor of the world "
                         f"size {world_size}, or unset it for ranks per node") from None
    validate_degree(world_size, degree)
    return degree


# ---------------------------------------------------------------------------------------------------------
# The mesh object passed to every layer.
# ---------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class HSDPMesh:
    """A ``DeviceMesh`` with dims ``("replicate", "shard")``, or ``("replicate", "shard", "tp")`` with tensor
    parallelism, and the groups hsdp communicates in.

    ``shard_group`` holds the ranks that split each parameter (all-gather and reduce-scatter run there);
    ``replicate_group`` holds the ranks that own the same shard on other nodes (the gradient all-reduce
    runs there); ``tp_group`` (3-D only) holds the ranks that split each layer (torch's tensor parallelism,
    ``parallelize_module`` on ``device_mesh["tp"]``); hsdp itself never communicates in it except to finish
    a tensor-parallel gradient.

    Sharded parameters live on :attr:`param_mesh`, this rank's replica only (see
    ``docs/design/replicate_layer.md``): the replicate dim is hsdp's, not a DTensor dim.
    """

    device_mesh: DeviceMesh
    # This process's fault watchdog (started by init_mesh unless fault_policy=None); engine parts that
    # need it (collective bookkeeping, periodic checks) reach it through the mesh, never a global.
    watchdog: Watchdog | None = field(default=None, compare=False, repr=False)
    # CPUs: the thread that issues inter-node hops behind their reduce-scatters (hop_worker.py). Per mesh, so
    # that every model on the mesh keeps one order of the inter-node group's collectives.
    hop_worker: HopWorker = field(default_factory=HopWorker, compare=False, repr=False)

    @property
    def device(self) -> torch.device:
        if self.device_mesh.device_type == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device(self.device_mesh.device_type)

    @functools.cached_property
    def param_mesh(self) -> DeviceMesh:
        """The mesh of this rank's replica, on which every sharded parameter, gradient and optimizer-state
        DTensor lives: 1-D ``("shard",)``, or 2-D ``("shard", "tp")`` with tensor parallelism (FSDP2's 2-D
        layout). Global shapes, ``numel()``, norms and ``full_tensor()`` are then those of the replica, which
        after the inter-node hop holds the same values as every other replica."""
        # cached_property writes the instance __dict__ directly, which a frozen dataclass allows; one submesh
        # object keeps DTensor's mesh comparisons cheap.
        return self.device_mesh["shard", "tp"] if self.has_tp else self.device_mesh["shard"]

    @property
    def shard_group(self) -> dist.ProcessGroup:
        return self.device_mesh.get_group("shard")

    @property
    def replicate_group(self) -> dist.ProcessGroup:
        return self.device_mesh.get_group("replicate")

    @property
    def has_tp(self) -> bool:
        """Whether the mesh has a ``"tp"`` dim (3-D), even of size 1."""
        return self.device_mesh.ndim == 3

    @property
    def tp_group(self) -> dist.ProcessGroup | None:
        """The tensor-parallel group (``None`` on a 2-D mesh)."""
        return self.device_mesh.get_group("tp") if self.has_tp else None

    @property
    def tp_mesh(self) -> DeviceMesh | None:
        """The 1-D ``"tp"`` sub-mesh to give ``parallelize_module`` (``None`` on a 2-D mesh)."""
        return self.device_mesh["tp"] if self.has_tp else None

    @property
    def sharding_degree(self) -> int:
        return self.device_mesh.size(1)

    @property
    def replicate_degree(self) -> int:
        return self.device_mesh.size(0)

    @property
    def tp_degree(self) -> int:
        return self.device_mesh.size(2) if self.has_tp else 1

    @property
    def shard_rank(self) -> int:
        return self.device_mesh.get_local_rank("shard")

    @property
    def replicate_rank(self) -> int:
        return self.device_mesh.get_local_rank("replicate")

    @property
    def tp_rank(self) -> int:
        return self.device_mesh.get_local_rank("tp") if self.has_tp else 0

    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def world_size(self) -> int:
        return self.replicate_degree * self.sharding_degree * self.tp_degree

    @property
    def data_parallel_size(self) -> int:
        """Ranks reading distinct data: R x S (the T ranks of a tensor-parallel group read the same batch)."""
        return self.replicate_degree * self.sharding_degree

    @property
    def data_parallel_rank(self) -> int:
        """Shards split parameters, not the batch: every (replica, shard) position reads distinct data."""
        return self.replicate_rank * self.sharding_degree + self.shard_rank

    def __repr__(self) -> str:
        tp = f", tp={self.tp_degree}" if self.has_tp else ""
        return (
            f"HSDPMesh(replicate={self.replicate_degree}, shard={self.sharding_degree}{tp}, "
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


def _init_process_group(timeout: timedelta) -> None:
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise ValueError(
            f"no process group is initialised and the torchrun environment is missing {missing}: "
            f"launch with `torchrun --nproc-per-node G script.py` (or `hsdp launch`), or call "
            f"torch.distributed.init_process_group() before building the mesh"
        )
    kwargs = process_group_kwargs(torch.cuda.is_available(), os.environ)
    if "device_id" in kwargs:
        torch.cuda.set_device(kwargs["device_id"])
    dist.init_process_group(timeout=timeout, **kwargs)


def process_group_kwargs(cuda_available: bool, env: Mapping[str, str]) -> dict[str, Any]:
    """``init_process_group`` arguments when hsdp initialises the default group: NCCL with a GPU, else gloo.
    On NCCL with torchrun's ``LOCAL_RANK``, ``device_id`` binds the rank's GPU at init (NCCL then creates its
    communicator eagerly on that device instead of guessing one at the first collective)."""
    if not cuda_available:
        return {"backend": "gloo"}
    if "LOCAL_RANK" not in env:
        return {"backend": "nccl"}
    return {"backend": "nccl", "device_id": torch.device("cuda", int(env["LOCAL_RANK"]))}


def init_mesh(
    sharding_degree: int | None = None,
    *,
    tensor_parallel_degree: int | None = None,
    allow_cross_node_shards: bool = False,
    device_mesh: DeviceMesh | None = None,
    timeout: timedelta = DEFAULT_TIMEOUT,
    fault_policy: FaultPolicy | None = DEFAULT_FAULT_POLICY,
) -> HSDPMesh:
    """Build the replicate x shard mesh (x tp with ``tensor_parallel_degree``), initialising the default
    process group when needed.

    ``sharding_degree`` defaults to ``$HSDP_SHARDING_DEGREE`` when set (``hsdp tune`` sets it per candidate
    layout), else to the ranks per node (divided by ``tensor_parallel_degree``), which keeps all-gather and
    reduce-scatter on the fast intra-node links. An explicit argument always wins over the variable. ``1`` is
    plain replication (DDP semantics); the world size is full sharding.
    ``tensor_parallel_degree=T`` (``None``: no tp dim) builds a 3-D mesh ``("replicate", "shard", "tp")`` with
    the T ranks of a tensor-parallel group adjacent; T must divide the ranks per node, and S x T may exceed
    them only with ``allow_cross_node_shards=True``. Parallelize the model's layers on ``mesh.tp_mesh`` with
    ``torch.distributed.tensor.parallel.parallelize_module`` (e.g. ``hsdp.tp_plans``) before wrapping it.
    Every check runs before any collective, so a bad value fails on every rank instead of hanging. A degree
    whose shard groups straddle nodes (torchrun's ``LOCAL_WORLD_SIZE`` ranks per node) warns, naming the
    override (:func:`node_crossing_warning`).
    ``fault_policy`` starts the dead-rank watchdog (see ``hsdp.engine.faults.watchdog``); ``None`` disables it.
    """
    if device_mesh is not None:
        mesh = mesh_from_device_mesh(device_mesh)
        check_degree_agrees(sharding_degree, mesh)
        if tensor_parallel_degree is not None and tensor_parallel_degree != mesh.tp_degree:
            raise ValueError(f"tensor_parallel_degree={tensor_parallel_degree} disagrees with the DeviceMesh's "
                             f"tp dim ({mesh.tp_degree}): pass only one of them")
        if fault_policy is None:
            return mesh
        watchdog = start_watchdog(fault_policy)
        watch_launcher(watchdog)
        return HSDPMesh(mesh.device_mesh, watchdog)
    if not dist.is_initialized():
        world_size = int(os.environ.get("WORLD_SIZE", "0")) or None
        if world_size is not None and (sharding_degree is not None or tensor_parallel_degree is not None):
            mesh_shape(world_size, sharding_degree, tensor_parallel_degree, allow_cross_node_shards)
        _init_process_group(timeout)
    shape = mesh_shape(dist.get_world_size(), sharding_degree, tensor_parallel_degree, allow_cross_node_shards)
    device_type = device_type_for(str(dist.get_backend()), torch.cuda.is_available())
    if device_type == "cuda" and "LOCAL_RANK" in os.environ:
        # Also when the caller created the process group: each rank's collectives and tensors on its own GPU.
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    watchdog = start_watchdog(fault_policy) if fault_policy is not None else None
    watch_launcher(watchdog)  # a rank whose launcher dies ends too (hsdp.engine.faults.launcher)
    names = MESH_DIM_NAMES if len(shape) == 2 else TP_MESH_DIM_NAMES
    return HSDPMesh(init_device_mesh(device_type, shape, mesh_dim_names=names), watchdog)


def mesh_shape(world_size: int, sharding_degree: int | None, tp_degree: int | None,
               allow_cross_node_shards: bool = False, env: Mapping[str, str] | None = None) -> tuple[int, ...]:
    """``(R, S)``, or ``(R, S, T)`` when ``tp_degree`` is given, validated (``ValueError`` naming the fix);
    warns when shard groups straddle nodes. Pure: the ranks per node come from ``env`` (default the process's)."""
    env = os.environ if env is None else env
    local = int(env.get("LOCAL_WORLD_SIZE", world_size))
    if tp_degree is None:
        degree = default_sharding_degree(world_size, env) if sharding_degree is None else sharding_degree
        validate_degree(world_size, degree)
        crossing = node_crossing_warning(world_size, degree, local)
        if crossing:  # a warning, not an error: it runs, only slower than the same degree aligned to nodes
            warnings.warn(crossing, stacklevel=3)
        return (world_size // degree, degree)
    local = ranks_per_node(world_size, env)
    validate_tp_degree(world_size, sharding_degree or 1, tp_degree, local, allow_cross_node_shards)
    if sharding_degree is None:
        from_env = env.get(SHARDING_DEGREE_ENV)
        sharding_degree = _degree_from_env(from_env, world_size // tp_degree) if from_env \
            else max(1, local // tp_degree)
        validate_tp_degree(world_size, sharding_degree, tp_degree, local, allow_cross_node_shards)
    return (world_size // (sharding_degree * tp_degree), sharding_degree, tp_degree)


def check_degree_agrees(sharding_degree: int | None, mesh: HSDPMesh) -> None:
    """A ``sharding_degree`` given next to a mesh must be the mesh's (before any collective)."""
    if sharding_degree is not None and sharding_degree != mesh.sharding_degree:
        raise ValueError(f"sharding_degree={sharding_degree} disagrees with the mesh's shard dim "
                         f"({mesh.sharding_degree}): pass only one of them")
