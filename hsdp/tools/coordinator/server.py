"""The elastic coordinator: the one process that decides membership and commits, on torch's ``TCPStore``.

It hosts the store the replicas meet on and runs one small state machine per job (keys and meanings:
``hsdp/engine/replicate/elastic/protocol.py``). Per step: wait until every live member asked for the step (``want``),
drop members one of whose ranks went silent and let those that finished leave, admit registered replicas as
joiners (healed from a live member), publish the quorum; then wait for every rank's vote and publish ``commit``
or ``abort``. Liveness is judged by every rank's heartbeat counter, read with the coordinator's own clock, so
hosts' clocks never need to agree; and, faster, by a probe of each rank's liveness port (``probe.py``) when a
rank's reduction failed or a member is late for a step: a dead process refuses it, so the survivors go on within a
second of a kill instead of after the heartbeat timeout, while a slow or stopped one still answers.

Refused, each told why (``reject/...``): an id used twice (a second incarnation while the first still beats past
the heartbeat timeout, admitted or not; a torchrun restart is told from it by the old one going silent), a
replica whose rank count is not the job's (fixed by the first quorum: the most common count among the ready
replicas; in a job of replicas of different degrees, declared per id with ``ranks``: not its id's), one whose
tensor-parallel degree is not the job's (fixed alike), and any replica once the job stopped (below the
minimum, or every replica died) or completed (its last members finished training: ``completed`` tells a late
replica it has nothing to join).

State is tiny (members, step, epoch) and lives in this process: like torchft's lighthouse the coordinator is a
single point of failure. It is reached through the ``Store`` interface only, so a replicated store (etcd, which
torch's elastic rendezvous speaks) can replace the ``TCPStore`` later.
"""

from __future__ import annotations

import collections
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch.distributed as dist

from hsdp.engine.replicate.elastic.protocol import ABORT, COMMIT, COMPLETED, STOP, ElasticPolicy, Quorum, key
from hsdp.tools.coordinator.probe import CONNECTED, REFUSED, SILENT, probe

# Probes (probe.py): members late for a step are probed at most this often (a straggler costs one connect per
# interval); a probe waits this long for an answer: a LAN answers in well under a millisecond, and a rank that
# answers slower is left to the heartbeat.
PROBE_INTERVAL_S = 0.1
PROBE_TIMEOUT_S = 0.1


@dataclass
class _Incarnation:
    replica: int
    number: int
    degree: int  # its rank count (tp ranks included)
    registered: float
    tp: int = 1  # its tensor-parallel degree
    ready: bool = False
    refused: bool = False  # told why it cannot join (``reject/...``); never admitted
    # Per rank of the replica (every rank beats): its heartbeat counter as last read (-1: never), the
    # coordinator's clock when it last moved (or the registration), and whether the rank ended normally.
    beats: list[int] = field(default_factory=list)
    seen: list[float] = field(default_factory=list)
    done: list[bool] = field(default_factory=list)
    # Per rank: its liveness port once a probe of it connected (``probe.py``: only then is a refusal proof of
    # death, not a firewall's), and whether a probe found it gone.
    ports: list[str | None] = field(default_factory=list)
    gone: bool = False

    def __post_init__(self) -> None:
        self.beats = self.beats or [-1] * self.degree
        self.seen = self.seen or [self.registered] * self.degree
        self.done = self.done or [False] * self.degree
        self.ports = self.ports or [None] * self.degree


@dataclass
class JobState:
    """What the coordinator knows about one job (inspectable by tests)."""

    step: int = 0
    epoch: int = -1
    members: dict[int, _Incarnation] = field(default_factory=dict)
    pending: dict[int, _Incarnation] = field(default_factory=dict)  # registered, not yet admitted
    # Later incarnations of an id whose pending one still beats: a restart (admitted once the older one is
    # silent) or a second replica using the id (refused).
    claims: list[_Incarnation] = field(default_factory=list)
    degree: int | None = None  # every replica's rank count, fixed by the first quorum (one degree per job)
    tp: int | None = None  # every replica's tensor-parallel degree, fixed by the first quorum
    known: dict[int, int] = field(default_factory=dict)  # replica id -> incarnations seen
    quorum: Quorum | None = None  # published for ``step``, awaiting votes
    last: dict[int, int] = field(default_factory=dict)  # the previous quorum's members: id -> incarnation
    stopped: str = ""
    completed: str = ""  # why the job is over: its last members finished (not lost: late replicas end cleanly)
    finished: set[int] = field(default_factory=set)  # members that left finished since the last quorum
    finishers: set[tuple[int, int]] = field(default_factory=set)  # (id, incarnation) of every member that finished
    gone: set[tuple[int, int]] = field(default_factory=set)  # (id, incarnation) of members a probe found dead
    history: list[tuple[int, str, tuple[int, ...]]] = field(default_factory=list)  # (step, decision, members)
    refusals: list[tuple[int, int, str]] = field(default_factory=list)  # (replica, incarnation, why), in order


class Coordinator:
    """Decide quorums and commits for ``job``: ``replicas`` configured replica ids (0..replicas-1), at least
    ``min_replicas`` live ones to go on (default: a majority). ``ranks``: the rank count of each id, for a job
    of replicas of different shard degrees (told to the replicas, which then reduce over pieces; a replica of
    another count than its id's is refused); ``None``: every replica has the first quorum's count. Call
    :meth:`poll` in a loop (:meth:`serve`)."""

    def __init__(self, store: dist.Store, job: str, replicas: int, min_replicas: int | None = None,
                 policy: ElasticPolicy | None = None, clock: Callable[[], float] = time.monotonic,
                 start_grace: float = 10.0, ranks: Sequence[int] | None = None) -> None:
        if replicas < 1:
            raise ValueError(f"an elastic job needs at least one replica, got replicas={replicas}")
        if ranks is not None and (len(ranks) != replicas or min(ranks) < 1):
            raise ValueError(f"ranks={list(ranks)}: give one positive rank count per replica id 0..{replicas - 1}")
        self.min_replicas = replicas // 2 + 1 if min_replicas is None else min_replicas
        if not 1 <= self.min_replicas <= replicas:
            raise ValueError(f"min_replicas={min_replicas} must lie in 1..{replicas} (replicas={replicas})")
        self.store, self.job, self.replicas = store, job, replicas
        self.policy = policy or ElasticPolicy()
        self.clock = clock
        self.start_grace = start_grace  # at step 0: how long to wait for every configured replica
        self.state = JobState()
        self._started = clock()
        self._next_probe = 0.0  # when members late for a step may be probed again
        self._probed = -1  # the last step whose failed vote had every member probed
        self.ranks = tuple(ranks) if ranks is not None else None
        told: dict[str, object] = {"replicas": replicas, "min_replicas": self.min_replicas}
        if self.ranks is not None:
            told["ranks"] = list(self.ranks)
        store.set(key(job, "coordinator"), json.dumps(told))

    def serve(self, stop: Callable[[], bool] = lambda: False, period: float = 0.005) -> None:
        """Poll until ``stop()`` is true."""
        while not stop():
            self.poll()
            time.sleep(period)

    # -- one round ---------------------------------------------------------------------------------------
    def poll(self) -> None:
        if self.state.stopped or self.state.completed:
            self._discover()
            self._refuse_pending()  # a replica torchrun restarts after the end
            return
        self._discover()
        self._beat()
        self._reject_duplicates()
        self._settle_claims()
        self._refuse_misfits()
        if self.state.quorum is None:
            self._maybe_decide_quorum()
        else:
            self._maybe_decide_commit()

    def _get(self, *parts: object) -> str | None:
        k = key(self.job, *parts)
        return self.store.get(k).decode() if self.store.check([k]) else None

    def _counter(self, *parts: object) -> int:
        return int(self.store.add(key(self.job, *parts), 0))

    def _discover(self) -> None:
        """New incarnations (a replica's leader registered): pending until admitted."""
        s = self.state
        for replica in range(self.replicas):
            count = self._counter("inc", replica)
            for number in range(s.known.get(replica, 0) + 1, count + 1):
                reg = self._get("reg", replica, number)
                if reg is None:
                    return  # registered its number but not yet its details: next round
                told = json.loads(reg)
                inc = _Incarnation(replica, number, told["degree"], self.clock(), told.get("tp", 1))
                held = s.pending.get(replica)
                if held is not None and not held.refused and self._alive(held):
                    s.claims.append(inc)  # judged by _settle_claims once the older one had time to go silent
                else:
                    s.pending[replica] = inc
                s.known[replica] = number

    def _beat(self) -> None:
        """Read every rank's heartbeat; a rank silent for half the timeout is asked whether it ended normally
        (read only then: a finished rank's silence must never be judged first, and live ones cost no read)."""
        now = self.clock()
        for inc in [*self.state.members.values(), *self.state.pending.values()]:
            for rank in range(inc.degree):
                if inc.done[rank]:
                    continue
                beats = self._counter("hb", inc.replica, inc.number, rank)
                if beats != inc.beats[rank]:
                    inc.beats[rank], inc.seen[rank] = beats, now
                elif now - inc.seen[rank] > self.policy.heartbeat_timeout / 2:
                    inc.done[rank] = self._get("done", inc.replica, inc.number, rank) is not None

    def _alive(self, inc: _Incarnation) -> bool:
        """Every rank beats (or ended normally) and none was found gone: one stopped or starved rank of any
        position is enough to drop the replica, which cannot finish its step without it."""
        now = self.clock()
        return not inc.gone and all(done or now - seen <= self.policy.heartbeat_timeout
                                    for done, seen in zip(inc.done, inc.seen))

    def _trust_ports(self, inc: _Incarnation) -> None:
        """Probe the liveness ports ``inc``'s ranks published, once, while they beat (before admission): those that
        connect are the ones a later refusal proves dead."""
        found = [(rank, self._get("probe", inc.replica, inc.number, rank)) for rank in range(inc.degree)]
        found = [(rank, address) for rank, address in found if address is not None]
        for (rank, address), verdict in zip(found, probe([a for _, a in found], PROBE_TIMEOUT_S)):
            inc.ports[rank] = address if verdict == CONNECTED else None

    def _probe(self, incs: list[_Incarnation]) -> list[int]:
        """Probe the live ranks of ``incs`` (a failed vote, or members late for a step): the replicas one of whose
        ranks is refused are gone at once (a dead process); the ids of those found so. A rank that answers, or
        answers nothing in time, is left to the heartbeat: slow is not dead."""
        targets = [(inc, rank, inc.ports[rank]) for inc in incs if not inc.gone
                   for rank in range(inc.degree) if inc.ports[rank] and not inc.done[rank]]
        found = []
        for (inc, rank, _), verdict in zip(targets, probe([a for _, _, a in targets], PROBE_TIMEOUT_S)):
            if verdict == REFUSED and not inc.gone:
                # A rank that ended normally closed its port too: finished, not dead (its done/ key says so).
                inc.done[rank] = self._get("done", inc.replica, inc.number, rank) is not None
                if not inc.done[rank]:
                    inc.gone = True
                    found.append(inc.replica)
            elif verdict == SILENT:
                inc.ports[rank] = None  # a vanished host or a slow route: no more probes, the heartbeat judges it
        return found

    def _finished(self, inc: _Incarnation) -> bool:
        """Every rank ended normally: the replica left because its training is done."""
        return all(inc.done)

    def _ready(self, inc: _Incarnation) -> bool:
        """Every rank beating, and its model and optimizer are built (``ready/<id>/<incarnation>``): admitting
        it then keeps the members' heal from waiting on the joiner's start-up."""
        if not inc.ready:
            inc.ready = self._get("ready", inc.replica, inc.number) is not None
            if inc.ready:
                self._trust_ports(inc)
        return inc.ready and not inc.refused and self._alive(inc) and min(inc.beats) >= 0

    def _reject_duplicates(self) -> None:
        """A new incarnation of an id whose member still beats, past the timeout: a second replica using the id
        (a restart would have stopped beating by then)."""
        s = self.state
        for replica, inc in list(s.pending.items()):
            old = s.members.get(replica)
            if (old is not None and not inc.refused and self._alive(old)
                    and self.clock() - inc.registered > self.policy.heartbeat_timeout):
                self._reject(inc, self._in_use(old))
                del s.pending[replica]

    def _settle_claims(self) -> None:
        """A later incarnation of an id whose earlier one is still waiting for admission: it takes the earlier
        one's place once that one went silent (a restart before admission), and is refused when the earlier one
        still beats past the timeout (two replicas, or two jobs, using one id before either was admitted)."""
        s = self.state
        for inc in list(s.claims):
            held = s.pending.get(inc.replica)
            if held is None or held.refused or not self._alive(held):
                s.claims.remove(inc)
                s.pending[inc.replica] = inc  # a member of that id, if any, is judged by _reject_duplicates
            elif self.clock() - inc.registered > self.policy.heartbeat_timeout:
                s.claims.remove(inc)
                self._reject(inc, self._in_use(held))

    def _in_use(self, holder: _Incarnation) -> str:
        return (f"replica id {holder.replica} of job {self.job!r} is in use by a live replica (incarnation "
                f"{holder.number}): give every replica group its own HSDP_REPLICA_ID, or run a second job under "
                f"another HSDP_ELASTIC_JOB prefix (hsdp coordinator --job NAME) or coordinator")

    def _reject(self, inc: _Incarnation, why: str) -> None:
        """Tell ``inc`` why it is not admitted (its leader raises ``ValueError`` with ``why``)."""
        inc.refused = True
        self.state.refusals.append((inc.replica, inc.number, why))
        self.store.set(key(self.job, "reject", inc.replica, inc.number), why)

    def _refuse_misfits(self) -> bool:
        """Refuse waiting incarnations that cannot reduce with the job's replicas (:meth:`_misfit`); whether any
        was. They stay pending, refused, so the membership log says nothing it would word as an id in use."""
        odd = [(inc, why) for inc in self.state.pending.values() if not inc.refused and (why := self._misfit(inc))]
        for inc, why in odd:
            self._reject(inc, why)
        return bool(odd)

    def _misfit(self, inc: _Incarnation) -> str:
        """Why ``inc`` cannot join ("" when it can): a rank count other than its id's (replicas of different
        degrees) or the job's (one degree: a joiner is healed shard by shard), or another tensor-parallel degree
        (the replicate groups are per (shard, tp) position)."""
        s, other = self.state, "or run a different job under its own HSDP_ELASTIC_JOB (hsdp coordinator --job NAME)"
        if self.ranks is not None and inc.degree != self.ranks[inc.replica]:
            want = self.ranks[inc.replica]
            return (f"replica {inc.replica} of job {self.job!r} has {inc.degree} rank(s), its id was declared with "
                    f"{want} (--nproc-per-replica {','.join(map(str, self.ranks))}): start it with {want} ranks "
                    f"(torchrun --nproc-per-node {want}), fix --nproc-per-replica, {other}")
        if self.ranks is None and s.degree is not None and inc.degree != s.degree:
            return (f"replica {inc.replica} of job {self.job!r} has {inc.degree} rank(s), the job's replicas have "
                    f"{s.degree}: every replica needs the same number of ranks (a joiner is healed shard by shard "
                    f"from a live one): start it with {s.degree} ranks (torchrun --nproc-per-node {s.degree}), "
                    f"{other} or coordinator; for replicas of different degrees declare each id's rank count "
                    f"(hsdp coordinator --nproc-per-replica N,N,...)")
        if s.tp is not None and inc.tp != s.tp:
            return (f"replica {inc.replica} of job {self.job!r} has tensor_parallel_degree={inc.tp}, the job's "
                    f"replicas have {s.tp}: every replica needs the same tensor-parallel degree (gradients are "
                    f"reduced per (shard, tp) position): start it with tensor_parallel_degree={s.tp}, {other}")
        return ""

    def _first(self, attribute: str) -> int:
        """The first quorum's value of an incarnation ``attribute`` (rank count, tp degree): the most common
        among the ready replicas (ties: the lowest id's), so one replica started wrong does not refuse all the
        others."""
        ready = sorted((r, getattr(inc, attribute)) for r, inc in self.state.pending.items() if self._ready(inc))
        counts = collections.Counter(d for _, d in ready)
        return max((d for _, d in ready), key=lambda d: counts[d])  # max keeps the first (lowest id) of a tie

    # -- quorum ------------------------------------------------------------------------------------------
    def _drop_gone_members(self) -> None:
        """Members that finished leave (no failure: nobody waits in a group for them); silent ones are dropped
        and the ranks still waiting in their epoch's groups told to give up."""
        s = self.state
        for replica, inc in list(s.members.items()):
            if self._finished(inc):
                del s.members[replica]
                s.finished.add(replica)
                s.finishers.add((replica, inc.number))
            elif not self._alive(inc):
                del s.members[replica]
                if inc.gone:
                    s.gone.add((replica, inc.number))
                self._down(f"replica {replica} {'died' if inc.gone else 'stopped beating'}")

    def _maybe_decide_quorum(self) -> None:
        s = self.state
        self._drop_gone_members()
        if s.step == 0 and not s.members:
            if not self._start_ready():
                return
            if s.tp is None:
                s.degree = self._first("degree") if self.ranks is None else None
                s.tp = self._first("tp")
                if self._refuse_misfits():
                    return  # decide again without them (they no longer count as ready)
        elif not s.members and s.finished:
            self._complete()  # the last members finished training: a late replica has nothing to join
            return
        elif not s.members:
            # Every replica that held the state died (none finished): nothing to heal from.
            self._stop(f"no live replica holds the model state at step {s.step} (every replica died): start a new "
                       f"job from a checkpoint")
            return
        elif any(self._get("want", s.step, r) is None for r in s.members):
            self._probe_late()  # a live member is still computing the previous step, or died between steps
            return
        joiners = {r: inc for r, inc in s.pending.items() if self._ready(inc)
                   and (r not in s.members or not self._alive(s.members[r]))}
        merged = {**s.members, **joiners}
        if len(merged) < self.min_replicas:
            self._stop(f"{len(merged)} live replica(s) {sorted(merged)} is below the minimum of {self.min_replicas}"
                       f" (--min-replicas): to go on, start a new job (a new coordinator) from a checkpoint with at "
                       f"least {self.min_replicas} live replicas, or with a lower --min-replicas")
            return
        source = min(s.members) if s.members else min(merged)
        if not s.members:  # the first quorum: everyone but the source is healed from it, so all start equal
            joiners = {r: inc for r, inc in merged.items() if r != source}
        if {r: inc.number for r, inc in merged.items()} != s.last:
            s.epoch += 1  # the replicate groups are rebuilt under the new epoch
            s.last = {r: inc.number for r, inc in merged.items()}
        for r, inc in merged.items():
            if s.pending.get(r) is inc:  # new incarnations (the source of a first quorum too) learn their step
                del s.pending[r]
                self.store.set(key(self.job, "admit", r, inc.number), str(s.step))
        s.members = merged
        s.finished = set()  # those that finished before this quorum did not end the job: its members go on
        ids = tuple(sorted(merged))
        s.quorum = Quorum(s.step, s.epoch, ids, tuple(merged[r].number for r in ids), tuple(sorted(joiners)),
                          source if joiners else None, tuple(merged[r].degree for r in ids))
        self.store.set(key(self.job, "quorum", s.step), s.quorum.to_json())

    def _probe_late(self) -> None:
        """Once some member asked for the step, probe the ones that did not (every ``PROBE_INTERVAL_S``): one that
        died between steps is dropped now instead of after the heartbeat timeout."""
        s = self.state
        late = [inc for r, inc in s.members.items() if self._get("want", s.step, r) is None]
        now = self.clock()
        if len(late) == len(s.members) or now < self._next_probe:
            return
        self._next_probe = now + PROBE_INTERVAL_S
        if self._probe(late):
            self._drop_gone_members()

    def _down(self, why: str) -> None:
        """Tell every rank still waiting in the current epoch's groups to give up (``down/<epoch>``)."""
        k = key(self.job, "down", self.state.epoch)
        if not self.store.check([k]):
            self.store.set(k, why)

    def _start_ready(self) -> bool:
        """Step 0: every configured replica registered and beating, or enough of them after the grace period."""
        s = self.state
        ready = [inc for inc in s.pending.values() if self._ready(inc)]
        if len(ready) == self.replicas:
            return True
        return len(ready) >= self.min_replicas and self.clock() - self._started > self.start_grace

    def _stop(self, reason: str) -> None:
        s = self.state
        s.stopped = reason
        self.store.set(key(self.job, "quorum", s.step), json.dumps({STOP: reason}))
        self._refuse_pending()

    def _complete(self) -> None:
        """The job is over: its last members finished. Said on ``completed`` first, so a replica refused now
        (or arriving later) reads that it has nothing to join, not that the job was lost."""
        s = self.state
        s.completed = (f"the elastic job {self.job!r} completed: replica(s) {sorted(s.finished)} finished training "
                       f"after step {s.step - 1} and none is left to join; nothing to do (this is not a failure)")
        self.store.set(key(self.job, COMPLETED), s.completed)
        self._refuse_pending()

    def _refuse_pending(self) -> None:
        """Registered replicas waiting for admission learn the job is over (instead of waiting it out)."""
        s = self.state
        why = s.completed or f"the elastic job {self.job!r} stopped: {s.stopped}"
        for inc in [*s.pending.values(), *s.claims]:
            if not inc.refused:  # one already refused keeps its own reason
                self._reject(inc, why)
        s.pending.clear()
        s.claims.clear()

    # -- commit ------------------------------------------------------------------------------------------
    def _maybe_decide_commit(self) -> None:
        s = self.state
        q = s.quorum
        assert q is not None
        finished = [r for r in q.members if self._finished(s.members[r])]
        if len(finished) == len(q.members):
            # Asked for by the members' checks after their last step (check_replicas): no step was trained.
            self.store.set(key(self.job, "decision", q.step), ABORT)
            s.quorum = None
            return
        votes = any(self._counter("ok", q.step, r) for r in q.members) or self._counter("fail", q.step) > 0
        if finished and not votes:
            return  # members ending one after another (their last checks): wait for the rest to finish or vote
        failed = self._counter("fail", q.step) > 0
        if failed and self._probed != q.step:  # a rank's reduction broke: whose process is gone, if anyone's?
            self._probed = q.step
            self._probe([s.members[r] for r in q.members])
        # A member that finished mid-step (its loop ended between forward and step) cannot vote either.
        dead = [r for r in q.members if not self._alive(s.members[r]) or r in finished]
        if failed or dead:
            decision = ABORT
            self._down(f"replica(s) {dead} died or stopped beating" if dead else
                       f"a rank's reduction of step {q.step} failed")
        elif all(self._counter("ok", q.step, r) >= s.members[r].degree for r in q.members):
            decision = COMMIT
        else:
            return
        self.store.set(key(self.job, "decision", q.step), decision)
        if decision == ABORT:
            s.last = {}  # a new epoch next step: the groups of an aborted step may be broken
        s.history.append((q.step, decision, q.members))
        s.quorum = None
        s.step += 1

