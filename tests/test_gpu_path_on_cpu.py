"""The GPU path's runtime, checked on CPU (one spawn for all):

* no host reads of tensors in forward and backward but one (the step's "has gradient" flags, read once after
  every reduction), and that one only where some parameter had no gradient on this rank: on a GPU each read
  would stall the CPU's run-ahead of the device. Counted by patching the ways a tensor's value reaches
  Python; parameters unused on every rank still end with ``grad = None``;
* prefetch depth: how many units are gathered ahead, and that it changes no result;
* (the stream discipline, with a model of CUDA's streams and allocator: ``test_stream_safety.py``);
* the CPU's hop stream (``hop_worker.py``): a unit's hop is issued while the backward of the units before it
  still runs, the inter-node group's collectives keep program order across the two issuing threads, and the
  hang ledger books a chained hop as one entry numbered in program order."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

import pytest
import torch
from harness import run_distributed
from models import ParityNet, batch, loss_fn

import hsdp

_READS = ("item", "tolist", "cpu", "__bool__", "numpy")


@contextlib.contextmanager
def _count_host_reads(counter: list[str]) -> Iterator[None]:
    originals = {name: getattr(torch.Tensor, name) for name in _READS}

    def counting(name: str) -> Callable[..., object]:
        def read(self: torch.Tensor, *args: object, **kwargs: object) -> object:
            counter.append(name)
            return originals[name](self, *args, **kwargs)
        return read

    for name in _READS:
        setattr(torch.Tensor, name, counting(name))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(torch.Tensor, name, fn)


def _steps(rank: int, world: int) -> dict:
    out = {}
    for sliced, all_used in ((False, False), (True, False), (False, True)):
        torch.manual_seed(0)
        net = ParityNet()
        if all_used:
            net.unused = torch.nn.Identity()  # every trainable parameter then has a gradient on every rank
        model = hsdp.ShardedModel(net, mesh=hsdp.init_mesh(1 if sliced else 2),
                                  shard_optimizer_across_replicas=sliced)
        opt = hsdp.ShardedOptimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        counts = []
        for step in range(3):
            x, y = batch(step, rank)
            reads: list[str] = []
            with _count_host_reads(reads):
                loss = loss_fn(model(x), y)
                loss.backward()
            counts.append(reads)
            opt.step()
            opt.zero_grad(set_to_none=step == 0)  # zeroed in place later: unused ones must stay None
        unused = [p.grad for n, p in model.named_parameters() if n.startswith("unused.")]
        out["all_used" if all_used else "sliced" if sliced else "plain"] = {
            "reads": counts, "unused_none": all(g is None for g in unused)}
    return out


def _gathered_ahead(model: hsdp.ShardedModel) -> list[int]:
    """Per unit pre_forward of the next forward: how many units other than the root are gathered or in flight."""
    from hsdp.engine.runtime.unit import ShardedState

    state = model._hsdp_state
    counts: list[int] = []

    def count(*_: object) -> None:
        counts.append(sum(u.state is not ShardedState.SHARDED for u in state.units[1:]))

    hooks = [u.module.register_forward_pre_hook(count) for u in state.units[1:]]
    x, _ = batch(0, 0)
    model(x)
    for h in hooks:
        h.remove()
    return counts


def _prefetch_depths(rank: int) -> dict:
    """The same two steps at prefetch depth 0, 1 and 3: the units gathered ahead, and the parameters."""
    out = {}
    for depth in (0, 1, 3):
        torch.manual_seed(0)
        model = hsdp.ShardedModel(ParityNet(), mesh=hsdp.init_mesh(2))
        model.set_prefetch(depth)
        opt = hsdp.ShardedOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1))
        for step in range(2):  # the first step records the order the second prefetches in
            x, y = batch(step, rank)
            loss_fn(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        params = {n: p.detach().full_tensor() for n, p in model.named_parameters()}
        with torch.no_grad():
            ahead = _gathered_ahead(model)
        out[depth] = {"ahead": ahead, "units": len(model._hsdp_state.units) - 1, "params": params}
    return out


class _WaitForHop(torch.autograd.Function):
    """Identity; its backward polls ``issued()`` for up to 5 s and records whether it turned true."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor, issued: Callable[[], bool],
                seen: list[bool]) -> torch.Tensor:
        ctx.issued, ctx.seen = issued, seen  # type: ignore[attr-defined]
        return x.view_as(x)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        deadline = time.monotonic() + 5
        while not ctx.issued() and time.monotonic() < deadline:  # type: ignore[attr-defined]
            time.sleep(0.01)
        ctx.seen.append(ctx.issued())  # type: ignore[attr-defined]
        return grad, None, None


def _hop_chaining(rank: int) -> dict:
    """On 2 replicas of one rank: (1) blocks.2's hop is issued while blocks.1's backward runs (a probe between
    them waits for it; the main thread alone would issue it only at blocks.1's post_backward, after the probe);
    (2) a chained hop that issues late on rank 0 and a main-thread all-reduce issued right after it pair up
    correctly; (3) the ledger books the chained hop once, at its place in program order."""
    torch.manual_seed(0)
    model = hsdp.ShardedModel(ParityNet(), mesh=hsdp.init_mesh(1))
    comm = model.comm
    seen: list[bool] = []

    def hops_issued() -> bool:
        return comm.stats.as_dict().get("replicate", {}).get("all_reduce", {}).get("calls", 0) >= 1

    model.blocks[1].register_forward_hook(lambda _m, _i, out: _WaitForHop.apply(out, hops_issued, seen))
    x, y = batch(0, rank)
    model.reset_comm_stats()
    loss_fn(model(x), y).backward()

    ledger = model.mesh.watchdog.ledger if model.mesh.watchdog is not None else None
    seq0 = ledger.seq if ledger else 0
    first, second = torch.tensor([rank + 1.0]), torch.tensor([10.0 * (rank + 1)])
    handles: list[hsdp.engine.collectives.Handle] = []

    def late_hop() -> None:
        time.sleep(0.3 if rank == 0 else 0.0)
        handles.append(comm.all_reduce(first, "replicate", async_op=True, label="late"))

    chained = comm.chain(late_hop, "late")
    comm.all_reduce(second, "replicate", label="main")  # must wait for the chained issue on rank 0
    chained.wait()
    handles[0].wait()
    empty = comm.chain(lambda: None, "nothing")  # issues nothing: its entry retires by itself
    empty.wait()
    booked = None
    if ledger is not None:
        booked = {"regions": [e.region for e in ledger.recent if e.seq > seq0], "pending": len(ledger.pending)}
    return {"seen": seen, "first": first.item(), "second": second.item(), "ledger": booked}


def _all(rank: int, world: int) -> dict:
    return {"reads": _steps(rank, world), "prefetch": _prefetch_depths(rank),
            "chaining": _hop_chaining(rank)}


def test_cpu_hop_is_issued_during_the_backward_of_the_units_before_it(results: list[dict]) -> None:
    for r in results:
        assert r["chaining"]["seen"] == [True], "blocks.2's hop waited for blocks.1's post_backward"


def test_inter_node_collectives_keep_program_order_across_the_hop_worker(results: list[dict]) -> None:
    for r in results:
        got = r["chaining"]
        assert (got["first"], got["second"]) == (1.5, 15.0), got  # each all-reduce met its own on the peer
        assert got["ledger"] is not None, "init_mesh starts the fault watchdog in tests too"
        assert got["ledger"] == {"regions": ["hsdp::replica_hop[replicate] late", "hsdp::all_reduce[replicate] main",
                                             "hsdp::replica_hop[replicate] nothing"], "pending": 0}, got["ledger"]


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_distributed(_all, 2)


def test_prefetch_depth_gathers_that_many_units_ahead_and_changes_no_result(results: list[dict]) -> None:
    got = results[0]["prefetch"]
    assert got[1]["units"] == 3, "three block units: depths 0, 1 and 3 then differ"
    # At a unit's pre_forward (after hsdp's): the unit itself plus the units gathered ahead of it.
    assert [max(got[d]["ahead"]) for d in (0, 1, 3)] == [1, 2, 3], {d: got[d]["ahead"] for d in got}
    for depth in (0, 3):
        for name, value in got[1]["params"].items():
            torch.testing.assert_close(got[depth]["params"][name], value, rtol=0, atol=0)
    with pytest.raises(ValueError, match="set_prefetch"):
        hsdp.ShardedModel.set_prefetch(None, -1)  # type: ignore[arg-type]


def test_forward_and_backward_read_at_most_one_tensor_on_the_host(results: list[dict]) -> None:
    for r in (r["reads"] for r in results):
        for mode, got in r.items():
            # The one read: the flags of every unit at once, at the end of backward; none if all were used.
            expected = [] if mode == "all_used" else ["tolist"]
            assert all(reads == expected for reads in got["reads"]), (mode, got["reads"])
            assert got["unused_none"], mode
