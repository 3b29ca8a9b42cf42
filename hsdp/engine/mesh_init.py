"""Building the mesh: ``init_mesh``, the default process group, and every check that can run before a collective.

``init_mesh`` picks the layout (a grid ``DeviceMesh``, replicas of different shard degrees, or one replica of an
elastic job admitted by the coordinator), initialises torch.distributed when the caller did not (NCCL with a
GPU, gloo without), starts the fault watchdog, and returns the ``HSDPMesh`` (``mesh.py``) the engine passes
around. Bad arguments raise ``ValueError`` before any collective, so no rank hangs on a peer that refused.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from hsdp.engine.faults.launcher import watch_launcher
from hsdp.engine.faults.policy import FaultPolicy
from hsdp.engine.faults.watchdog import start_watchdog
from hsdp.engine.mesh import MESH_DIM_NAMES, TP_MESH_DIM_NAMES, HSDPMesh, check_degree_agrees, mesh_from_device_mesh
from hsdp.engine.mesh_layout import SHARDING_DEGREE_ENV, device_type_for, mesh_shape
from hsdp.engine.replicate.degrees import check_degrees, default_degrees, is_regular
from hsdp.engine.replicate.elastic.bootstrap import elastic_env
from hsdp.engine.replicate.elastic.bootstrap import join as elastic_join
from hsdp.engine.replicate.elastic.layer import ElasticLayer
from hsdp.engine.replicate.elastic.protocol import ElasticPolicy
from hsdp.engine.replicate.fixed import gather_node_sizes, heterogeneous_layer
from hsdp.engine.replicate.pieces import validate_degrees

DEFAULT_TIMEOUT = timedelta(minutes=10)
DEFAULT_FAULT_POLICY = FaultPolicy()
ShardingDegree = int | Sequence[int]  # one degree for every replica, or one per replica (heterogeneous)


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
    sharding_degree: ShardingDegree | None = None,
    *,
    tensor_parallel_degree: int | None = None,
    allow_cross_node_shards: bool = False,
    device_mesh: DeviceMesh | None = None,
    timeout: timedelta = DEFAULT_TIMEOUT,
    fault_policy: FaultPolicy | None = DEFAULT_FAULT_POLICY,
    elastic: bool | ElasticPolicy = False,
    coordinator: str | None = None,
) -> HSDPMesh:
    """Build the replicate x shard mesh (x tp with ``tensor_parallel_degree``), initialising the default
    process group when needed.

    ``sharding_degree`` defaults to ``$HSDP_SHARDING_DEGREE`` when set (``hsdp tune`` sets it per candidate
    layout), else to the ranks per node (divided by ``tensor_parallel_degree``), which keeps all-gather and
    reduce-scatter on the fast intra-node links. An explicit argument always wins over the variable. ``1`` is
    plain replication (DDP semantics); the world size is full sharding.

    A list gives one degree per replica, replicas in rank order (``[4, 2, 2]``: ranks 0-3, 4-5, 6-7), summing
    to the world size, each replica inside one node (torchrun's ``LOCAL_WORLD_SIZE``, gathered from every
    rank) unless ``allow_cross_node_shards``: a *heterogeneous* mesh, for nodes of different sizes or memory.
    Under torchrun with nodes of different sizes (``--nproc-per-node`` differing per node) and no degree
    given, the default is one replica per node. Every replica is evenly sharded inside; the gradient of each
    row is averaged over one rank per replica (``replicate/``); the replica-sharded optimizer slices
    each piece over its holders (``runtime/piece_slice.py``). Equal entries make a grid. With
    ``tensor_parallel_degree=T`` the list counts data-parallel positions of T adjacent ranks each
    (``[2, 1]`` with T = 2: ranks 0-3 and 4-5), summing to the world size / T; every replica has the same T,
    and its pieces are reduced per tp coordinate.

    ``tensor_parallel_degree=T`` (``None``: no tp dim) builds a 3-D mesh ``("replicate", "shard", "tp")`` with
    the T ranks of a tensor-parallel group adjacent; T must divide the ranks per node, and S x T may exceed
    them only with ``allow_cross_node_shards=True``. Parallelize the model's layers on ``mesh.tp_mesh`` with
    ``torch.distributed.tensor.parallel.parallelize_module`` (e.g. ``hsdp.tp_plans``) before wrapping it.
    Every check that needs no other rank runs before any collective, so a bad value fails on every rank
    instead of hanging; the node check of a list runs after one all-gather, on every rank alike. A degree
    whose shard groups straddle nodes (torchrun's ``LOCAL_WORLD_SIZE`` ranks per node) warns, naming the
    override (:func:`node_crossing_warning`).
    ``fault_policy`` starts the dead-rank watchdog (see ``hsdp.engine.faults.watchdog``); ``None`` disables it.

    ``elastic=True`` (or an ``ElasticPolicy`` with its timeouts): this process's torchrun job is one replica of an
    elastic job whose replicas come and go between steps (``hsdp/engine/replicate/elastic/``): the coordinator at
    ``coordinator`` (default ``$HSDP_COORDINATOR``), this replica's id from ``$HSDP_REPLICA_ID``. The replica's
    ranks shard every parameter (``sharding_degree`` is the job's world size, divided by T below); the replica is
    admitted once its ``ShardedOptimizer`` exists (a joiner is healed there). With ``tensor_parallel_degree=T``
    every replica's job is ``sharding_degree x T`` ranks (tp ranks adjacent), the same T in every replica: gradients
    are reduced, and joiners healed, per (shard rank, tp rank) position across the members. Replicas of different
    shard degrees are replicas of different rank counts, declared on the coordinator (``hsdp coordinator
    --nproc-per-replica 2,1,1``, or ``hsdp launch --elastic --nproc-per-node 2,1,1``), not a list here (refused):
    each step's gradient is then the mean over its members' ranks, reduced piece by piece, and a joiner is healed
    from a member of any degree.
    """
    if elastic:
        return _elastic_mesh(sharding_degree, tensor_parallel_degree, device_mesh, coordinator, timeout, fault_policy,
                             elastic if isinstance(elastic, ElasticPolicy) else ElasticPolicy())
    listed = check_degree_list(sharding_degree, device_mesh)
    if device_mesh is not None:
        return _from_user_mesh(device_mesh, sharding_degree, tensor_parallel_degree, fault_policy)
    if not dist.is_initialized():
        world_size = int(os.environ.get("WORLD_SIZE", "0")) or None
        if world_size is not None and listed is not None:
            check_degrees(listed, data_parallel_world(world_size, tensor_parallel_degree))
        elif world_size is not None and (sharding_degree is not None or tensor_parallel_degree is not None):
            mesh_shape(world_size, sharding_degree, tensor_parallel_degree, allow_cross_node_shards)
        _init_process_group(timeout)
    if listed is not None:
        check_degrees(listed, data_parallel_world(dist.get_world_size(), tensor_parallel_degree))
    device_type = device_type_for(str(dist.get_backend()), torch.cuda.is_available())
    if device_type == "cuda" and "LOCAL_RANK" in os.environ:
        # Also when the caller created the process group: each rank's collectives and tensors on its own GPU.
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    watchdog = start_watchdog(fault_policy) if fault_policy is not None else None
    watch_launcher(watchdog)  # a rank whose launcher dies ends too (hsdp.engine.faults.launcher)
    degrees = _replica_degrees(listed, sharding_degree, tensor_parallel_degree, allow_cross_node_shards)
    if degrees is not None and not is_regular(degrees):
        layer = heterogeneous_layer(degrees, dist.get_rank(), device_type, tensor_parallel_degree or 1)
        return HSDPMesh(None, watchdog, layer=layer)
    degree = degrees[0] if degrees is not None else sharding_degree
    shape = mesh_shape(dist.get_world_size(), degree, tensor_parallel_degree, allow_cross_node_shards)
    names = MESH_DIM_NAMES if len(shape) == 2 else TP_MESH_DIM_NAMES
    return HSDPMesh(init_device_mesh(device_type, shape, mesh_dim_names=names), watchdog)


def _elastic_mesh(sharding_degree: ShardingDegree | None, tp_degree: int | None, device_mesh: DeviceMesh | None,
                  coordinator: str | None, timeout: timedelta, fault_policy: FaultPolicy | None,
                  policy: ElasticPolicy) -> HSDPMesh:
    """One replica of an elastic job (see :func:`init_mesh`): checks first, then the process group of this
    torchrun job, the coordinator's admission, and the replica's shard mesh: 1-D ``("shard",)``, or 2-D
    ``("shard", "tp")`` with ``tp_degree`` (tp ranks adjacent, as on a grid)."""
    if device_mesh is not None or isinstance(sharding_degree, list | tuple):
        raise ValueError("init_mesh(elastic=True) builds one replica per torchrun job, sharded over its ranks: drop "
                         "device_mesh and per-replica degree lists (replicas of different degrees: give each "
                         "replica's torchrun its own --nproc-per-node and the coordinator --nproc-per-replica, "
                         "e.g. hsdp launch --elastic --nproc-per-node 2,1,1)")
    if fault_policy is not None and fault_policy.timeout <= policy.heartbeat_timeout:
        # The survivors wait for a stopped peer replica until the coordinator drops it (its heartbeat timeout): a
        # watchdog judging that wait a hang first would end every survivor, losing the job instead of a step.
        raise ValueError(f"FaultPolicy(timeout={fault_policy.timeout:g}) must be above ElasticPolicy(heartbeat_timeout="
                         f"{policy.heartbeat_timeout:g}): a stopped peer replica would end the others as a hang before "
                         f"the coordinator drops it; raise FaultPolicy.timeout well above it (defaults: 45 s and 3 s)")
    found = elastic_env(coordinator)
    world_size = int(os.environ.get("WORLD_SIZE", "0"))
    if world_size:  # before any collective where torchrun tells the world size
        data_parallel_world(world_size, tp_degree)
    if not dist.is_initialized():
        _init_process_group(timeout)
    world = dist.get_world_size()
    degree = data_parallel_world(world, tp_degree)
    if sharding_degree not in (None, degree):
        per_tp = f" / tensor_parallel_degree={tp_degree}" if tp_degree else ""
        raise ValueError(f"sharding_degree={sharding_degree}: an elastic replica is one torchrun job sharded over "
                         f"all its {world} ranks{per_tp}; drop sharding_degree or start "
                         f"{sharding_degree * (tp_degree or 1)} ranks per job")
    device_type = device_type_for(str(dist.get_backend()), torch.cuda.is_available())
    if device_type == "cuda" and "LOCAL_RANK" in os.environ:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    watchdog = start_watchdog(fault_policy) if fault_policy is not None else None
    watch_launcher(watchdog)
    joined = elastic_join(found, world, policy, tp_degree or 1)
    if tp_degree is None:
        param_mesh = init_device_mesh(device_type, (world,), mesh_dim_names=("shard",))
        tp_rank = 0
    else:
        param_mesh = init_device_mesh(device_type, (degree, tp_degree), mesh_dim_names=("shard", "tp"))
        tp_rank = param_mesh.get_local_rank("tp")
    declared = None if joined.ranks is None or len(set(joined.ranks)) == 1 else \
        tuple(n // (tp_degree or 1) for n in joined.ranks)
    layer = ElasticLayer(joined.client, found.replica_id, degree, joined.replicas, param_mesh.get_local_rank("shard"),
                         param_mesh.get_group("shard"), param_mesh, device_type, policy, tp_rank, tp_degree or 1,
                         declared, on_finished=watchdog.mark_done if watchdog is not None else None)
    return HSDPMesh(None, watchdog, layer=layer)


def _from_user_mesh(device_mesh: DeviceMesh, sharding_degree: int | None, tp_degree: int | None,
                    fault_policy: FaultPolicy | None) -> HSDPMesh:
    mesh = mesh_from_device_mesh(device_mesh)
    check_degree_agrees(sharding_degree, mesh)
    if tp_degree is not None and tp_degree != mesh.tp_degree:
        raise ValueError(f"tensor_parallel_degree={tp_degree} disagrees with the DeviceMesh's "
                         f"tp dim ({mesh.tp_degree}): pass only one of them")
    if fault_policy is None:
        return mesh
    watchdog = start_watchdog(fault_policy)
    watch_launcher(watchdog)
    return HSDPMesh(mesh.device_mesh, watchdog)


def check_degree_list(sharding_degree: ShardingDegree | None, device_mesh: DeviceMesh | None) -> tuple[int, ...] | None:
    """A list of per-replica degrees as a tuple (``None`` for an int or nothing), refusing what it cannot be
    combined with: before any collective."""
    if not isinstance(sharding_degree, list | tuple):
        return None
    degrees = tuple(sharding_degree)
    validate_degrees(degrees)
    if is_regular(degrees):
        return degrees
    if device_mesh is not None:
        raise ValueError(f"sharding_degree={list(degrees)} describes replicas of different sizes, which no "
                         f"DeviceMesh grid can: pass either the list or device_mesh, not both")
    return degrees


def _replica_degrees(listed: tuple[int, ...] | None, sharding_degree: ShardingDegree | None,
                     tp_degree: int | None, allow_cross_node_shards: bool) -> tuple[int, ...] | None:
    """The replicas' degrees of a list (checked against the nodes), or of nodes of different sizes when no
    degree is given under torchrun (one replica per node); ``None``: the grid ``mesh_shape`` computes. The
    node sizes take one all-gather, on every rank that takes that branch (all of them: same arguments)."""
    env = os.environ
    if listed is not None:
        nodes = gather_node_sizes() if "LOCAL_WORLD_SIZE" in env and not allow_cross_node_shards else None
        t = tp_degree or 1
        return check_degrees(listed, data_parallel_world(dist.get_world_size(), t),
                             None if nodes is None else positions_per_node(nodes, t), allow_cross_node_shards)
    if sharding_degree is not None or tp_degree is not None or env.get(SHARDING_DEGREE_ENV) \
            or "LOCAL_WORLD_SIZE" not in env or int(env["LOCAL_WORLD_SIZE"]) == dist.get_world_size():
        return None
    nodes = gather_node_sizes()
    return None if is_regular(nodes) else default_degrees(nodes)


def data_parallel_world(world_size: int, tp_degree: int | None) -> int:
    """The data-parallel positions of a world whose tensor-parallel groups are ``tp_degree`` adjacent ranks:
    what a list of per-replica shard degrees sums to. ``ValueError`` (before any collective) when T does not
    divide the world."""
    t = tp_degree or 1
    if t < 1 or world_size % t:
        raise ValueError(f"tensor_parallel_degree={tp_degree} does not divide the world size {world_size}: every "
                         f"tensor-parallel group is {t} adjacent ranks")
    return world_size // t


def positions_per_node(node_sizes: Sequence[int], tp_degree: int) -> tuple[int, ...]:
    """Ranks per node counted in tensor-parallel groups (a node holds whole groups: T must divide its ranks),
    the unit the per-replica shard degrees count in. The same ``ValueError`` on every rank (after the node
    sizes' all-gather)."""
    if any(n % tp_degree for n in node_sizes):
        raise ValueError(f"tensor_parallel_degree={tp_degree} does not divide the ranks of every node "
                         f"({list(node_sizes)}): a tensor-parallel group must stay inside a node")
    return tuple(n // tp_degree for n in node_sizes)
