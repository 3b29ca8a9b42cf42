"""A replica's side of the coordinator protocol (``protocol.py``): register, heartbeat, ask, vote, read.

Every rank of a replica holds one client (a ``TCPStore`` connection to the coordinator). The replica's leader
(its local rank 0) registers the incarnation and asks for each step's quorum; every rank keeps a heartbeat of
its own (a replica is alive while all its ranks beat), reads the quorum, votes on its own inter-node reduction
and reads the decision. Nothing here is a collective:
the ranks of one replica learn the leader's incarnation and admission step through the caller (one broadcast
in the replica's own group).
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from hsdp.engine.replicate.elastic.liveness import LivenessPort
from hsdp.engine.replicate.elastic.protocol import ABORT, COMMIT, COMPLETED, STOP, ElasticPolicy, Quorum, key


class JobCompleted(SystemExit):
    """The elastic job this replica came to join is over: its last members finished training (e.g. a replica
    torchrun restarted that was still starting when the others reached the last step). Nothing is wrong and
    nothing is left to do: a ``SystemExit`` with status 0, so a training script that does not catch it ends
    cleanly (and its launcher with it); catch it to do something else. ``str()`` says why."""

    def __init__(self, message: str) -> None:
        super().__init__(0)
        self.message = message

    def __str__(self) -> str:
        return self.message


class QuorumLost(RuntimeError):
    """The coordinator stopped the job: fewer live replicas than the minimum (or no live replica to heal from).
    Stop cleanly (``hsdp train`` writes a checkpoint first)."""


def parse_address(address: str) -> tuple[str, int]:
    """``host:port`` -> ``(host, port)``; ``ValueError`` naming the expected form."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"coordinator address {address!r} is not host:port: set HSDP_COORDINATOR=host:port (the "
                         f"address `hsdp coordinator --port PORT` prints), e.g. HSDP_COORDINATOR=10.0.0.1:29400")
    return host, int(port)


def connect(address: str, job: str, policy: ElasticPolicy) -> dist.Store:
    """A store client on the coordinator serving ``job``; raises ``ValueError`` naming the address and the
    command that starts a coordinator within ``policy.connect_timeout`` instead of hanging."""
    host, port = parse_address(address)
    timeout = timedelta(seconds=policy.connect_timeout)
    # Probed with a plain socket first: the store's own client retries past its timeout (up to twice it) and
    # logs a C++ stack trace per try, which would bury the one line that names the fix.
    problem = _unreachable(host, port, policy.connect_timeout)
    if not problem:
        try:
            store = dist.TCPStore(host, port, is_master=False, timeout=timeout, wait_for_workers=False)
        except (RuntimeError, TimeoutError) as e:
            problem = str(e)
    if problem:
        raise ValueError(f"no hsdp coordinator reachable at {address} within {policy.connect_timeout:g} s ({problem}):"
                         f" start one with `hsdp coordinator --port {port} --replicas N` on that host (hsdp launch "
                         f"--elastic starts it for the emulated cluster), or fix HSDP_COORDINATOR")
    try:
        store.wait([key(job, "coordinator")], timeout)
    except (RuntimeError, TimeoutError):
        raise ValueError(f"the coordinator at {address} serves no elastic job {job!r}: start it with `hsdp "
                         f"coordinator --job {job}`, or set HSDP_ELASTIC_JOB to the job it serves") from None
    return store


def _unreachable(host: str, port: int, timeout: float) -> str:
    """"" once something accepts TCP connections at ``host:port`` within ``timeout`` seconds (a coordinator
    starting up may take a moment), else the last error."""
    deadline = time.monotonic() + timeout
    error = "timed out"
    while (left := deadline - time.monotonic()) > 0:
        try:
            with socket.create_connection((host, port), timeout=left):
                return ""
        except OSError as e:  # refused (nothing listens yet), unresolvable host, no route, timed out
            error = f"{type(e).__name__}: {e}"
        time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
    return error


class CoordinatorClient:
    """One rank's connection to the coordinator for replica ``replica_id`` of ``job``; ``rank``: its rank in the
    replica's own job (0 is the leader)."""

    def __init__(self, store: dist.Store, address: str, job: str, replica_id: int, rank: int,
                 policy: ElasticPolicy) -> None:
        self.store, self.address, self.job, self.replica_id = store, address, job, replica_id
        self.rank, self.policy = rank, policy
        self.incarnation = 0  # the leader's registration; the other ranks learn it from the leader (beat())
        self.tp_degree = 1  # the replica's tensor-parallel degree, registered with its rank count
        self._stop = threading.Event()
        self._beat: tuple[threading.Thread, threading.Event] | None = None  # this incarnation's heartbeat
        self._watch: dist.Store | None = None  # down(): a connection of its own
        self._watch_lock = threading.Lock()
        self._liveness: LivenessPort | None = None  # refused by the kernel once this process is gone

    @property
    def leader(self) -> bool:
        return self.rank == 0

    # -- leader ------------------------------------------------------------------------------------------
    def register(self, degree: int) -> int:
        """Leader: announce a new incarnation of this replica (``degree`` ranks, of :attr:`tp_degree` tp ranks
        each) and start its own heartbeat."""
        self.incarnation = int(self.store.add(key(self.job, "inc", self.replica_id), 1))
        self.store.set(key(self.job, "reg", self.replica_id, self.incarnation),
                       json.dumps({"degree": degree, "tp": self.tp_degree}))
        self.beat(self.incarnation)
        return self.incarnation

    def ready(self) -> None:
        """Leader: the replica's model and optimizer exist; it may be admitted."""
        self.store.set(key(self.job, "ready", self.replica_id, self.incarnation), "1")

    def admitted(self) -> int:
        """Leader: block until the coordinator admits this incarnation; the step it joins at. ``ValueError``
        with the coordinator's reason when it refuses, :class:`JobCompleted` when the job is over, and
        ``TimeoutError`` after ``join_timeout`` seconds (measured: the store's round trips count too)."""
        admit = key(self.job, "admit", self.replica_id, self.incarnation)
        reject = key(self.job, "reject", self.replica_id, self.incarnation)
        deadline = time.monotonic() + self.policy.join_timeout
        while time.monotonic() < deadline:
            if self.store.check([reject]):
                self.raise_if_completed()
                raise ValueError(self.store.get(reject).decode())
            if self.store.check([admit]):
                return int(self.store.get(admit).decode())
            self._stop.wait(0.01)
        raise TimeoutError(f"replica {self.replica_id} was not admitted by the coordinator at {self.address} within "
                           f"{self.policy.join_timeout:g} s (ElasticPolicy.join_timeout)")

    def raise_if_completed(self) -> None:
        """:class:`JobCompleted` when the coordinator says the job is over (its last members finished)."""
        done = key(self.job, COMPLETED)
        if self.store.check([done]):
            raise JobCompleted(f"replica {self.replica_id}: {self.store.get(done).decode()}")

    def want(self, step: int) -> None:
        """Leader: this replica reached ``step`` (the coordinator may publish its quorum)."""
        self.store.set(key(self.job, "want", step, self.replica_id), str(self.incarnation))

    # -- every rank --------------------------------------------------------------------------------------
    def beat(self, incarnation: int) -> None:
        """Prove this rank alive for ``incarnation`` (the leader's registration): a heartbeat thread of its own,
        replacing the one of an earlier incarnation. Every rank beats, so a stopped rank that is not the leader
        gets the replica dropped as fast as a stopped leader."""
        self.incarnation = incarnation
        self._stop_beat()
        self._publish_liveness(incarnation)
        stop = threading.Event()
        thread = threading.Thread(target=self._heartbeat, args=(incarnation, stop), daemon=True,
                                  name=f"hsdp-elastic-heartbeat-{incarnation}")
        self._beat = (thread, stop)
        thread.start()

    def _publish_liveness(self, incarnation: int) -> None:
        """Open this rank's liveness port (once) and tell the coordinator where it is (``liveness.py``): a refused
        probe of it drops the replica at once, where silence takes the heartbeat timeout. Without one (no route
        to tell, a port that cannot be opened) the heartbeat alone judges this rank."""
        try:
            if self._liveness is None:
                self._liveness = LivenessPort(*parse_address(self.address))
            self.store.set(key(self.job, "probe", self.replica_id, incarnation, self.rank), self._liveness.address)
        except (OSError, RuntimeError):
            return

    def _heartbeat(self, incarnation: int, stop: threading.Event) -> None:
        # Its own connection: a blocked wait on the main one must not stop the beat.
        try:
            host, port = parse_address(self.address)
            store = dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                                  timeout=timedelta(seconds=self.policy.connect_timeout))
            beat = key(self.job, "hb", self.replica_id, incarnation, self.rank)
            store.add(beat, 1)
            while not stop.wait(self.policy.heartbeat_interval) and not self._stop.is_set():
                store.add(beat, 1)
        except (RuntimeError, TimeoutError):
            return  # the coordinator is gone: the next wait on the main connection reports it

    def _stop_beat(self) -> None:
        beat, self._beat = self._beat, None
        if beat is None:
            return
        thread, stop = beat
        stop.set()
        if thread is not threading.current_thread():
            thread.join(timeout=2 * self.policy.heartbeat_interval + 1.0)

    def down(self, epoch: int) -> str:
        """Why the groups of ``epoch`` are given up ("" while they are not); on its own connection, since the hop
        worker asks while the main thread may be blocked in a wait on the main one."""
        with self._watch_lock:  # asked from the waiting thread and, on CUDA, the epoch's watcher
            if self._watch is None:
                host, port = parse_address(self.address)
                self._watch = dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                                            timeout=timedelta(seconds=self.policy.connect_timeout))
            k = key(self.job, "down", epoch)
            return self._watch.get(k).decode() if self._watch.check([k]) else ""

    @property
    def closed(self) -> bool:
        return self._stop.is_set()

    def close(self, finished: bool = False) -> None:
        """Stop the heartbeat and close the liveness port: the coordinator drops this replica at its next probe or
        after the heartbeat timeout, or, ``finished`` (this rank ended normally, its training done), without
        counting it a failure (``done/...``, before the beat stops, so the silence is never judged first).
        Idempotent."""
        if finished and self.incarnation and not self._stop.is_set():
            with contextlib.suppress(RuntimeError, TimeoutError):  # the coordinator may be gone at exit
                self.store.set(key(self.job, "done", self.replica_id, self.incarnation, self.rank), "1")
        self._stop.set()
        self._stop_beat()
        if self._liveness is not None:
            self._liveness.close()
            self._liveness = None

    def quorum(self, step: int) -> Quorum:
        """Block until the quorum of ``step`` is published; :class:`QuorumLost` when the job was stopped."""
        text = self._wait(key(self.job, "quorum", step), f"the quorum of step {step}")
        data = json.loads(text)
        if STOP in data:
            raise QuorumLost(f"hsdp elastic: the coordinator stopped the job at step {step}: {data[STOP]}")
        return Quorum.from_json(text)

    def vote(self, step: int, ok: bool, why: str = "") -> None:
        """This rank's inter-node reduction of ``step`` completed (``ok``), or failed (``why``)."""
        if ok:
            self.store.add(key(self.job, "ok", step, self.replica_id), 1)
        else:
            self.store.set(key(self.job, "why", step, self.replica_id), why[:500])
            self.store.add(key(self.job, "fail", step), 1)

    def decision(self, step: int) -> bool:
        """Block until ``step`` is decided: True to commit, False to discard."""
        text = self._wait(key(self.job, "decision", step), f"the decision of step {step}")
        assert text in (COMMIT, ABORT), text
        return text == COMMIT

    def _wait(self, k: str, what: str) -> str:
        try:
            self.store.wait([k], timedelta(seconds=self.policy.join_timeout))
        except (RuntimeError, TimeoutError) as e:
            raise TimeoutError(f"hsdp elastic: no answer from the coordinator at {self.address} for {what} within "
                               f"{self.policy.join_timeout:g} s ({e})") from None
        return self.store.get(k).decode()
