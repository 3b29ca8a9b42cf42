"""A small all-reduce job for the launcher tests (run under torchrun, gloo on CPU).

Every rank all-reduces a fixed-size fp32 tensor ``--iters`` times in the world group and checks the sum;
rank 0 prints the payload and how long the all-reduces took (between two barriers), so tests can compare
link settings without process start-up noise. ``--fail-rank R`` makes rank R raise once the group is up,
while the others block in the all-reduce, as a real rank crash would leave them.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--numel", type=int, default=1 << 20, help="fp32 elements per all-reduce")
    parser.add_argument("--iters", type=int, default=4)
    parser.add_argument("--fail-rank", type=int, default=-1)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dist.barrier()
    if rank == args.fail_rank:
        print(f"failing_at={time.time():.3f}", flush=True)  # wall clock: the test times the launcher's exit
        raise RuntimeError(f"rank {rank} fails on purpose")
    tensor = torch.full((args.numel,), float(rank + 1))
    started = time.perf_counter()
    for _ in range(args.iters):
        dist.all_reduce(tensor)
        tensor.fill_(float(rank + 1))  # same values each time: the sum below is checkable
    dist.barrier()
    elapsed = time.perf_counter() - started
    dist.all_reduce(check := torch.full((4,), float(rank + 1)))
    assert check[0].item() == world * (world + 1) / 2, check
    if rank == 0:
        print(f"world={world} nodes={os.environ.get('GROUP_WORLD_SIZE')} payload_bytes={tensor.numel() * 4} "
              f"iters={args.iters} allreduce_seconds={elapsed:.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
