"""The coordinator's own check that a rank is dead: a TCP connect to its liveness port.

``hsdp/engine/replicate/elastic/liveness.py`` says why a refused connection proves the process gone while a
completed one says nothing about speed. All addresses are probed at once (non-blocking connects, one
``select``), so a job of many replicas costs one bounded wait, never one per rank; an address that answers
nothing within the timeout (a vanished host) is left to the heartbeat.
"""

from __future__ import annotations

import contextlib
import errno
import select
import socket
import time
from collections.abc import Sequence

CONNECTED, REFUSED, SILENT = "connected", "refused", "silent"


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def _start(address: str) -> tuple[socket.socket | None, str | None]:
    """A non-blocking connect under way, or the verdict at once (refused on the spot, or unusable: silent)."""
    try:
        host, port = _split(address)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
    except (OSError, ValueError):
        return None, SILENT
    sock.setblocking(False)
    code = sock.connect_ex((host, port))
    if code in (0, errno.EINPROGRESS, errno.EWOULDBLOCK):
        return sock, None
    sock.close()
    return None, REFUSED if code == errno.ECONNREFUSED else SILENT


def probe(addresses: Sequence[str], timeout: float = 0.25) -> list[str]:
    """Per address: ``CONNECTED``, ``REFUSED`` (nothing listens: the process is gone) or ``SILENT`` (no answer
    within ``timeout`` seconds, or an address that cannot be probed)."""
    verdicts: list[str | None] = []
    pending: dict[socket.socket, int] = {}
    for i, address in enumerate(addresses):
        sock, verdict = _start(address)
        verdicts.append(verdict)
        if sock is not None:
            pending[sock] = i
    deadline = time.monotonic() + timeout
    while pending and (left := deadline - time.monotonic()) > 0:
        _, ready, _ = select.select([], list(pending), [], left)
        for sock in ready:
            code = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            verdicts[pending.pop(sock)] = CONNECTED if code == 0 else REFUSED if code == errno.ECONNREFUSED else SILENT
            sock.close()
    for sock, i in pending.items():
        verdicts[i] = SILENT
        with contextlib.suppress(OSError):
            sock.close()
    return [v or SILENT for v in verdicts]
