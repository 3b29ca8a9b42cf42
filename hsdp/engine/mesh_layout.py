"""Pure rank-grid arithmetic of a mesh: which degrees tile the world, the default degree, node crossings.

No processes: every check here runs before any collective, so a bad value fails on every rank the same way
instead of hanging (``mesh.py`` builds the mesh from these answers). Rank layout: with world size W and
sharding degree S, replica ``r`` is the row of consecutive ranks ``[r*S, (r+1)*S)``; with tensor parallelism
of degree T the grid is ``(R, S, T)`` row-major (see ``mesh.py``).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping

import torch

# Read when sharding_degree is None; set per candidate layout by `hsdp tune`.
SHARDING_DEGREE_ENV = "HSDP_SHARDING_DEGREE"

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
