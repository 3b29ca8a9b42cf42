"""A rank of a 2x2 hsdp job that kills one rank at a chosen point of a training step.

Usage (one process per rank, env:// rendezvous): RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set;
``python fault_worker.py POINT VICTIM TIMEOUT`` with POINT in forward, backward, step, gather, hang.
"""

from __future__ import annotations

import os
import signal
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

import hsdp
from hsdp.models import GPT, preset


def main() -> None:
    point, victim, timeout = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(minutes=5))  # hsdp's watchdog must act long before
    rank = dist.get_rank()
    mesh = hsdp.init_mesh(2, fault_policy=hsdp.FaultPolicy(timeout=timeout, interval=0.5))
    model = hsdp.ShardedModel(GPT(preset("tiny")), mesh=mesh)
    opt = hsdp.ShardedOptimizer(model, torch.optim.AdamW(model.parameters()))

    def die(where: str) -> None:
        if rank == victim and point == where:
            print(f"rank {rank}: dying in {where}", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP if point == "hang" else signal.SIGKILL)

    model.blocks[1].register_forward_pre_hook(lambda *_: die("forward"))
    model.blocks[1].register_full_backward_pre_hook(lambda *_: die("backward"))
    x = torch.randint(0, 256, (2, 32))
    for step in range(1000):
        _, loss = model(x, x)
        loss.backward()
        if step == 1:
            die("step")
            die("hang")
        opt.step()
        opt.zero_grad()
        if step == 1:
            die("gather")
            hsdp.full_state_dict(model)
    print("finished without noticing the failure", flush=True)


if __name__ == "__main__":
    main()
