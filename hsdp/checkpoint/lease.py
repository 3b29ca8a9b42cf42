"""One job per run directory: a lease that a second job respects, so two jobs never interleave checkpoints.

Two jobs writing one run directory interleave ``step_*`` directories and move ``latest`` under each other
(a restarted job next to the orphaned ranks of the old one, say). So the job that saves into a run
directory holds its lease, a file beside it (``runs/x.lease`` for ``runs/x``, outside the directory so
its listing holds checkpoints only)::

    {"job": "torchrun run 7f3a...", "host": "node1", "pid": 4242, "pid_space": "...", "token": "...",
     "since": 1718000000.0}

``pid`` is the holding process (global rank 0 of the job); the file's modification time is the heartbeat.

* Taking it: the file is created complete and atomically (a hard link of a finished temporary file:
  of several jobs racing, exactly one succeeds).
* Keeping it: the holder touches the heartbeat from its watchdog thread every ``stale_after / 6``
  seconds, else at each save; it gives the lease back at the end of ``hsdp train`` or at exit.
* Another job that finds a *live* lease refuses with a message naming the holder. A *stale* one (its
  heartbeat older than ``stale_after``, or its process gone when it ran on this host) is taken over with
  a warning: the file is renamed aside (one taker wins) and a new one linked in its place.
* A holder whose lease was taken over (it had stopped renewing for longer than the bound: frozen, or cut
  off from the storage) finds another token in the file at its next renewal or save, and stops before
  writing anything more: the watchdog check ends every rank, a save raises on every rank.
* Several processes of one job may hold it in turn (``shared=``: a label naming the job, e.g. an elastic
  job's replicas, each its own torchrun job): one takes it over from another with the same label at once,
  live or not, without a warning; the one that lost it that way stops renewing quietly (no watchdog
  failure), its next save is refused, and it may take it back later. Which of them writes when is the
  caller's rule (``hsdp train``: the lowest replica id of each step's members, one at a time).

Readers ignore the lease: loading or exporting a checkpoint works while another job holds the directory.
A job holds a lease in one process (rank 0), so which leases a process holds is process-wide state, like
the watchdog registry: the one module-level table here maps each held run directory to its lease.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import json
import os
import socket
import threading
import time
import uuid
import warnings
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from hsdp.checkpoint.rundir import OLD_MARK, TMP_MARK, fsync_dir

if TYPE_CHECKING:
    from hsdp.engine.faults.watchdog import Watchdog

LEASE_SUFFIX = ".lease"
# A heartbeat older than this marks a holder dead: generous, since the clocks of two hosts may disagree a
# little and a loaded file system may delay a renewal.
DEFAULT_STALE_AFTER = 60.0
_RENEWALS_PER_BOUND = 6
_NO_HARD_LINKS = (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS)  # link(2) on such file systems
_READ_ONLY = (errno.EACCES, errno.EROFS)  # the run directory's parent takes no new file
_HELD: dict[str, RunDirLease] = {}


def lease_path(run_dir: str | os.PathLike) -> str:
    """The lease file of ``run_dir``: ``<run_dir>.lease`` beside it (symbolic links resolved)."""
    return os.path.realpath(os.fspath(run_dir)).rstrip(os.sep) + LEASE_SUFFIX


def job_label(env: dict[str, str] | None = None) -> str:
    """The launcher's name for this job (Slurm job, torchrun run), or ``""`` when it gives none."""
    env = dict(os.environ) if env is None else env
    if env.get("SLURM_JOB_ID"):
        return f"slurm job {env['SLURM_JOB_ID']}"
    run_id = env.get("TORCHELASTIC_RUN_ID", "")
    return f"torchrun run {run_id}" if run_id and run_id != "none" else ""


def pid_space() -> str:
    """Where a pid names one process: this boot of this machine and this pid namespace (containers on one
    machine share the boot, not the pid numbers). Two holders in one pid space can check each other's pid."""
    parts = [socket.gethostname()]
    with contextlib.suppress(OSError):
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            parts.append(f.read().strip())
        parts.append(str(os.stat("/proc/self/ns/pid").st_ino))
    return ":".join(parts)


def process_alive(pid: int) -> bool:
    """Whether ``pid`` runs on this machine (a zombie, exited but not reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process: alive
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            # An orphan's zombie may never be reaped in a container whose first process does not reap.
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True  # no /proc (not Linux): kill() said it exists


@dataclass(frozen=True)
class Holder:
    """What a lease file says: the job, its holding process and the token that tells two leases apart."""

    job: str
    host: str
    pid: int
    pid_space: str
    token: str
    since: float
    shared: str = ""  # the label of the job whose processes hold the lease in turn ("": this process alone)

    @classmethod
    def mine(cls, shared: str = "") -> Holder:
        return cls(job_label(), socket.gethostname(), os.getpid(), pid_space(), uuid.uuid4().hex, time.time(),
                   shared)

    def shared_with(self, shared: str) -> bool:
        """Whether a process of the job labelled ``shared`` may take this lease over at once."""
        return bool(shared) and self.shared == shared

    def describe(self, heartbeat: float) -> str:
        age = max(0.0, time.time() - heartbeat)
        if self.pid < 0:
            return f"an unreadable lease file (last written {age:.0f} s ago)"
        job = f"job '{self.job}'" if self.job else "a job"
        return f"{job} (pid {self.pid} on host {self.host}, last heartbeat {age:.0f} s ago)"

    def is_this_process(self) -> bool:
        return self.pid == os.getpid() and self.pid_space == pid_space()

    def stale_reason(self, heartbeat: float, stale_after: float) -> str | None:
        """Why this lease may be taken over, or ``None`` while its holder counts as alive."""
        if self.pid_space == pid_space() and not process_alive(self.pid):
            return f"its process (pid {self.pid}) is gone"
        age = time.time() - heartbeat
        if age > stale_after:
            return f"its heartbeat is {age:.0f} s old (the bound is {stale_after:.0f} s)"
        return None


def read_lease(path: str) -> tuple[Holder, float] | None:
    """``(holder, heartbeat time)`` of the lease file ``path``; ``None`` when there is none. A file that is
    not a lease (hand-edited, cut short by a full disk, being written where there are no hard links) reads
    as an unknown holder, live until its modification time is older than the bound."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read(4096)
            heartbeat = os.fstat(f.fileno()).st_mtime
    except FileNotFoundError:
        return None
    try:
        return Holder(**json.loads(text)), heartbeat
    except (ValueError, TypeError):
        return Holder("", "", -1, "", "", 0.0), heartbeat


def _create(path: str, holder: Holder) -> bool:
    """Create ``path`` holding ``holder``, complete at once; ``False`` if a lease exists already."""
    tmp = f"{path}{TMP_MARK}{holder.token[:12]}"
    try:
        _write(tmp, holder, os.O_CREAT | os.O_TRUNC)
        os.link(tmp, path)  # fails with EEXIST, unlike rename: the atomic "create if absent"
    except FileExistsError:
        return False
    except OSError as e:
        if e.errno not in _NO_HARD_LINKS:
            raise
        # Some network and FUSE file systems have no hard links: create exclusively, then write. A reader
        # that comes in between sees an empty file, with a fresh modification time: live, so it waits.
        try:
            _write(path, holder, os.O_CREAT | os.O_EXCL)
        except FileExistsError:
            return False
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    fsync_dir(os.path.dirname(path))
    return True


def _write(path: str, holder: Holder, flags: int) -> None:
    fd = os.open(path, os.O_WRONLY | flags, 0o644)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(asdict(holder), f)
        f.flush()
        os.fsync(f.fileno())


def _set_aside(path: str, stale: Holder) -> bool:
    """Remove the stale lease ``stale`` from ``path``; ``False`` when another job got there first."""
    aside = f"{path}{OLD_MARK}{uuid.uuid4().hex[:12]}"
    try:
        os.rename(path, aside)  # of several takers, one moves the file; the others find it gone
    except FileNotFoundError:
        return False
    moved = read_lease(aside)
    if moved is None or moved[0].token != stale.token:  # a racing taker's fresh lease: put it back
        with contextlib.suppress(OSError):
            os.link(aside, path)
        with contextlib.suppress(OSError):
            os.unlink(aside)
        return False
    os.unlink(aside)
    return True


def _refusal(run_dir: str, holder: Holder, heartbeat: float, stale_after: float) -> str:
    return (f"{run_dir} is in use by {holder.describe(heartbeat)}: two jobs must not write checkpoints into one "
            f"run directory. Wait for that job to end or stop it (a lease whose holder died is taken over; on "
            f"another host after {stale_after:.0f} s without a heartbeat), or use another directory; loading "
            f"from it works meanwhile")


class RunDirLease:
    """This process's lease on ``run_dir`` (see :func:`hold_lease`)."""

    def __init__(self, run_dir: str, holder: Holder, stale_after: float, protected: bool = True) -> None:
        self.run_dir = run_dir
        self.path = lease_path(run_dir)
        self.holder = holder
        self.stale_after = stale_after
        # False: the lease file could not be created (see _acquire); the job runs unprotected, as it did
        # before leases existed, and there is nothing to renew or give back.
        self.protected = protected
        self.released = not protected
        self.passed_on = False  # taken over by another process of the same shared job (see the module docstring)
        self._renewed = time.monotonic()
        self._lock = threading.Lock()  # the watchdog thread renews while the main thread may save
        self._watched: set[int] = set()

    def renew(self) -> str | None:
        """Touch the heartbeat; ``None`` while the lease is this process's, else why it is lost."""
        with self._lock:
            if not self.protected:
                return None
            if self.released:
                how = f"passed to another process of job {self.holder.shared!r}" if self.passed_on else "given back"
                return f"the lease on {self.run_dir} was {how}"
            found = read_lease(self.path)
            if found is None and _create(self.path, self.holder):  # deleted by hand: this job still holds
                found = (self.holder, time.time())
            if found is not None and found[0].token != self.holder.token and found[0].shared_with(self.holder.shared):
                self.released = self.passed_on = True
                return f"the lease on {self.run_dir} was passed to another process of job {self.holder.shared!r}"
            if found is None or found[0].token != self.holder.token:
                return (f"the lease on {self.run_dir} was taken over by "
                        f"{found[0].describe(found[1]) if found else 'another job'}; this job had not renewed it "
                        f"for over {self.stale_after:.0f} s (frozen, or cut off from the storage?) and stops "
                        f"before writing anything more there")
            now = time.time()
            os.utime(self.path, (now, now))
            self._renewed = time.monotonic()
            return None

    def check(self) -> str | None:
        """The watchdog's periodic check: renew when due; the message when the lease was taken over. Never
        raises (an exception would end the watchdog thread): a failed renewal is retried at the next beat."""
        if self.released or time.monotonic() - self._renewed < self.stale_after / _RENEWALS_PER_BOUND:
            return None
        try:
            lost = self.renew()
        except Exception:  # the storage hiccuped; the bound leaves room for several more tries
            return None
        return None if self.passed_on else lost  # passed on within its shared job: no failure

    def watch(self, watchdog: Watchdog | None) -> None:
        """Have ``watchdog`` renew this lease (once per watchdog)."""
        if watchdog is not None and id(watchdog) not in self._watched:
            self._watched.add(id(watchdog))
            watchdog.add_check(self.check)

    def release(self) -> None:
        """Delete the lease file if it is still this process's; stop renewing."""
        with self._lock:
            if self.released or self.holder.pid != os.getpid():  # a forked child never owned it
                return
            self.released = True
            found = read_lease(self.path)
            if found is not None and found[0].token == self.holder.token:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.path)


def _clear(run_dir: str, path: str, found: tuple[Holder, float], stale_after: float, shared: str) -> str | None:
    """Refuse a live lease (``ValueError`` naming its holder), else set the stale one (or one held in turn by the
    ``shared`` job) aside; why it could be, or ``None`` when another job moved it first."""
    holder, heartbeat = found
    if holder.is_this_process():
        reason: str | None = "it is this process's"
    elif holder.shared_with(shared):
        reason = f"job {shared!r} holds it in turn"
    else:
        reason = holder.stale_reason(heartbeat, stale_after)
    if reason is None:
        raise ValueError(_refusal(run_dir, holder, heartbeat, stale_after))
    return reason if _set_aside(path, holder) else None


def _new_lease(run_dir: str, path: str, stale_after: float, shared: str) -> RunDirLease | None:
    """A lease in a new file; ``None`` when another job created one first. Where the file cannot be created
    at all (a read-only parent directory), an unprotected lease and a warning: saving still works."""
    mine = Holder.mine(shared)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        return RunDirLease(run_dir, mine, stale_after) if _create(path, mine) else None
    except OSError as e:
        if e.errno not in _READ_ONLY:
            raise
        warnings.warn(f"cannot create the lease file {path} ({e.strerror}): nothing stops a second job from "
                      f"writing {run_dir} at the same time; make its parent directory writable",
                      RuntimeWarning, stacklevel=4)
        return RunDirLease(run_dir, mine, stale_after, protected=False)


def _acquire(run_dir: str, stale_after: float, shared: str) -> RunDirLease:
    path = lease_path(run_dir)
    for _ in range(5):  # each retry means another job changed the lease meanwhile
        found = read_lease(path)
        reason = None if found is None else _clear(run_dir, path, found, stale_after, shared)
        if found is not None and reason is None:
            continue
        lease = _new_lease(run_dir, path, stale_after, shared)
        if lease is None:
            continue
        if found is not None and not found[0].is_this_process() and not found[0].shared_with(shared):
            warnings.warn(f"taking over the lease on {run_dir} from {found[0].describe(found[1])}: {reason}",
                          RuntimeWarning, stacklevel=3)
        return lease
    raise ValueError(f"could not take the lease on {run_dir}: other jobs keep taking it; start one job at a time")


def hold_lease(run_dir: str | os.PathLike, *, watchdog: Watchdog | None = None,
               stale_after: float | None = None, shared: str = "") -> RunDirLease:
    """Take the lease on ``run_dir``, or keep (renew) it when this process holds it already; ``watchdog``
    (this process's, if any) renews it from then on. Called by one process of the job (global rank 0).
    ``stale_after`` defaults to the watchdog's ``FaultPolicy.lease_stale_after`` (60 s without one).
    ``shared``: the label of a job whose processes hold the lease in turn (see the module docstring); this
    process takes it back when another one of them took it meanwhile.

    ``ValueError`` naming the holder when another job holds a live lease, or naming the taker when this
    process's lease was taken over. A stale lease is taken over with a ``RuntimeWarning``.
    """
    if stale_after is None:
        stale_after = DEFAULT_STALE_AFTER if watchdog is None else watchdog.policy.lease_stale_after
    key = os.path.realpath(os.fspath(run_dir))
    lease = _HELD.get(key)
    if lease is not None:
        lost = lease.renew()
        if lost is not None:
            del _HELD[key]
            if not lease.passed_on:
                raise ValueError(lost)
            lease = None
    if lease is None:
        lease = _HELD[key] = _acquire(key, stale_after, shared)
    lease.watch(watchdog)
    return lease


def confirm_lease(run_dir: str | os.PathLike) -> None:
    """``ValueError`` unless this process still holds the lease on ``run_dir`` (renewing it): the last check
    before a save commits."""
    key = os.path.realpath(os.fspath(run_dir))
    lease = _HELD.get(key)
    lost = f"this process holds no lease on {key}" if lease is None else lease.renew()
    if lost is not None:
        _HELD.pop(key, None)
        raise ValueError(lost)


def lease_problem(run_dir: str | os.PathLike, stale_after: float = DEFAULT_STALE_AFTER, shared: str = "") -> str | None:
    """Why a job may not start writing ``run_dir`` (another job's live lease), without taking anything;
    ``None`` when it may (no lease, a stale one, this process's own, or one its ``shared`` job holds)."""
    key = os.path.realpath(os.fspath(run_dir))
    found = read_lease(lease_path(key))
    if (found is None or found[0].is_this_process() or found[0].shared_with(shared)
            or found[0].stale_reason(found[1], stale_after)):
        return None
    return _refusal(key, found[0], found[1], stale_after)


def release_lease(run_dir: str | os.PathLike) -> None:
    """Give back this process's lease on ``run_dir`` (nothing when it holds none)."""
    lease = _HELD.pop(os.path.realpath(os.fspath(run_dir)), None)
    if lease is not None:
        lease.release()


@atexit.register
def _release_all() -> None:
    # A normal exit hands the directories back, so the next job starts without a takeover warning; a killed
    # process leaves its lease behind, and the next job takes it over once the pid is gone.
    for key in list(_HELD):
        release_lease(key)
