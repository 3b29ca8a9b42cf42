"""One benchmark run under torchrun: train a GPT with one system and print a JSON line of measurements.

Every system sees the same initial weights (seeded), the same batches and the same optimizer. Step time is
the wall time of forward + backward + optimizer step, measured on every rank between barriers and
reported as the slowest rank per step; the median over the measured steps (after warm-up) is the figure.
Peak tensor memory comes from one more step, run under a memory tracker (see ``peak_memory``); model state
per rank (``hsdp.state_bytes``: parameters, gradients, optimizer state) is read in that step, between
``optimizer.step()`` and ``zero_grad``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from hsdp.engine.collectives import Comm
from hsdp.engine.memory import StateBytes, state_bytes
from hsdp.engine.mesh import mesh_from_device_mesh
from hsdp.models import GPT, preset
from hsdp.tools.bench.peak_memory import measure_step_peak
from hsdp.tools.bench.systems import SYSTEMS, Wrapped
from hsdp.tools.step_timing import StepTimer, peak_rss_bytes

MIB = 2**20
# Model state per rank, split as hsdp.state_bytes reports it: for hsdp the flat shard buffers, gradient and
# optimizer-state shards; for FSDP2 the local chunks of its DTensors; for DDP the full tensors.
STATE_KINDS = ("params", "grads", "optimizer")


def _state_split(s: StateBytes) -> tuple[int, int, int]:
    """Model-state bytes of this rank in ``STATE_KINDS`` order."""
    return s.params, s.grads, s.optimizer


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--system", choices=sorted(SYSTEMS), required=True)
    p.add_argument("--preset", default="bench")
    p.add_argument("--batch", type=int, default=2, help="sequences per rank per micro-batch")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro-batches", type=int, default=1)
    p.add_argument("--steps", type=int, default=7)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--sharding-degree", type=int, default=None)
    p.add_argument("--out", default=None, help="write the JSON here (rank 0) as well as printing it")
    return p.parse_args()


def _step_parts(w: Wrapped, batches: list[tuple[torch.Tensor, torch.Tensor]],
                on_stepped: Callable[[], None] | None = None) -> list[Callable[[], float | None]]:
    """One optimizer step as callables: each micro-batch's forward and backward (returning its loss), then
    the optimizer step. ``on_stepped`` runs between ``optimizer.step()`` and ``zero_grad``: the one moment
    parameters, gradients and optimizer state all exist."""

    def micro_batch(i: int, x: torch.Tensor, y: torch.Tensor) -> float:
        w.set_sync(i == len(batches) - 1)
        _, loss = w.model(x, y)
        (loss / len(batches)).backward()
        return loss.item()

    def optimizer_step() -> None:
        w.optimizer.step()
        if on_stepped is not None:
            on_stepped()
        w.optimizer.zero_grad(set_to_none=True)

    return [functools.partial(micro_batch, i, x, y) for i, (x, y) in enumerate(batches)] + [optimizer_step]


def _step(w: Wrapped, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Train one step; the last micro-batch's loss."""
    return [part() for part in _step_parts(w, batches)][-2]


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    world, rank = dist.get_world_size(), dist.get_rank()
    s = args.sharding_degree or int(os.environ.get("LOCAL_WORLD_SIZE", world))
    dm = init_device_mesh("cpu", (world // s, s), mesh_dim_names=("replicate", "shard"))
    cfg = preset(args.preset)
    torch.manual_seed(0)
    model = GPT(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    rss_before = peak_rss_bytes() / MIB
    w = SYSTEMS[args.system](model, dm, 3e-4)
    g = torch.Generator().manual_seed(1000 + rank)

    def next_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(t[:, :-1], t[:, 1:]) for t in
                (torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=g)
                 for _ in range(args.micro_batches))]

    # Timing collectives on a Comm of their own: the same for every system, hsdp's statistics untouched.
    timer = StepTimer(Comm(mesh_from_device_mesh(dm)), args.warmup)
    losses = []
    for _ in range(args.warmup + args.steps):
        batches = next_batches()
        with timer.step():
            losses.append(_step(w, batches))
    per_node = timer.link_bytes_per_node()
    rss_peak = peak_rss_bytes() / MIB  # of the timed steps: the tracked step below allocates bookkeeping of its own
    # Model state is read in the untimed memory step (it walks every parameter), the same way for every system.
    state: list[StateBytes] = []
    results, tensor_peak = measure_step_peak(
        _step_parts(w, next_batches(), lambda: state.append(state_bytes(w.model, w.optimizer))),
        w.model, w.optimizer, torch.device("cpu"))
    peaks = timer.comm.all_gather_floats([rss_peak, tensor_peak / MIB, *map(float, _state_split(state[0]))])
    measured = timer.measured
    result = {
        "system": args.system, "preset": args.preset, "params": n_params, "world": world, "sharding_degree": s,
        "batch": args.batch, "seq": args.seq, "micro_batches": args.micro_batches,
        "median_step_s": statistics.median(measured), "step_s": measured, "losses": losses,
        "peak_rss_mib_per_rank": [p[0] for p in peaks], "rss_before_wrap_mib": rss_before,
        "peak_tensor_mib_per_rank": [p[1] for p in peaks], "memory_step_loss": results[-2],
        "state_bytes_per_rank": [dict(zip(STATE_KINDS, map(int, p[2:]), strict=True)) for p in peaks],
        "optimizer_steps": args.warmup + args.steps + 1,
        # Link counters of the measured steps, which include each step's barrier and timing all-reduce
        # (a few bytes) and the TCP/IP headers.
        "inter_node_bytes_per_step": [[b / args.steps for b in node] for node in per_node],
    }
    if rank == 0:
        print("BENCH_RESULT " + json.dumps(result), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
