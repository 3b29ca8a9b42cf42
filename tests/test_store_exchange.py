"""The store exchange ``init_mesh`` uses before a mesh exists must not starve the watchdog's heartbeats.

A store client serves one request at a time. A rank of an elastic replica waits in ``exchange`` for its leader
to tell the admission step, which can take as long as the coordinator's start grace or, for a joiner under
DiLoCo, the time to the next sync boundary. A blocking ``Store.wait`` there held the connection the watchdog
beats on, so the rank's peers declared it dead once the wait passed the fault policy's timeout (found on a
busy CI machine: a replica that registered 9 s before the last one was ended by its own watchdog at 8 s). One
process: a real TCPStore, rank 0 of 2, rank 1's value set late by the test.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch.distributed as dist

from hsdp.engine import store_exchange


@pytest.fixture
def store(monkeypatch: pytest.MonkeyPatch) -> Iterator[dist.TCPStore]:
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False, wait_for_workers=False)
    monkeypatch.setattr(dist.distributed_c10d, "_get_default_store", lambda: client)
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    yield client  # the server lives as long as this generator's frame


def test_a_rank_waiting_in_an_exchange_still_beats(store: dist.TCPStore) -> None:
    got: list[list[str]] = []
    waiter = threading.Thread(target=lambda: got.append(store_exchange.exchange("zero", timedelta(seconds=20))))
    waiter.start()
    time.sleep(0.3)  # rank 0 is waiting for rank 1's value now
    beats = []
    for _ in range(5):  # what the watchdog thread does every interval, on the same store client
        t = time.monotonic()
        store.add("hsdp/hb/0", 1)
        beats.append(time.monotonic() - t)
        time.sleep(0.2)
    assert max(beats) < 0.5, f"a heartbeat waited {max(beats):.2f} s behind the exchange's wait"
    store.set("hsdp/exchange/1/1", "one")  # rank 1's first exchange
    waiter.join(timeout=5)
    assert got == [["zero", "one"]]


def test_an_exchange_names_the_ranks_that_gave_no_value(store: dist.TCPStore) -> None:
    with pytest.raises(TimeoutError, match=r"rank\(s\) \[1\] gave no value within 0.3 s"):
        store_exchange.exchange("zero", timedelta(seconds=0.3))
