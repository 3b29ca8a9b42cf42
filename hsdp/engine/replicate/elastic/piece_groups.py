"""The groups of one quorum epoch of an elastic job whose replicas have different shard degrees.

Across replicas of different degrees a rank's rows are cut into pieces (``replicate/pieces.py``), each reduced
over its holder tuple (one rank per member), and what every rank needs whole over the position groups. On a
fixed mesh those groups are made once at wrap (``FixedLayer.ensure_groups``); here the tuples depend on the
quorum's degrees, so each epoch makes its own, over the coordinator's store like the homogeneous job's one group
(``groups.build_group``): one group per tuple this rank is in, named by the epoch, the tuple and the tp
coordinate, its group rank the member's place in the quorum. The tuples are those of the parameter row counts
the layer registered at wrap (every unit's, every tp coordinate's), computed from the quorum's degrees alone, so
every member computes the same ones; each rank builds its own in one sorted order (a gloo group's construction
waits for all its members, and one global order lets the smallest unfinished group always complete).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch.distributed as dist

from hsdp.engine.replicate.elastic.groups import build_group
from hsdp.engine.replicate.layer import Holders
from hsdp.engine.replicate.pieces import holder_tuples


def own_tuples(rows: Iterable[int], degrees: tuple[int, ...], member: int, shard_rank: int) -> list[Holders]:
    """The holder tuples over ``degrees`` that member ``member``'s shard rank ``shard_rank`` is in, sorted."""
    return sorted(h for h in holder_tuples(rows, degrees) if h[member] == shard_rank)


def build_piece_groups(store: dist.Store, job: str, epoch: int | str, tuples: list[Holders], tp_position: str,
                       member: int, device_type: str, timeout: float) -> dict[Holders, dist.ProcessGroup]:
    """One group per holder tuple in ``tuples`` (sorted; this rank in each), group rank ``member`` of one rank per
    member; ``tp_position`` ("" without tensor parallelism) keeps the tp coordinates' groups apart. Blocks until
    every member built each (see the module docstring for the order)."""
    return {holders: build_group(store, job, epoch, f"h{'-'.join(map(str, holders))}{tp_position}", member,
                                 len(holders), device_type, timeout)
            for holders in tuples}
