"""How a wait on an elastic replicate collective may give up: sliced on gloo, never timed on NCCL.

With NCCL, ``Work.wait(timeout)`` blocks the host and, once ``timeout`` has passed since the collective was
*enqueued*, sets an error on the work and aborts the communicator (torch's ``WorkNCCL::wait``). A hop queued
behind backward work, or a heal broadcast of a large shard, easily takes longer than a 250 ms slice: a timed wait
would abort a healthy step. Gloo's timed wait only stops waiting (the collective runs on), which is how an
elastic wait gives up on the coordinator's notice. No process group is needed: ``Comm`` runs on a stand-in mesh,
and ``dist.all_reduce`` returns stand-ins of the backends' works. The same wait bounds a finished rank's exit
(dropping a retired group joins its collective): the rank is done for its watchdog before it.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from hsdp.engine.collectives import Comm
from hsdp.engine.replicate.elastic.layer import ElasticLayer


class _NCCLLikeWork:
    """``WorkNCCL``: ``wait()`` makes the stream wait and returns; ``wait(timeout)`` blocks the host and, past the
    timeout since enqueueing (here already: the collective sits behind backward work), fails the work and aborts
    the communicator."""

    def __init__(self) -> None:
        self.timed_waits, self.aborted, self.waited = 0, False, False

    def wait(self, timeout: timedelta | None = None) -> bool:
        if timeout is not None:
            self.timed_waits += 1
            self.aborted = True  # the communicator is gone: this step and the epoch's next collectives fail
            raise RuntimeError("Work timed out in blocking wait; aborting the NCCL communicator")
        self.waited = True
        return True

    def is_completed(self) -> bool:
        return self.aborted  # an exception set completes the work, in error


class _GlooLikeWork:
    """A gloo work whose peer is stopped: a timed wait raises and the collective stays in flight."""

    def __init__(self) -> None:
        self.timed_waits = 0

    def wait(self, timeout: timedelta | None = None) -> bool:
        assert timeout is not None, "an untimed gloo wait on a stopped peer would block until the group's timeout"
        self.timed_waits += 1
        raise RuntimeError("Timed out waiting for the collective")

    def is_completed(self) -> bool:
        return False


class _ElasticLayer:
    """The replicate layer's face that ``Comm`` reads; ``interrupted`` says a member left on its third call."""

    index, regular, scale = 0, True, 1.0

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.replicate_group, self.count, self.asked = group, 2, 0

    def await_step(self) -> None:
        """The step's quorum is already known here."""

    def interrupt(self) -> Callable[[], str]:
        return self.interrupted

    def interrupted(self) -> str:
        self.asked += 1
        return "replica 1 left the quorum" if self.asked >= 3 else ""


def _group(backend: object) -> types.SimpleNamespace:
    """A process group whose CPU collectives run on ``backend``."""
    return types.SimpleNamespace(_get_backend=lambda device: backend)


def _comm(monkeypatch: pytest.MonkeyPatch, group: object, work: object) -> tuple[Comm, _ElasticLayer]:
    monkeypatch.setattr(dist, "get_backend", lambda *_: "nccl")
    monkeypatch.setattr(dist, "all_reduce", lambda *args, **kwargs: work)
    layer = _ElasticLayer(group)  # type: ignore[arg-type]
    mesh = types.SimpleNamespace(replicas=layer, shard_group=None, sharding_degree=1, world_size=1, tp_group=None,
                                 tp_degree=1, watchdog=None, device=torch.device("cpu"),
                                 hop_worker=types.SimpleNamespace(drain=lambda: None))
    return Comm(mesh), layer  # type: ignore[arg-type]


def test_an_nccl_replicate_wait_is_never_timed_so_a_slow_hop_does_not_abort_the_communicator(monkeypatch) -> None:
    work = _NCCLLikeWork()
    comm, layer = _comm(monkeypatch, _group(object()), work)  # NCCL's backend: not gloo's
    grads = torch.ones(8)
    comm.all_reduce(grads, "replicate", async_op=True, label="root").wait()
    assert work.timed_waits == 0 and not work.aborted and work.waited
    assert layer.asked == 0  # the epoch's watch thread, not the waiting thread, acts on the coordinator's notice


def test_a_gloo_replicate_wait_still_gives_up_on_the_coordinators_notice(monkeypatch) -> None:
    work = _GlooLikeWork()
    gloo = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, timedelta(seconds=5))
    comm, layer = _comm(monkeypatch, _group(gloo), work)
    handle = comm.all_reduce(torch.ones(8), "replicate", async_op=True, label="root")
    with pytest.raises(RuntimeError, match="hsdp elastic: replica 1 left the quorum"):
        handle.wait()
    assert work.timed_waits == 3 and layer.asked == 3


class _Retired:
    """A retired replicate group: dropping it records the moment (a real one may wait up to hop_timeout there)."""

    def __init__(self, events: list[str]) -> None:
        self.events = events

    def __del__(self) -> None:
        self.events.append("retired group dropped")


@pytest.mark.parametrize("finished", [True, False])
def test_a_finished_rank_is_done_for_its_watchdog_before_the_replicate_teardown(finished: bool) -> None:
    """At exit, an elastic rank drops its retired groups, which may wait up to hop_timeout for a collective a
    stopped peer never joined: a rank whose training finished must already be done for its watchdog then (not
    judged hung, its peer not judged dead). A rank that failed is not done: its silence is the failure."""
    events: list[str] = []
    layer = object.__new__(ElasticLayer)  # only what close() reads
    layer.client = types.SimpleNamespace(close=lambda done: events.append(f"coordinator told (finished={done})"))
    layer._group, layer._pieces, layer._built = None, {}, True
    layer._retired = [(0.0, _Retired(events))]  # type: ignore[list-item]
    layer._on_finished = lambda: events.append("watchdog done")
    layer.close(finished)
    expected = [f"coordinator told (finished={finished})", "retired group dropped"]
    assert events == (["watchdog done", *expected] if finished else expected)
