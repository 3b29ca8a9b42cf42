"""``hsdp coordinator``: host the store an elastic job meets on, decide its steps, say what changes.

Starts a ``TCPStore`` server (it listens on every interface; ``host`` is only how the printed address names
this machine), runs :class:`~hsdp.tools.coordinator.server.Coordinator` on it and prints, line by line:

* the address to export, as ``HSDP_COORDINATOR=host:port`` (alone on its line: ``hsdp launch --elastic``
  waits for it before starting the nodes, so no node races the coordinator for its port);
* each membership change as it happens (:class:`~hsdp.tools.coordinator.events.MembershipLog`); a step that
  changes nothing prints nothing;
* a summary when it is stopped (Ctrl-C, SIGTERM, SIGHUP), after which it exits 0.

When the job stops by itself (fewer live replicas than the minimum), it serves :data:`STOP_LINGER_S` more
seconds, so that every replica reads why, prints the summary and exits: 0 when no replica was left (every
replica failed at once), :data:`BELOW_MINIMUM` when some were (a launcher then stops the rest instead of
restarting replicas that cannot be admitted any more). When the job completed (its last members finished), it
serves ``config.linger`` more seconds (``hsdp launch --elastic``: until it is stopped), telling any replica that
arrives late that the job is over, then exits 0.
"""

from __future__ import annotations

import signal
import socket
import sys
import time
from collections.abc import Callable
from typing import IO, TYPE_CHECKING, Any

from hsdp.engine.faults.signals import handle_signals
from hsdp.tools.coordinator.config import ADDRESS_LINE, ANY_HOST, CoordinatorConfig
from hsdp.tools.coordinator.events import MembershipLog

if TYPE_CHECKING:
    from hsdp.tools.coordinator.server import Coordinator

POLL_S = 0.005  # a decision waits at most this long after its last input arrived
STOP_LINGER_S = 5.0  # serving after the job stopped: the replicas blocked on a quorum read the reason
BELOW_MINIMUM = 3  # exit status: stopped with live replicas, too few of them
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def advertised_host(host: str) -> str:
    """How others reach a store listening on ``host``: the host itself, or this machine's name for a
    wildcard address."""
    return socket.gethostname() if host in ANY_HOST else host


def serve(config: CoordinatorConfig, *, out: IO[str] | None = None, err: IO[str] | None = None,
          stop: Callable[[], bool] | None = None, period: float = POLL_S, linger: float = STOP_LINGER_S) -> int:
    """Run the coordinator of ``config`` until ``stop()`` is true, a stop signal arrives or ``linger`` seconds
    after the job stopped itself (``config.linger`` after it completed); the exit status (see the module
    docstring; 1 when the port cannot be opened)."""
    import torch.distributed as dist

    from hsdp.tools.coordinator.server import Coordinator

    out, err = out or sys.stdout, err or sys.stderr
    try:
        store = dist.TCPStore(config.host or "0.0.0.0", config.port, is_master=True, wait_for_workers=False)
    except (RuntimeError, OSError) as e:  # the port is taken, the host cannot be resolved
        print(f"hsdp coordinator: error: cannot serve on {config.host}:{config.port} ({e}): pick another "
              f"--port (0 picks a free one)", file=err, flush=True)
        return 1
    started = time.monotonic()
    coordinator = Coordinator(store, config.job, config.replicas, config.min_replicas, config.policy(),
                              start_grace=config.start_grace, ranks=config.nproc_per_replica)
    log = MembershipLog(config.heartbeat_timeout)
    _say(out, f"hsdp coordinator: elastic job {config.job!r}, {config.replicas} replica(s) (ids 0.."
              f"{config.replicas - 1}), going on with at least {coordinator.min_replicas}; heartbeat timeout "
              f"{config.heartbeat_timeout:g} s; listening on port {store.port}. Every replica's ranks need:")
    _say(out, f"{ADDRESS_LINE}{advertised_host(config.host)}:{store.port}")
    # A plain flag, not a threading.Event: the handler runs in the main thread between two bytecodes, and
    # Event.set() there deadlocks when the signal lands while Event.wait() holds the event's (non-reentrant) lock.
    stopping = [False]

    def on_signal(signum: int, frame: Any) -> None:
        stopping[0] = True

    stopped_at: float | None = None
    with handle_signals(_STOP_SIGNALS, on_signal):
        while not stopping[0] and not (stop is not None and stop()):
            _observe(coordinator, log, out)
            state = coordinator.state
            if state.stopped or state.completed:
                stopped_at = stopped_at or time.monotonic()
                if time.monotonic() - stopped_at >= (config.linger if state.completed else linger):
                    break
            time.sleep(period)
        if stopping[0]:  # one last look: hsdp launch stops it once every node ended, maybe right after the last finish
            _observe(coordinator, log, out)
    _say(out, log.summary(coordinator.state, config.job, time.monotonic() - started))
    if stopping[0] or not coordinator.state.stopped:
        return 0  # stopped by a signal, or the job completed
    return BELOW_MINIMUM if coordinator.state.members else 0


def _observe(coordinator: Coordinator, log: MembershipLog, out: IO[str]) -> None:
    """One pass of the coordinator's decisions, and the lines that say what changed."""
    coordinator.poll()
    for line in log.observe(coordinator.state):
        _say(out, line)


def _say(out: IO[str], text: str) -> None:
    print(text, file=out, flush=True)  # a pipe (hsdp launch) must see each line at once
