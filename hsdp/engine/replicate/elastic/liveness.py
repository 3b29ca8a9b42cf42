"""A rank's liveness port: how the coordinator tells a dead rank from a slow one in milliseconds.

Each rank of an elastic replica listens on one TCP port of its own (opened once per process) and publishes it on
the coordinator (``probe/<id>/<incarnation>/<rank>``). Nobody talks on it: the coordinator only connects. While
the process lives, the kernel completes the connection, even when the process is stopped or starved (the
listening socket's backlog answers for it); once the process is gone, the kernel refuses it at once. So a refused
connection is proof of death, where a heartbeat's silence only becomes a suspicion after its timeout, and a
slow peer is never mistaken for a dead one. A host that vanished (power, network) answers nothing: that case
stays the heartbeat's.
"""

from __future__ import annotations

import contextlib
import socket
import threading


def local_address(host: str, port: int) -> str:
    """This host's address on the route to ``host:port`` (the one the coordinator can reach it at): a UDP socket
    "connected" there sends nothing but picks the interface."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0][0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((host, port))
        return s.getsockname()[0]


class LivenessPort:
    """The listening socket (and a thread that accepts and closes what arrives, so the backlog never fills);
    :attr:`address` is ``host:port`` as the coordinator reaches it. :meth:`close` makes it refuse, as death does."""

    def __init__(self, coordinator_host: str, coordinator_port: int) -> None:
        host = local_address(coordinator_host, coordinator_port)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.bind((host, 0))
        self._sock.listen(64)
        port = self._sock.getsockname()[1]
        self.address = f"[{host}]:{port}" if family == socket.AF_INET6 else f"{host}:{port}"
        threading.Thread(target=self._accept, name="hsdp-elastic-liveness", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            conn.close()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread
        self._sock.close()
