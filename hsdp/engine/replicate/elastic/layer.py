"""The replicate layer of an elastic job: replicas that leave and rejoin between steps.

A :class:`~hsdp.engine.replicate.layer.ReplicateLayer`, like ``fixed.FixedLayer`` (the runtime calls either the
same way): this rank's replica is its
own torchrun job, whose world is the shard group and whose mesh is ``param_mesh``; the other replicas are the
current quorum's members (``protocol.Quorum``), and the ``"replicate"`` group is that quorum's group for this
rank's position (``groups.py``: its shard rank, and its tp rank with tensor parallelism), rebuilt when the epoch
changes. When every replica has the same degree (and the same tp degree), the replica hop is the grid's: one
all-reduce of the whole slot (no piece plan), and a joiner's rank is healed from the same position of a live
member.

A job declared with replicas of different shard degrees (the coordinator's ``--nproc-per-replica``, learnt at
join: ``declared``) is never regular, from its first step to its last: each quorum carries its members' rank
counts, whose degrees (in member order, the replica's place in them :attr:`member`) cut every parameter into
pieces as on a fixed heterogeneous mesh (``runtime/piece_plan.py``, pre-scaled by ``d_r x R / W`` of the
quorum), reduced over one group per holder tuple, made per epoch (``piece_groups.py``) for the row counts
registered at wrap (:meth:`ensure_groups`); joiners are healed piece by piece from a member of any degree
(``optim/elastic_heal.py``). The data a replica reads stays its id's: its ranks follow the declared degrees of
the lower ids.

One step is one transaction: :meth:`begin_step` (the root's forward) tells the coordinator this replica reached
the step; the first inter-node collective, or the commit, waits for the step's quorum (:meth:`await_quorum`:
overlapped with the forward and the backward's first units), rebuilding the group and healing joiners first
when the members changed; :meth:`finish_step` votes and returns whether every member's reduction completed,
in which case, and only then, the optimizer applies the step everywhere.

Under DiLoCo the same lifecycle runs around each sync instead (``optim/outer_transaction.py``): the coordinator's
steps are then sync attempts, and a replica joins at a sync boundary.

A live replica can be dropped too (a rank's heartbeat starved past the coordinator's timeout): the quorum it
reads lacks it, so its step runs alone and is discarded, and :meth:`finish_step` registers it again, waits for
admission and heals it from a live member, like a replica torchrun restarted, within the same process.
"""

from __future__ import annotations

import atexit
import contextlib
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from hsdp.engine.replicate.elastic.bootstrap import admit, rejoin
from hsdp.engine.replicate.elastic.client import CoordinatorClient, QuorumLost
from hsdp.engine.replicate.elastic.groups import abort_group, build_group
from hsdp.engine.replicate.elastic.piece_groups import build_piece_groups, own_tuples
from hsdp.engine.replicate.elastic.protocol import ElasticPolicy, Quorum
from hsdp.engine.replicate.layer import Heal, Holders, StepRecord
from hsdp.engine.replicate.pieces import position_groups


class ElasticLayer:
    """The quorum of an elastic job as the runtime's replicate layer (see the module docstring). ``declared``:
    every replica id's shard degree when the job declared replicas of different degrees, else ``None``."""

    def __init__(self, client: CoordinatorClient, replica_id: int, degree: int, replicas: int, shard_rank: int,
                 shard_group: dist.ProcessGroup, param_mesh: DeviceMesh, device_type: str,
                 policy: ElasticPolicy, tp_rank: int = 0, tp_degree: int = 1,
                 declared: tuple[int, ...] | None = None, on_finished: Callable[[], None] | None = None) -> None:
        self.client, self.replica_id, self.degree, self.configured = client, replica_id, degree, replicas
        self.shard_rank, self.shard_group, self.param_mesh = shard_rank, shard_group, param_mesh
        # The replicate groups' position: one per (shard rank, tp rank); T is in the name, so replicas of another
        # tp degree never meet in one group.
        self.position = str(shard_rank) if tp_degree == 1 else f"{shard_rank}.tp{tp_rank}of{tp_degree}"
        self.ranks = degree * tp_degree  # the replica's job: what it registers with the coordinator
        self.tp_degree, self.declared = tp_degree, declared
        self._tp_position = "" if tp_degree == 1 else f".tp{tp_rank}of{tp_degree}"  # the piece groups' tp part
        self._rows: set[int] = set()  # the parameters' row counts (ensure_groups): the piece groups to make
        self._pieces: dict[Holders, dist.ProcessGroup] = {}  # the epoch's piece groups (declared degrees only)
        self.device_type, self.policy = device_type, policy
        self.step: int | None = None  # the next step this replica runs; known once admitted
        self.quorum: Quorum | None = None
        self.last: StepRecord | None = None
        self.heals: list[Heal] = []
        self._group: dist.ProcessGroup | None = None
        self._built = False  # the current epoch's groups exist
        self._epoch = -1
        self._wanted = -1
        self._voted = -1  # the step whose ok vote step_reduced already cast
        self._failure = ""  # why this step's inter-node reduction failed on this rank ("" = it did not)
        self._unhealed: Quorum | None = None  # a quorum with joiners read before any heal was registered
        self._dropped = False  # the coordinator dropped this live replica: the current step runs alone
        self._retired: list[tuple[float, dist.ProcessGroup]] = []  # replaced groups, kept until safe to destroy
        self._lock = threading.RLock()
        self._on_finished = on_finished  # the watchdog's mark_done: see close
        # At exit, before the interpreter tears threads down: stop the heartbeat, shut the group down (a gloo
        # group destroyed with its threads still running ends the process with std::terminate).
        atexit.register(_close_at_exit, weakref.ref(self))

    # -- shape (layer.py): the last quorum's, never waited for here ----------------------------------------
    @property
    def regular(self) -> bool:
        """Every replica of one degree: one hop of the whole slot over the "replicate" group. Fixed for the run
        (a job declared with different degrees reduces pieces even in a quorum whose members share one)."""
        return self.declared is None

    @property
    def index(self) -> int:
        return self.replica_id  # stable: the data this replica reads does not move when others leave

    @property
    def member(self) -> int:
        """This replica's place in the last quorum (members in id order; its id before the first)."""
        return self.quorum.index(self.replica_id) if self.quorum is not None else self.replica_id

    @property
    def count(self) -> int:
        """The members of the last quorum read (the configured count before the first): the runtime reads it
        after :meth:`await_step`, so within a step it is the step's."""
        return len(self.quorum.members) if self.quorum is not None else self.configured

    @property
    def degrees(self) -> tuple[int, ...]:
        """The shard degrees of the last quorum's members, in member order (every configured replica's before
        the first)."""
        if self.declared is None:
            return (self.degree,) * self.count
        return self._degrees_of(self.quorum) if self.quorum is not None else self.declared

    def _degrees_of(self, quorum: Quorum) -> tuple[int, ...]:
        return tuple(n // self.tp_degree for n in quorum.ranks)

    @property
    def scale(self) -> float:
        """``d_r x R / W`` over the quorum's degrees (``FixedLayer.scale``): 1 when every degree is equal."""
        if self.declared is None:
            return 1.0
        degrees = self.degrees
        return self.degree * len(degrees) / sum(degrees)

    @property
    def start(self) -> int:
        if self.declared is not None:
            return sum(self.declared[:self.replica_id])
        return self.replica_id * self.degree

    @property
    def data_parallel_size(self) -> int:
        return sum(self.data_parallel_degrees)

    @property
    def data_parallel_degrees(self) -> tuple[int, ...]:
        """Every configured replica, present or not: a replica's data does not move when others leave."""
        return self.declared if self.declared is not None else (self.degree,) * self.configured

    @property
    def job_degrees(self) -> tuple[int, ...]:
        return (self.degree,)  # this replica's torchrun job is its own world

    @property
    def transactional(self) -> bool:
        return True  # the coordinator commits or discards each step

    @property
    def outside_world(self) -> bool:
        return True

    @property
    def lowest_member(self) -> int:
        assert self.quorum is not None, "read after await_step (an hsdp bug)"
        return self.quorum.members.index(min(self.quorum.members))

    @property
    def replicate_group(self) -> dist.ProcessGroup | None:
        """This position's group of the step's quorum; ``None`` across replicas of different degrees, whose
        pieces go over several (:meth:`group`)."""
        if not self._built or self.quorum is None or self.quorum.step != self.step:
            raise RuntimeError("the elastic replicate group was read before this step's quorum was awaited "
                               "(ReplicateLayer.await_step; an hsdp bug)")
        return self._group

    def own_position_groups(self) -> list[tuple[int, ...]]:
        if self.regular:
            return [(self.shard_rank,) * self.count]
        return [g for g in position_groups(self.degrees) if g[self.member] == self.shard_rank]

    def group(self, holders: tuple[int, ...]) -> dist.ProcessGroup:
        if self.regular:
            group = self.replicate_group
            assert group is not None
            return group
        self.replicate_group  # noqa: B018 -- raises when read before the step's quorum
        try:
            return self._pieces[holders]
        except KeyError:
            raise RuntimeError(f"no elastic piece group for holders {holders} in epoch {self._epoch} (member "
                               f"{self.member}, shard rank {self.shard_rank}): a parameter's rows were not "
                               f"registered at wrap (ElasticLayer.ensure_groups; an hsdp bug)") from None

    def ensure_groups(self, rows: Iterable[int]) -> None:
        """Remember the parameters' row counts: each epoch makes the groups of their pieces over its quorum's
        degrees (a model wrapped after the first quorum gets its groups from the next epoch on)."""
        self._rows.update(rows)

    def interrupt(self) -> Callable[[], str] | None:
        return self.interrupted

    @property
    def step_open(self) -> bool:
        """This step's quorum was awaited and :meth:`finish_step` has not moved on yet (a joiner right after
        :meth:`attach` is inside the members' current step: under DiLoCo, their sync)."""
        return self.quorum is not None and self.quorum.step == self.step

    # -- lifecycle (layer.py) --------------------------------------------------------------------------------
    def await_step(self) -> None:
        self.await_quorum()

    def step_failed(self, why: str) -> bool:
        self.fail(why)
        return True  # the coordinator discards the step on every member

    def attach(self, heal: Heal) -> None:
        """Register the optimizer's heal and take part in the current step's quorum now: a joiner is healed here,
        before its first forward (also from a quorum read before any heal existed, while the model was wrapped)."""
        self.heals.append(heal)
        self.await_quorum()
        self.heal()

    def interrupted(self) -> str:
        """Why a wait in the current replicate group should give up ("" while it should go on): the
        coordinator's ``down`` notice for the epoch (a member died, a rank's reduction failed)."""
        return self.client.down(self._epoch) if self._epoch >= 0 else ""

    def _admit(self) -> int:
        if self.step is None:
            self.step = admit(self.client)
        return self.step

    def begin_step(self) -> None:
        """This replica reached its next step (the leader tells the coordinator, once; never blocks once the
        replica is admitted; admission waits for the coordinator)."""
        with self._lock:
            step = self._admit()
            if self.client.leader and self._wanted < step:
                self.client.want(step)
            self._wanted = step

    def await_quorum(self) -> Quorum:
        """The quorum of the current step, waited for once; rebuilds the group and heals joiners when the members
        changed. Raises ``QuorumLost`` when the coordinator stopped the job."""
        with self._lock:
            if self.quorum is not None and self.quorum.step == self.step:
                return self.quorum
            self.begin_step()
            assert self.step is not None
            quorum = self.client.quorum(self.step)
            if not self._member(quorum):
                return self._evicted(quorum)
            if quorum.epoch != self._epoch:
                self._retire()
                self._build(quorum.epoch, quorum)
                self._epoch = quorum.epoch
                if self.device_type == "cuda":
                    self._watch(quorum.epoch, self._groups())
            self.quorum = quorum
            if quorum.joiners:
                self._unhealed = quorum
                self.heal()
            return quorum

    def _member(self, quorum: Quorum) -> bool:
        """Whether this incarnation of this replica is one of ``quorum``'s members."""
        return self.replica_id in quorum.members and \
            quorum.incarnations[quorum.index(self.replica_id)] == self.client.incarnation

    def _evicted(self, quorum: Quorum) -> Quorum:
        """The coordinator published this step's quorum without this replica, which is alive: it judged it dead,
        its heartbeat silent past the timeout (a GIL-holding call, a paused host), and the others went on. This
        step runs alone (a group of this replica only: its result is discarded at :meth:`finish_step`, which
        registers the replica again and has it healed, as a restarted one would be, with no restart)."""
        if self.client.leader:  # every rank reads the same quorum: one line says it for the replica
            print(f"hsdp elastic: replica {self.replica_id} (incarnation {self.client.incarnation}) is alive but "
                  f"the coordinator dropped it before step {quorum.step} (members {list(quorum.members)}): a rank's "
                  f"heartbeat was silent for more than the coordinator's heartbeat timeout (a long call holding "
                  f"the GIL, a paused or overloaded host?). Discarding this step here and registering again, to be "
                  f"healed from a live replica (no restart)", file=sys.stderr, flush=True)
        self._retire()
        alone = f"alone-{self.replica_id}-{self.client.incarnation}"  # a group name no quorum epoch takes
        self.quorum = Quorum(quorum.step, -1, (self.replica_id,), (self.client.incarnation,), ranks=(self.ranks,))
        self._build(alone, self.quorum)
        self._epoch = -1  # no coordinator notice concerns a group of one
        self._dropped = True
        return self.quorum

    def _rejoin(self) -> None:
        """After :meth:`_evicted`: a new incarnation, admitted at a later step and healed from a live member (the
        optimizer's heal sets :attr:`last` to the step it was healed after). ``QuorumLost`` when the job stopped
        meanwhile; :class:`~hsdp.engine.replicate.elastic.client.JobCompleted` when it ended."""
        try:
            step = rejoin(self.client, self.ranks)
        except ValueError as e:
            raise QuorumLost(f"hsdp elastic: replica {self.replica_id}, dropped by the coordinator, could not "
                             f"rejoin: {e}") from None
        self._dropped = False
        self.step, self.quorum = step, None
        self.await_quorum()

    def heal(self) -> None:
        """Exchange state with the current quorum's joiners, once, when a heal is registered (the optimizer's:
        the quorum may be read before it exists, e.g. while the model is wrapped)."""
        with self._lock:
            quorum, self._unhealed = self._unhealed, None
            if quorum is None:
                return
            if not self.heals:
                self._unhealed = quorum
                return
            for heal in self.heals:
                heal(quorum)
            if self.replica_id in quorum.joiners:  # healed: as if it had taken part in the members' last step
                self.last = StepRecord(quorum.step - 1, True, tuple(r for r in quorum.members
                                                                    if r not in quorum.joiners))

    def _build(self, name: int | str, quorum: Quorum) -> None:
        """The groups of ``quorum`` under the epoch name ``name``: this position's one group, or across replicas of
        different degrees one per holder tuple this rank is in (``piece_groups.py``)."""
        member, store, job = quorum.index(self.replica_id), self.client.store, self.client.job
        if self.regular:
            self._group = build_group(store, job, name, self.position, member, len(quorum.members), self.device_type,
                                      self.policy.hop_timeout)
        else:
            tuples = own_tuples(self._rows, self._degrees_of(quorum), member, self.shard_rank)
            self._pieces = build_piece_groups(store, job, name, tuples, self._tp_position, member, self.device_type,
                                              self.policy.hop_timeout)
        self._built = True

    def _groups(self) -> list[dist.ProcessGroup]:
        """The current epoch's groups."""
        return ([self._group] if self._group is not None else []) + list(self._pieces.values())

    def _retire(self) -> None:
        """Abort the replaced epoch's groups and keep them for ``hop_timeout``: destroying a gloo group joins its
        threads, and a thread in a collective with a stopped (not dead) peer returns only at that timeout, so
        dropping the group at once would block this step for it. Groups retired longer ago are dropped now
        (their collectives have ended)."""
        groups, self._group, self._pieces, self._built = self._groups(), None, {}, False
        if not groups:
            return
        for group in groups:
            abort_group(group)
        now = time.monotonic()
        bound = self.policy.hop_timeout + 5.0
        self._retired = [(t, g) for t, g in self._retired if now - t < bound] + [(now, g) for g in groups]

    def _watch(self, epoch: int, groups: list[dist.ProcessGroup]) -> None:
        """NCCL: a host wait does not block (the stream does), so a stuck collective cannot be given up by the
        waiting thread as on gloo (``handles.py``); a thread aborts the epoch's communicators on the
        coordinator's ``down`` notice instead, which fails its collectives in flight."""
        def run() -> None:
            while self._epoch == epoch and not self.client.closed:
                if self.client.down(epoch):
                    for group in groups:
                        abort_group(group)
                    return
                time.sleep(self.policy.heartbeat_interval)

        threading.Thread(target=run, name=f"hsdp-elastic-watch-{epoch}", daemon=True).start()

    def close(self, finished: bool = False) -> None:
        """Stop the heartbeat and shut the current group down (the replica leaves; idempotent); ``finished``: it
        leaves because its training is done (the coordinator then tells a replica arriving after every member
        finished that the job completed, instead of that it was lost)."""
        if finished and self._on_finished is not None:
            # The watchdog first: the teardown below may wait up to hop_timeout for a retired group's collective,
            # and a rank whose training is done must not be judged hung, or its peer dead, meanwhile.
            self._on_finished()
        self.client.close(finished)
        groups, self._group, self._pieces, self._built = self._groups(), None, {}, False
        for group in groups:
            with contextlib.suppress(RuntimeError):
                group.shutdown()
        # Retired groups are dropped here, on this thread: one whose collective still waits out a stopped peer
        # holds the exit up to hop_timeout, but a daemon thread inside a group's destructor when the interpreter
        # finalizes would abort the process.
        self._retired.clear()

    def fail(self, why: str) -> None:
        """This rank's inter-node reduction of the current step failed (a member died mid-step): the step will
        be discarded everywhere; the backward itself goes on."""
        self._failure = self._failure or why

    def step_reduced(self) -> None:
        """Every inter-node reduction of the current step completed on this rank: vote for it now, so the
        decision does not wait for this rank to reach :meth:`finish_step` (which then only reads it)."""
        with self._lock:
            if not self.step_open or self._failure or self._dropped or self._voted == self.step:
                return
            assert self.step is not None
            self.client.vote(self.step, True)
            self._voted = self.step

    def finish_step(self) -> bool:
        """Vote on the current step (unless :meth:`step_reduced` did) and wait for the decision; True: apply it
        (every member's reduction completed). Moves on to the next step either way."""
        with self._lock:
            quorum = self.await_quorum()
            failure, self._failure = self._failure, ""
            if self._dropped:  # alive but dropped: this step was this replica's alone
                self._rejoin()
                return False
            step = quorum.step
            if self._voted != step or failure:  # a failure after an ok vote still discards the step
                self.client.vote(step, not failure, failure)
            committed = self.client.decision(step)
            self.last = StepRecord(step, committed, quorum.members)
            self.step = step + 1
            return committed


def _close_at_exit(ref: weakref.ref[ElasticLayer]) -> None:
    layer = ref()
    if layer is not None:
        # An uncaught exception leaves sys.last_value set before atexit runs: that replica failed. (A rank that a
        # fault ends, or the watchdog, exits without atexit: it simply goes silent.)
        layer.close(finished=getattr(sys, "last_value", None) is None)
