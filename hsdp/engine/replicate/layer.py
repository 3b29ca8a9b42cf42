"""The replicate layer's one protocol: what the runtime, the optimizer and the checkpoint code ask of the replicas.

Every mesh has one replicate layer (``HSDPMesh.replicas``), whatever its kind:

* a fixed set of replicas (``fixed.py``): a grid of equal degrees, or replicas of different shard degrees;
* elastic membership (``elastic/layer.py``): replicas that leave and rejoin between steps.

The layer has two faces. Its *shape* says which ranks hold the same rows on other replicas and which groups
reduce them (``degrees``, ``member``, ``group(holders)``, ...): reading it never blocks; on an elastic mesh it is
the shape of the last quorum this replica took part in. ``index`` is this replica's id, which fixes the data it
reads; ``member`` its place in ``degrees``, which fixes the pieces it holds (the same on a fixed layer; on an
elastic one the quorum's members are numbered in id order, so the place moves when others leave).

Its *lifecycle* is the step as a transaction, called by the runtime on every mesh kind, with no ``if elastic``
branch in the caller:

``begin_step()``
    a training forward began (the root unit's pre-forward): elastic tells the coordinator it reached the step.
``await_step()``
    before the step's first inter-node collective: elastic waits for the step's quorum once (overlapped with the
    forward and the backward's first units), rebuilding its group and healing joiners when the members changed.
``step_failed(why) -> bool``
    an inter-node collective of the step failed on this rank: True when the layer discards the step on every
    member instead (the caller drops the step's reductions and returns normally), False when the failure is the
    caller's to raise (a fixed set of replicas cannot go on without a peer).
``step_reduced()``
    every inter-node collective of the step completed on this rank, before ``finish_step``: elastic votes for
    the step now, so the decision waits for no member to reach its ``finish_step`` (DiLoCo: its landing).
``finish_step() -> bool``
    before the optimizer applies the step: True to apply it (a fixed layer always; elastic when the coordinator
    committed it on every member).
``attach(heal)``
    the optimizer's heal (state sent from a live member to joiners); elastic runs it whenever members join.
``close(finished)``
    the replica leaves (idempotent).
``step_open``
    whether a step's quorum was awaited and its ``finish_step`` is still to come: a replica that joined at
    its ``ShardedOptimizer`` construction (``attach``) is inside the members' current step.

Under DiLoCo (``replica_sync=``) the inner steps cross no replicas, so nothing runs this lifecycle per training
step: each fragment's *sync* is the transaction (``optim/outer_transaction.py``). The outer step calls
``begin_step`` and ``await_step`` where a sync starts, ``step_failed`` and ``finish_step`` where it lands (at
once with ``delay=0``; Streaming DiLoCo's ``delay`` inner steps later, the transaction open meanwhile), and lands
the outer update only when ``finish_step`` says so; an elastic layer's step counter then counts sync attempts
(a discarded sync is redone among the survivors as the next one), and a replica joining is healed at the sync
boundary (the heal runs before the sync's all-reduce, in which the joiner's pseudo-gradient weighs 0). On a
fixed layer these calls are no-ops and the sync runs once, as always.

``last`` is what the last optimizer step did across replicas (:class:`StepRecord`; ``None`` on a fixed layer,
where every step is applied by every replica).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from hsdp.engine.replicate.elastic.protocol import Quorum

Holders = tuple[int, ...]  # per replica, the shard rank holding some rows (pieces.Piece.holders)
Heal = Callable[["Quorum"], None]  # sends state from a live member to the quorum's joiners (the optimizer's)


@dataclass(frozen=True)
class StepRecord:
    """What the last optimizer step did: ``step`` (0-based), whether it was ``committed`` (applied on every
    member) or discarded, and the replica ids whose gradients it averaged."""

    step: int
    committed: bool
    replicas: tuple[int, ...]


class ReplicateLayer(Protocol):
    """The replicas of a mesh as the runtime sees them (module docstring): the shape and the step lifecycle."""

    # -- shape: never blocks --------------------------------------------------------------------------------
    @property
    def degrees(self) -> tuple[int, ...]: ...
    @property
    def index(self) -> int: ...
    @property
    def member(self) -> int:
        """This rank's replica's place in :attr:`degrees` (the holder tuples' and the groups' order)."""
        ...
    @property
    def shard_rank(self) -> int: ...
    @property
    def shard_group(self) -> dist.ProcessGroup: ...
    @property
    def param_mesh(self) -> DeviceMesh: ...
    @property
    def regular(self) -> bool: ...
    @property
    def degree(self) -> int: ...
    @property
    def count(self) -> int: ...
    @property
    def start(self) -> int: ...
    @property
    def scale(self) -> float: ...
    @property
    def data_parallel_size(self) -> int: ...
    @property
    def data_parallel_degrees(self) -> tuple[int, ...]:
        """The shard degree of every replica that reads data, in data-parallel rank order (they sum to
        ``data_parallel_size``): what per-replica batch weights are spread over."""
        ...
    @property
    def job_degrees(self) -> tuple[int, ...]: ...
    @property
    def transactional(self) -> bool: ...
    @property
    def outside_world(self) -> bool: ...
    @property
    def lowest_member(self) -> int: ...
    @property
    def replicate_group(self) -> dist.ProcessGroup | None: ...
    @property
    def last(self) -> StepRecord | None: ...
    @property
    def step_open(self) -> bool: ...
    def own_position_groups(self) -> list[Holders]: ...
    def group(self, holders: Holders) -> dist.ProcessGroup: ...
    def ensure_groups(self, rows: Iterable[int]) -> None:
        """Make the groups of the pieces of parameters of ``rows`` rows (TP-local dim-0 sizes), and of the
        position groups, available to :meth:`group`: at wrap, on every rank alike."""
        ...
    def interrupt(self) -> Callable[[], str] | None:
        """What a host wait on a replicate collective polls to give up early (``""``: go on), or ``None``."""
        ...

    # -- lifecycle: called on every mesh kind ------------------------------------------------------------
    def begin_step(self) -> None: ...
    def await_step(self) -> None: ...
    def step_failed(self, why: str) -> bool: ...
    def step_reduced(self) -> None: ...
    def finish_step(self) -> bool: ...
    def attach(self, heal: Heal) -> None: ...
    def close(self, finished: bool = False) -> None: ...
