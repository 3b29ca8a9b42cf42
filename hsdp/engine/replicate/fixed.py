"""A fixed set of replicas: which ranks hold the same rows on other replicas, and the groups that reduce them.

The :class:`~hsdp.engine.replicate.layer.ReplicateLayer` of every mesh whose replicas do not change. hsdp owns the
layer above the replicas' own shard meshes (``docs/design/replicate_layer.md``): sharded DTensors live on
:attr:`FixedLayer.param_mesh`, this rank's replica only, and the inter-node reduction runs in groups of one rank per
replica. Two shapes share the object:

* a *grid* (every replica of one degree, from a ``DeviceMesh`` ``("replicate", "shard"[, "tp"])``): the rows
  a rank holds are held by the same shard rank of every replica, so one group, the mesh's ``"replicate"``
  dim, reduces all of them;
* *heterogeneous* replicas (``init_mesh(sharding_degree=[2, 1])``): the replicas' dim-0 chunks differ, so a
  rank's rows are cut into pieces (``pieces.py``), each held by a different tuple of ranks, and the
  layer holds one process group per holder tuple. Groups are created on every rank in one sorted order
  (:meth:`ensure_groups`), as ``torch.distributed.new_group`` requires. With tensor parallelism (the same
  degree T in every replica) each holder tuple is T groups, one per tp coordinate: the pieces of a TP-local
  tensor are reduced among the ranks holding that same tensor-parallel piece.

Code that reduces across replicas asks the layer for the group of a holder tuple (:meth:`group`): on a grid
that is always the ``"replicate"`` group, so the regular mesh is the special case, not a second path.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from hsdp.engine.replicate.degrees import replica_of_rank, replica_starts
from hsdp.engine.replicate.layer import Heal, Holders, StepRecord
from hsdp.engine.replicate.pieces import global_ranks, holder_tuples, position_groups
from hsdp.engine.store_exchange import exchange


@dataclass(frozen=True)
class FixedLayer:
    """The replicas of a mesh (their shard degrees, in rank order), this rank's place, and the groups of
    one rank per replica. ``regular``: every degree equal (a grid; its groups are the mesh's)."""

    degrees: tuple[int, ...]
    index: int  # this rank's replica
    shard_rank: int
    shard_group: dist.ProcessGroup = field(compare=False, repr=False)
    param_mesh: DeviceMesh = field(compare=False, repr=False)
    # Heterogeneous replicas with tensor parallelism: every replica has T tp ranks per shard rank, and the
    # pieces are reduced per tp coordinate (over the ranks of this rank's coordinate only). A grid keeps 1 / 0:
    # its replicate groups are the DeviceMesh's, already per tp coordinate.
    tp_degree: int = 1
    tp_rank: int = 0
    # Holder tuple -> group, for the tuples this rank belongs to (a grid: its own position's replicate group).
    _groups: dict[Holders, dist.ProcessGroup] = field(default_factory=dict, compare=False, repr=False)
    # Every tuple created so far, members or not (new_group must be called for each on every rank once).
    _created: set[Holders] = field(default_factory=set, compare=False, repr=False)

    @property
    def regular(self) -> bool:
        return len(set(self.degrees)) == 1

    @property
    def member(self) -> int:
        """This rank's replica's place in :attr:`degrees`: its index (the replicas never change)."""
        return self.index

    @property
    def degree(self) -> int:
        """This rank's replica's shard degree."""
        return self.degrees[self.index]

    @property
    def count(self) -> int:
        return len(self.degrees)

    @property
    def start(self) -> int:
        """The first data-parallel rank of this rank's replica (replicas hold consecutive ranks)."""
        return replica_starts(self.degrees)[self.index]

    @property
    def scale(self) -> float:
        """What this replica's reduced shard is multiplied by before the replicate average, so that the result is
        the average over every rank: ``d_r x R / W`` (the shard group averaged over ``d_r`` ranks only); exactly
        1 on a grid, where nothing is multiplied."""
        return self.degree * self.count / sum(self.degrees)

    @property
    def data_parallel_size(self) -> int:
        """Ranks reading distinct data: every replica's."""
        return sum(self.degrees)

    @property
    def data_parallel_degrees(self) -> tuple[int, ...]:
        """Every replica reads data: their degrees."""
        return self.degrees

    @property
    def job_degrees(self) -> tuple[int, ...]:
        """The degrees of the replicas in this process group's world (the torchrun job, over which DCP saves):
        every replica here."""
        return self.degrees

    @property
    def transactional(self) -> bool:
        """Whether a step can be discarded after its backward (elastic): never here."""
        return False

    @property
    def outside_world(self) -> bool:
        """Whether some replicas live outside this process group's world (elastic: each is its own job)."""
        return False

    @property
    def lowest_member(self) -> int:
        """The replicate-group index of the lowest-numbered live replica."""
        return 0

    @property
    def replicate_group(self) -> dist.ProcessGroup | None:
        """A grid's one replicate group (this rank's shard position on every replica); ``None`` for replicas of
        different degrees, whose pieces go over several (:meth:`group`)."""
        return self._groups[(self.shard_rank,) * self.count] if self.regular else None

    def own_position_groups(self) -> list[Holders]:
        """The position groups (``replica_pieces.position_groups``) this rank belongs to, sorted: where what
        every rank needs whole (flags, weights, 0-d parameters) is reduced."""
        return [g for g in position_groups(self.degrees) if g[self.index] == self.shard_rank]

    def group(self, holders: Holders) -> dist.ProcessGroup:
        """The process group of the ranks in ``holders`` (one per replica; this rank among them)."""
        if holders[self.index] != self.shard_rank:
            raise RuntimeError(f"rank of replica {self.index}, shard rank {self.shard_rank}, is not among the "
                               f"holders {holders}: a piece plan asked for a group it cannot join (an hsdp bug)")
        try:
            return self._groups[holders]
        except KeyError:
            raise RuntimeError(f"no replicate group for holders {holders} was created at wrap time "
                               f"(FixedLayer.ensure_groups; an hsdp bug)") from None

    def ensure_groups(self, rows: Iterable[int]) -> None:
        """Create the groups of the pieces of parameters of ``rows`` rows (and the position groups) not created
        yet, in sorted order. A collective over the world: every rank calls it with the same rows (they come
        from the model's shapes, the same everywhere). A no-op on a grid, whose groups are the mesh's. With
        tensor parallelism a tuple is one group per tp coordinate (the same rows of the same tensor-parallel
        piece); this rank keeps its own coordinate's."""
        if self.regular:
            return
        for holders in sorted(holder_tuples(rows, self.degrees) - self._created):
            for t in range(self.tp_degree):
                group = dist.new_group(list(global_ranks(holders, self.degrees, self.tp_degree, t)))
                if holders[self.index] == self.shard_rank and t == self.tp_rank:
                    self._groups[holders] = group
            self._created.add(holders)


    # -- lifecycle (layer.py): every replica takes part in every step, so every step is applied -------------
    @property
    def last(self) -> StepRecord | None:
        return None

    @property
    def step_open(self) -> bool:
        return False  # no step is awaited: nothing to join

    def interrupt(self) -> Callable[[], str] | None:
        return None  # nothing tells a wait to give up: a lost peer is the fault watchdog's to report

    def begin_step(self) -> None:
        pass

    def await_step(self) -> None:
        pass

    def step_failed(self, why: str) -> bool:
        return False  # the members are fixed: a lost peer cannot be stepped around, the caller raises

    def step_reduced(self) -> None:
        pass

    def finish_step(self) -> bool:
        return True

    def attach(self, heal: Heal) -> None:
        pass  # nobody joins a fixed set of replicas

    def close(self, finished: bool = False) -> None:
        pass


def grid_layer(device_mesh: DeviceMesh) -> FixedLayer:
    """The layer of a ``("replicate", "shard"[, "tp"])`` ``DeviceMesh``: every replica of the shard dim's size."""
    r, s = device_mesh.size(0), device_mesh.size(1)
    shard_rank = device_mesh.get_local_rank("shard")
    param_mesh = device_mesh["shard", "tp"] if device_mesh.ndim == 3 else device_mesh["shard"]
    layer = FixedLayer((s,) * r, device_mesh.get_local_rank("replicate"), shard_rank,
                         device_mesh.get_group("shard"), param_mesh)
    layer._groups[(shard_rank,) * r] = device_mesh.get_group("replicate")
    return layer


def gather_node_sizes() -> tuple[int, ...]:
    """Ranks per node, in node order, from every rank's torchrun ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE``
    (torchrun numbers a node's ranks consecutively, so a node starts where ``LOCAL_RANK`` is 0)."""
    mine = f"{int(os.environ.get('LOCAL_RANK', '0'))} {int(os.environ['LOCAL_WORLD_SIZE'])}"
    everyone = [tuple(map(int, v.split())) for v in exchange(mine)]
    return tuple(size for local, size in everyone if local == 0)


def heterogeneous_layer(degrees: tuple[int, ...], rank: int, device_type: str, tp_degree: int = 1) -> FixedLayer:
    """The layer of replicas of ``degrees`` (consecutive rank ranges): one shard group per replica, created
    on every rank in replica order, and this rank's replica mesh over its group (``DeviceMesh.from_group``).
    A collective over the world; ``degrees`` validated by the caller (``replica_degrees.check_degrees``).

    With ``tp_degree`` T every data-parallel position is T adjacent ranks (``mesh.py``'s layout: replica ``q``
    holds ranks ``[start_q x T, (start_q + d_q) x T)``, shard rank ``s`` and tp rank ``t`` at
    ``(start_q + s) x T + t``): a replica has T shard groups (one per tp coordinate) and d_q tp groups, and its
    mesh is the 2-D ``("shard", "tp")`` one FSDP2 + TP shards on."""
    t_deg = tp_degree
    index, shard_rank = replica_of_rank(rank // t_deg, degrees)
    tp_rank = rank % t_deg
    shard_mine = tp_mine = None
    for start, d in zip(replica_starts(degrees), degrees, strict=True):
        for t in range(t_deg):  # the shard groups, one per tp coordinate
            ranks = [(start + s) * t_deg + t for s in range(d)]
            group = dist.new_group(ranks)
            if rank in ranks:
                shard_mine = group
    if t_deg > 1:
        for position in range(sum(degrees)):  # the tp groups: the T adjacent ranks of a data-parallel position
            group = dist.new_group(list(range(position * t_deg, (position + 1) * t_deg)))
            if position == rank // t_deg:
                tp_mine = group
    assert shard_mine is not None, f"rank {rank} is outside sharding_degree={list(degrees)}"
    if tp_mine is None:
        param_mesh = DeviceMesh.from_group(shard_mine, device_type, mesh_dim_names=("shard",))
    else:
        first = replica_starts(degrees)[index] * t_deg
        grid = torch.arange(first, first + degrees[index] * t_deg).view(degrees[index], t_deg)
        param_mesh = DeviceMesh.from_group([shard_mine, tp_mine], device_type, mesh=grid,
                                           mesh_dim_names=("shard", "tp"))
    layer = FixedLayer(degrees, index, shard_rank, shard_mine, param_mesh, t_deg, tp_rank)
    layer.ensure_groups(())  # the position groups: every unit reduces its flags there
    return layer
