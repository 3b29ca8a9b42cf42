"""``Comm`` on CUDA with NCCL (skipped without; run by ``benchmarks/gpu_check.sh``): collective seconds are
measured with CUDA events, from issue to completion on the stream timeline (the host never blocks in an NCCL
wait, so host time would only measure the enqueue), resolved when the stats are read; fp16 averages run as
a pre-divided sum, post-divided once waited.

One process, one rank. ``Comm`` skips a 1-rank group's collective, so these tests make the 1-rank world
group count as ``n`` ranks (:func:`_posing_as`): the collective is then a real NCCL one over one rank.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

import hsdp
from hsdp.engine.collectives import Comm
from hsdp.engine.comm_stats import _MAX_PENDING_EVENTS

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available() or not dist.is_nccl_available(),
                       reason="needs a CUDA device and NCCL"),
]


def _posing_as(mesh: hsdp.HSDPMesh, n: int) -> Comm:
    """A ``Comm`` whose 1-rank world group counts as ``n`` ranks: it issues the collective instead of its
    1-rank shortcut (only this rank contributes), and an average divides by ``n``."""
    comm = Comm(mesh)
    comm._sizes["world"] = n
    return comm


def _event() -> torch.cuda.Event:
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def test_seconds_span_issue_to_completion_on_the_stream(nccl_mesh: hsdp.HSDPMesh) -> None:
    comm = _posing_as(nccl_mesh, 2)
    dev = nccl_mesh.device
    big = torch.ones(64 * 2**20, device=dev)  # 256 MiB
    a = torch.randn(4096, 4096, device=dev) / 64
    comm.all_reduce(big, "world", op=dist.ReduceOp.SUM)  # warm-up: NCCL's communicator, cuBLAS
    torch.matmul(a, a)
    torch.cuda.synchronize(dev)
    comm.stats.reset()
    host = time.perf_counter()
    before = _event()
    handle = comm.all_reduce(big, "world", op=dist.ReduceOp.SUM, async_op=True)
    compute_start = _event()
    for _ in range(8):  # compute the collective overlaps, queued on the current stream before the wait
        torch.matmul(a, a)
    compute_end = _event()
    handle.wait()
    after = _event()
    host = time.perf_counter() - host
    row = comm.stats.ops[("world", "all_reduce")]
    assert len(row._events) == 1  # booked, not yet resolved: no host sync in the wait
    seconds = row.seconds  # resolves (one synchronize)
    torch.cuda.synchronize(dev)
    compute = compute_start.elapsed_time(compute_end) / 1000
    total = before.elapsed_time(after) / 1000
    # Issue to completed wait contains the overlapped compute and lies within the events around it all.
    assert 0.99 * compute <= seconds <= 1.01 * total + 1e-4, (seconds, compute, total)
    # The premise: the host did not wait for the device, so host time could not have measured this.
    assert host < compute / 2 and row.waited < compute / 2, (host, row.waited, compute)
    assert not row._events and row.seconds == seconds  # resolved once
    assert comm.stats.as_dict()["world"]["all_reduce"]["seconds"] == round(seconds, 6)


def test_unread_event_pairs_stay_bounded(nccl_mesh: hsdp.HSDPMesh) -> None:
    comm = _posing_as(nccl_mesh, 2)
    t = torch.ones(1024, device=nccl_mesh.device)
    for _ in range(_MAX_PENDING_EVENTS + 44):
        comm.all_reduce(t, "world", op=dist.ReduceOp.SUM)
    torch.cuda.synchronize(nccl_mesh.device)
    comm.all_reduce(t, "world", op=dist.ReduceOp.SUM)  # over the bound: the completed pairs are folded in
    row = comm.stats.ops[("world", "all_reduce")]
    assert len(row._events) <= 1 and row.calls == _MAX_PENDING_EVENTS + 45
    assert row.seconds >= 0 and not row._events  # a few microseconds each: only their sum's sign is sure


def test_fp16_average_of_large_values_stays_finite_on_nccl(nccl_mesh: hsdp.HSDPMesh) -> None:
    comm = _posing_as(nccl_mesh, 4)  # four ranks of 30000 would sum past fp16's 65504
    t = torch.full((2**20,), 30000.0, dtype=torch.float16, device=nccl_mesh.device)
    handle = comm.all_reduce(t, "world", async_op=True)  # AVG: pre-divided by 2, summed, post-divided by 2
    handle.wait()
    # This rank's share of a 4-rank average, exact: 30000 / 2 summed alone, then / 2.
    assert torch.equal(t, torch.full_like(t, 7500.0))
