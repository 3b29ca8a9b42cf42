"""One process playing a whole elastic replica against a real coordinator: its leader's client, beating for
every rank of the replica (the coordinator drops a replica when any of its ranks goes silent)."""

from __future__ import annotations

import time

from hsdp.engine.replicate.elastic.client import CoordinatorClient
from hsdp.engine.replicate.elastic.protocol import key


class ReplicaClient(CoordinatorClient):
    """The leader (rank 0) of a replica of ``degree`` ranks whose other ranks beat alongside it: they start with
    :meth:`register` and stop with :meth:`close` (``finished``: they ended normally, as at a clean exit)."""

    registered: list[ReplicaClient] = []  # every one, for close_all()

    @classmethod
    def close_all(cls) -> None:
        """Stop every heartbeat before the coordinator's store goes (a beat thread inside a store call when the
        interpreter ends aborts the process)."""
        while cls.registered:
            cls.registered.pop().close()

    def register(self, degree: int) -> int:
        ReplicaClient.registered.append(self)
        number = super().register(degree)
        self.others = [CoordinatorClient(self.store, self.address, self.job, self.replica_id, rank, self.policy)
                       for rank in range(1, degree)]
        for other in self.others:
            other.beat(number)
        # As a real replica, whose ranks start beating before its model is built: every rank's first beat is in
        # before the caller says ready (the coordinator admits only a replica all of whose ranks beat).
        beats = [key(self.job, "hb", self.replica_id, number, rank) for rank in range(degree)]
        deadline = time.monotonic() + 10 * self.policy.connect_timeout
        while not all(self.store.check([k]) for k in beats) and time.monotonic() < deadline:
            time.sleep(0.01)
        return number

    def close(self, finished: bool = False) -> None:
        for other in getattr(self, "others", []):
            other.close(finished)
        super().close(finished)
