"""A rank of a 2x2 hsdp job that kills one rank at a chosen point of a training step.

Usage (one process per rank, env:// rendezvous): RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set;
``python fault_worker.py POINT VICTIM TIMEOUT`` with POINT one of
- forward, backward, step, gather: the victim is killed (SIGKILL) there; hang: it is stopped (SIGSTOP);
- sleep: the victim sleeps in Python; exit: the victim returns early, without error;
- mismatch: the victim checks replicas while the others clip gradients (different collectives);
- full_state_dict, save_checkpoint: the victim alone calls that collective helper, the others train on.
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import time
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
    # FAULT_WORKER_DEGREES: "2" (a 2 x 2 grid) or one degree per replica ("2,1,1": replicas of different sizes).
    degrees = [int(d) for d in os.environ.get("FAULT_WORKER_DEGREES", "2").split(",")]
    degree = degrees[0] if len(degrees) == 1 else degrees
    mesh = hsdp.init_mesh(degree, fault_policy=hsdp.FaultPolicy(timeout=timeout, interval=0.5))
    model = hsdp.ShardedModel(GPT(preset("tiny")), mesh=mesh)
    opt = hsdp.ShardedOptimizer(model, torch.optim.AdamW(model.parameters()))

    def die(where: str) -> None:
        if rank == victim and point == where:
            print(f"rank {rank}: dying in {where} at {time.time():.3f}", flush=True)
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
            misbehave(point, rank == victim, model, opt)
        opt.step()
        opt.zero_grad()
        if step == 1 and point == "gather":
            die("gather")
            hsdp.full_state_dict(model)
    print("finished without noticing the failure", flush=True)


def misbehave(point: str, victim: bool, model: hsdp.ShardedModel, opt: torch.optim.Optimizer) -> None:
    """The hangs that are not deaths: a rank busy elsewhere, gone, or in a different collective."""
    if victim:
        print(f"rank {dist.get_rank()}: misbehaving ({point}) at {time.time():.3f}", flush=True)
    if point == "mismatch":
        if victim:
            model.check_replicas()
        else:
            hsdp.clip_grad_norm_(model, 1.0)
    if not victim:
        return
    if point == "sleep":
        time.sleep(3600)
    elif point == "exit":
        sys.exit(0)
    elif point == "full_state_dict":
        hsdp.full_state_dict(model)
    elif point == "save_checkpoint":
        hsdp.save_checkpoint(tempfile.mkdtemp(prefix="hsdp-hang-"), model, opt)


if __name__ == "__main__":
    main()
