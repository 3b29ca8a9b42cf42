"""``ReplicaSavePlanner``: DCP's default save planner, each tensor written in one replica's chunk layout.

Every replica of an hsdp mesh holds the whole model, cut into its own shard degree's dim-0 chunks. DCP's
default planner keeps one writer per ``(key, chunk offset)`` and then requires the chunks of a key to tile
the tensor exactly. On a grid (every replica of one degree) the replicas' chunks coincide, so that dedup
leaves one copy of each and spreads them over all the writers. On a heterogeneous mesh
(``init_mesh([2, 1])``) replica 0 writes rows ``[0, 9)`` and ``[9, 17)`` while replica 1 writes ``[0, 17)``:
the chunks overlap, DCP's validation refuses the plan ("Failed to validate global plan: ... overlapping
chunks"), and deduplicating by offset alone would even keep ``[0, 9)`` twice.

The rule here, applied on the coordinator to every rank's local plan before DCP's own dedup: for each key,
the tensor chunks of the lowest-numbered replica that holds the key are the key's layout whenever they tile
the whole tensor; another replica's items for that key are then kept only if they repeat chunks of that
layout (DCP's dedup picks one writer, as before), and dropped otherwise. So:

* on a grid nothing is dropped and the plan, the files and the metadata are those of ``DefaultSavePlanner``
  (optimizer state sharded across replicas included: there no replica's chunks tile a tensor alone);
* on a heterogeneous mesh replica 0 writes the sharded tensors; tensors every replica holds whole (Adam's
  step counters, plain buffers, 0-d parameters) and non-tensor values stay with DCP's dedup, which may pick a
  writer on any replica;
* a key only a later replica holds is written by that replica (never lost), and no key is written twice.

The layout on disk is unchanged: original names, full shapes, one set of chunks per key, so the checkpoint
loads on any mesh, into FSDP2, or in one process. ``hsdp.save_checkpoint`` always uses this planner; pass
``planner=ReplicaSavePlanner(mesh)`` to a direct ``dcp.save`` of an hsdp model on a heterogeneous mesh.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType

from hsdp.engine.mesh import HSDPMesh

Chunk = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)


class ReplicaSavePlanner(DefaultSavePlanner):
    """A ``DefaultSavePlanner`` that keeps, per key, one replica's chunk layout (see the module docstring).

    ``mesh`` is the hsdp mesh the saved model lives on; ``dcp.save`` must run over the default process group
    (its plans are indexed by global rank). Other keyword arguments go to ``DefaultSavePlanner``.
    """

    def __init__(self, mesh: HSDPMesh, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.replica_of = replica_of_ranks(mesh)

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        if len(all_plans) != len(self.replica_of):
            raise ValueError(f"ReplicaSavePlanner got {len(all_plans)} local plans for a mesh of "
                             f"{len(self.replica_of)} ranks: call dcp.save over the default process group "
                             f"(process_group=None), on every rank of the mesh")
        return super().create_global_plan(one_layout_per_key(all_plans, self.replica_of))


def replica_of_ranks(mesh: HSDPMesh) -> tuple[int, ...]:
    """The replica of every global rank (tensor-parallel ranks of a grid included)."""
    if mesh.device_mesh is not None:
        out = [0] * mesh.device_mesh.mesh.numel()
        for replica, ranks in enumerate(mesh.device_mesh.mesh):
            for rank in ranks.flatten().tolist():
                out[rank] = replica
        return tuple(out)
    # Replicas of different degrees: replica q is d_q x T consecutive ranks (T tp ranks per shard rank).
    return tuple(q for q, d in enumerate(writer_degrees(mesh)) for _ in range(d * mesh.tp_degree))


def writer_degrees(mesh: HSDPMesh) -> tuple[int, ...]:
    """The shard degree of every replica whose ranks save together, in rank order: all the mesh's replicas, or on
    an elastic mesh this replica alone (its torchrun job's world is the default process group DCP saves over; the
    other replicas are other jobs, equal to it at a step boundary). Never waits for an elastic step's quorum."""
    return mesh.replicas.job_degrees


def _chunk(item: WriteItem) -> Chunk:
    assert item.tensor_data is not None, item.index
    chunk = item.tensor_data.chunk
    return tuple(chunk.offsets), tuple(chunk.sizes)


def _volume(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def one_layout_per_key(all_plans: list[SavePlan], replica_of: tuple[int, ...]) -> list[SavePlan]:
    """``all_plans`` (one per global rank) without the tensor items that are redundant with, yet not
    identical to, the chunks of the lowest replica holding their key. Non-tensor items are untouched.

    A replica's own chunks never overlap (identical copies aside), so its distinct chunks tile the tensor iff
    their volumes add up to it. Only then is any other chunk redundant: kept where it repeats one of the
    reference's (DCP's dedup picks one writer) or is empty, dropped otherwise. A reference that does not tile
    the tensor (optimizer state sharded across replicas, ``shard_optimizer_across_replicas``: each replica
    holds a slice) leaves the key's items as they are, for DCP's dedup and validation."""
    first: dict[str, int] = {}
    chunks: dict[tuple[str, int], set[Chunk]] = {}
    sizes: dict[str, tuple[int, ...]] = {}
    for rank, plan in enumerate(all_plans):
        for item in plan.items:
            if item.type != WriteItemType.BYTE_IO:
                assert item.tensor_data is not None, item.index
                fqn, replica = item.index.fqn, replica_of[rank]
                first[fqn] = min(first.get(fqn, replica), replica)
                chunks.setdefault((fqn, replica), set()).add(_chunk(item))
                sizes[fqn] = tuple(item.tensor_data.size)
    layout = {fqn: chunks[fqn, q] for fqn, q in first.items()
              if sum(_volume(c[1]) for c in chunks[fqn, q]) == _volume(sizes[fqn])}

    def redundant(item: WriteItem) -> bool:
        reference = layout.get(item.index.fqn) if item.type != WriteItemType.BYTE_IO else None
        return reference is not None and _chunk(item) not in reference and _volume(_chunk(item)[1]) > 0

    if not any(redundant(i) for plan in all_plans for i in plan.items):
        return all_plans  # a grid: the very plans DefaultSavePlanner would see
    return [dataclasses.replace(plan, items=[i for i in plan.items if not redundant(i)]) for plan in all_plans]
