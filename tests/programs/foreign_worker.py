"""A rank of a 2x2 hsdp job that misuses a collective hsdp does not issue (or uses one legitimately).

Usage (one process per rank, env:// rendezvous): RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set;
``python foreign_worker.py CASE TIMEOUT`` with CASE one of
- full_tensor_barrier: rank 0 alone gathers every parameter (``full_tensor()``, as a rank-0-only
  ``save_pretrained`` does), the others wait in ``dist.barrier()`` (accelerate's ``wait_for_everyone``);
- all_reduce_barrier: rank 0 alone in ``dist.all_reduce``, the others in ``dist.barrier()``;
- full_tensor_exit: rank 0 alone gathers, the others finish normally;
- legitimate: every rank gathers and all-reduces in a loop for twice the bound, then rank 0 works alone
  (a sleep, as a checkpoint write) for 1.5 times the bound while the others wait in ``dist.barrier()``:
  nothing may be reported as a hang.
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
    model = hsdp.ShardedModel(nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)), mesh=mesh)
    model(torch.randn(4, 16)).sum().backward()  # a step of hsdp's own collectives first
    if case == "legitimate":
        legitimate(rank, model, timeout)
        print(f"rank {rank}: finished cleanly", flush=True)
        return
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
    start = time.monotonic()
    while time.monotonic() - start < 2 * timeout:  # long, but every collective completes
        save_alone(model)
        dist.all_reduce(torch.ones(1))
    dist.barrier()
    print(f"rank {rank}: working alone at {time.time():.3f}", flush=True)
    if rank == 0:
        time.sleep(1.5 * timeout)  # as rank 0 writing a checkpoint while the others wait
    dist.barrier()


if __name__ == "__main__":
    main()
