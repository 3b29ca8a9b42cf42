"""The replicate x shard process mesh: which ranks shard together and which replicate.

Rank layout: with world size W and sharding degree S, replica ``r`` is the row of consecutive ranks
``[r*S, (r+1)*S)``. torchrun numbers the ranks of one node consecutively, so with ``S`` equal to the ranks
per node every shard group stays inside a node (fast links) and every replicate group spans the nodes
(one rank per node, slow links).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from hsdp.engine.faults.launcher import watch_launcher
from hsdp.engine.faults.watchdog import FaultPolicy, Watchdog, start_watchdog

MESH_DIM_NAMES = ("replicate", "shard")
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


def rank_grid(world_size: int, sharding_degree: int) -> list[list[int]]:
    """Global ranks as ``R`` rows (replicas) of ``S`` consecutive ranks (one shard group each)."""
    validate_degree(world_size, sharding_degree)
    s = sharding_degree
    return [list(range(r * s, (r + 1) * s)) for r in range(world_size // s)]


def grid_position(rank: int, sharding_degree: int) -> tuple[int, int]:
    """``(replicate_rank, shard_rank)`` of a global rank."""
    return divmod(rank, sharding_degree)


def default_sharding_degree(world_size: int, env: Mapping[str, str] | None = None) -> int:
    """``$HSDP_SHARDING_DEGREE`` when set (how ``hsdp tune`` tries each layout without editing the script),
    else ranks per node: torchrun's ``LOCAL_WORLD_SIZE``, else the local GPU count, else the world."""
    env = os.environ if env is None else env
    if env.get(SHARDING_DEGREE_ENV):
        return _degree_from_env(env[SHARDING_DEGREE_ENV], world_size)
    if "LOCAL_WORLD_SIZE" in env:
        local = int(env["LOCAL_WORLD_SIZE"])
    elif torch.cuda.is_available():
        local = torch.cuda.device_count()
    else:
        local = world_size
    # A node can hold fewer ranks than it has GPUs; never exceed the world or break divisibility.
    local = max(1, min(local, world_size))
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
    """A 2-D ``DeviceMesh`` with dims ``("replicate", "shard")`` and the groups hsdp communicates in.

    ``shard_group`` holds the ranks that split each parameter (all-gather and reduce-scatter run there);
    ``replicate_group`` holds the ranks that own the same shard on other nodes (the gradient all-reduce
    runs there).
    """

    device_mesh: DeviceMesh
    # This process's fault watchdog (started by init_mesh unless fault_policy=None); engine parts that
    # need it (collective bookkeeping, periodic checks) reach it through the mesh, never a global.
    watchdog: Watchdog | None = field(default=None, compare=False, repr=False)

    @property
    def device(self) -> torch.device:
        if self.device_mesh.device_type == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device(self.device_mesh.device_type)

    @property
    def shard_group(self) -> dist.ProcessGroup:
        return self.device_mesh.get_group("shard")

    @property
    def replicate_group(self) -> dist.ProcessGroup:
        return self.device_mesh.get_group("replicate")

    @property
    def sharding_degree(self) -> int:
        return self.device_mesh.size(1)

    @property
    def replicate_degree(self) -> int:
        return self.device_mesh.size(0)

    @property
    def shard_rank(self) -> int:
        return self.device_mesh.get_local_rank("shard")

    @property
    def replicate_rank(self) -> int:
        return self.device_mesh.get_local_rank("replicate")

    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def world_size(self) -> int:
        return self.replicate_degree * self.sharding_degree

    @property
    def data_parallel_rank(self) -> int:
        """Every rank reads distinct data: shards split parameters, not the batch."""
        return self.replicate_rank * self.sharding_degree + self.shard_rank

    def __repr__(self) -> str:
        return (
            f"HSDPMesh(replicate={self.replicate_degree}, shard={self.sharding_degree}, "
            f"rank={self.rank}, device={self.device})"
        )


def mesh_from_device_mesh(device_mesh: DeviceMesh) -> HSDPMesh:
    """Accept a user's 2-D ``DeviceMesh``; its dim names must be ``("replicate", "shard")``."""
    names = tuple(device_mesh.mesh_dim_names or ())
    if device_mesh.ndim != 2 or names != MESH_DIM_NAMES:
        raise ValueError(
            f"expected a 2-D DeviceMesh with mesh_dim_names={MESH_DIM_NAMES}, got ndim={device_mesh.ndim} "
            f"and names={names or None}: build it with init_device_mesh(device_type, (R, S), "
            f"mesh_dim_names=('replicate', 'shard'))"
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
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend=backend, timeout=timeout)


def init_mesh(
    sharding_degree: int | None = None,
    *,
    device_mesh: DeviceMesh | None = None,
    timeout: timedelta = DEFAULT_TIMEOUT,
    fault_policy: FaultPolicy | None = DEFAULT_FAULT_POLICY,
) -> HSDPMesh:
    """Build the replicate x shard mesh, initialising the default process group when needed.

    ``sharding_degree`` defaults to ``$HSDP_SHARDING_DEGREE`` when set (``hsdp tune`` sets it per candidate
    layout), else to the ranks per node, which keeps all-gather and reduce-scatter on the fast intra-node
    links. An explicit argument always wins over the variable. ``1`` is plain replication (DDP semantics);
    the world size is full sharding.
    Every check runs before any collective, so a bad value fails on every rank instead of hanging. A degree
    whose shard groups straddle nodes (torchrun's ``LOCAL_WORLD_SIZE`` ranks per node) warns, naming the
    override (:func:`node_crossing_warning`).
    ``fault_policy`` starts the dead-rank watchdog (see ``hsdp.engine.faults.watchdog``); ``None`` disables it.
    """
    if device_mesh is not None:
        mesh = mesh_from_device_mesh(device_mesh)
        check_degree_agrees(sharding_degree, mesh)
        if fault_policy is None:
            return mesh
        watchdog = start_watchdog(fault_policy)
        watch_launcher(watchdog)
        return HSDPMesh(mesh.device_mesh, watchdog)
    if not dist.is_initialized():
        world_size = int(os.environ.get("WORLD_SIZE", "0")) or None
        if sharding_degree is not None and world_size is not None:
            validate_degree(world_size, sharding_degree)
        _init_process_group(timeout)
    world_size = dist.get_world_size()
    degree = default_sharding_degree(world_size) if sharding_degree is None else sharding_degree
    validate_degree(world_size, degree)
    crossing = node_crossing_warning(world_size, degree, int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
    if crossing:  # a warning, not an error: it runs, only slower than the same degree aligned to nodes
        warnings.warn(crossing, stacklevel=2)
    device_type = device_type_for(str(dist.get_backend()), torch.cuda.is_available())
    if device_type == "cuda" and "LOCAL_RANK" in os.environ:
        # Also when the caller created the process group: each rank's collectives and tensors on its own GPU.
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    watchdog = start_watchdog(fault_policy) if fault_policy is not None else None
    watch_launcher(watchdog)  # a rank whose launcher dies ends too (hsdp.engine.faults.launcher)
    dm = init_device_mesh(device_type, (world_size // degree, degree), mesh_dim_names=MESH_DIM_NAMES)
    return HSDPMesh(dm, watchdog)


def check_degree_agrees(sharding_degree: int | None, mesh: HSDPMesh) -> None:
    """A ``sharding_degree`` given next to a mesh must be the mesh's (before any collective)."""
    if sharding_degree is not None and sharding_degree != mesh.sharding_degree:
        raise ValueError(f"sharding_degree={sharding_degree} disagrees with the mesh's shard dim "
                         f"({mesh.sharding_degree}): pass only one of them")
