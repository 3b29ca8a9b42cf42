"""A rank of a 2x2 hsdp job that uses collectives hsdp does not issue, legitimately, then misuses one.

Usage (one process per rank, env:// rendezvous): RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set;
``python foreign_worker.py CASE TIMEOUT``. First, in the ``full_tensor_barrier`` case only, what must not be
reported: every rank gathers every parameter and all-reduces, in a loop for 1.5 times the bound; then rank
0 works alone (a sleep, as a checkpoint write) for twice the bound while the others wait in
``dist.barrier()``. Then rank 0 alone, by CASE:
- full_tensor_barrier: gathers every parameter (``full_tensor()``, as a rank-0-only ``save_pretrained``
  does) while the others wait in ``dist.barrier()`` (accelerate's ``wait_for_everyone``);
- all_reduce_barrier: ``dist.all_reduce`` while the others wait in ``dist.barrier()``;
- full_tensor_exit: gathers while the others finish normally.
"""

from __future__ import annotations

import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

import hsdp


def main() -> None:
    case, timeout = sys.argv[1], float(sys.argv[2])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(minutes=5))  # hsdp's watchdog must act long before
    rank = dist.get_rank()
    mesh = hsdp.init_mesh(2, fault_policy=hsdp.FaultPolicy(timeout=timeout, interval=0.5))
    torch.manual_seed(0)
    # Wrapping broadcasts through hsdp's ledger. No training step: with this tiny bound, a rank that the busy
    # test machine starves for a few seconds in its first forward would be reported by hsdp's own (stricter)
    # detector, which is not what these cases are about.
    model = hsdp.ShardedModel(nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)), mesh=mesh)
    if case == "full_tensor_barrier":
        legitimate(rank, model, timeout)
    if rank == 0:
        print(f"rank 0: misbehaving ({case}) at {time.time():.3f}", flush=True)
        if case == "all_reduce_barrier":
            dist.all_reduce(torch.ones(4))
        else:
            save_alone(model)
    elif case != "full_tensor_exit":
        dist.barrier()
    print(f"rank {rank}: finished without noticing the hang", flush=True)


def save_alone(model: nn.Module) -> dict[str, torch.Tensor]:
    """What ``save_pretrained`` does with DTensor parameters: gather each one."""
    return {name: p.full_tensor() for name, p in model.named_parameters()}


def legitimate(rank: int, model: nn.Module, timeout: float) -> None:
    start, more = time.monotonic(), torch.ones(1)
    while more.item():  # long, but every collective completes
        save_alone(model)
        more.fill_(float(time.monotonic() - start < 1.5 * timeout))
        dist.all_reduce(more, op=dist.ReduceOp.MIN)  # stop together (each rank's clock alone would not agree)
    if rank == 0:
        time.sleep(2 * timeout)  # as rank 0 writing a checkpoint while the others wait
    dist.barrier()
    print(f"rank {rank}: legitimate waits done", flush=True)


if __name__ == "__main__":
    main()
