"""Two training steps of a tiny hsdp model on a 1 x 1 NCCL mesh, to run under torch's CUDA sanitizer.

Run with ``TORCH_CUDA_SANITIZER=1`` (read when torch is imported: ``torch/cuda/_sanitizer.py`` then checks every
kernel's reads and writes against the stream order it saw, prints "CSAN detected a possible data race" and
raises on the first unordered access). The model's ``Comm`` counts the 1-rank replicate group as 2 ranks, so
every unit's inter-node hop is a real NCCL all-reduce issued from the hop stream (see
``tests/test_cuda_races.py``). ``--config mixed-bf16-wire-accumulation`` adds bf16 all-gathers and compute,
a bf16 wire, a first step of two micro-batches (the partial sums) and ``hsdp.clip_grad_norm_``.

Prints ``SANITIZED_STEPS_OK <json>`` at the end; exits non-zero on any error.
Run: ``TORCH_CUDA_SANITIZER=1 LOCAL_RANK=0 python tests/programs/sanitized_step.py --store /tmp/s`` (tree on
``PYTHONPATH``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os

import torch
import torch.distributed as dist
from torch import nn

import hsdp

CONFIGS = ("fp32", "mixed-bf16-wire-accumulation")


class Stack(nn.Module):
    def __init__(self, dim: int = 64, depth: int = 2) -> None:
        super().__init__()
        hidden = 2 * dim + 1
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))
                                      for _ in range(depth)])
        self.head = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--store", required=True, help="a file path for the 1-rank FileStore rendezvous")
    p.add_argument("--config", choices=CONFIGS, default="fp32")
    args = p.parse_args()
    if "TORCH_CUDA_SANITIZER" not in os.environ:
        raise SystemExit("the CUDA sanitizer is off: run with TORCH_CUDA_SANITIZER=1 in the environment")
    from torch.cuda import _sanitizer  # imported by torch itself when the variable is set

    assert _sanitizer.cuda_sanitizer.enabled, "TORCH_CUDA_SANITIZER is set but the sanitizer is not enabled"
    os.environ.setdefault("LOCAL_RANK", "0")
    dev = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", store=dist.FileStore(args.store, 1), rank=0, world_size=1, device_id=dev)
    try:
        print("SANITIZED_STEPS_OK " + json.dumps(train(args.config, dev)), flush=True)
    finally:
        dist.destroy_process_group()


def train(config: str, dev: torch.device) -> dict[str, object]:
    mixed = config != "fp32"
    mesh = hsdp.init_mesh(1, fault_policy=None)
    assert mesh.device == dev, (mesh.device, dev)
    torch.manual_seed(0)
    sharded = hsdp.ShardedModel(
        Stack(), mesh=mesh, replica_hop=hsdp.AllReduceHop(torch.bfloat16 if mixed else None),
        mixed_precision=hsdp.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed else None)
    sharded.comm._sizes["replicate"] = 2  # real NCCL hops from the hop stream
    opt = hsdp.ShardedOptimizer(sharded, torch.optim.AdamW(sharded.parameters(), lr=1e-2))
    g = torch.Generator(device=dev).manual_seed(1)
    micro_batches = [2, 1] if mixed else [1, 1]
    for micro in micro_batches:
        for m in range(micro):
            x, y = torch.randn(16, 64, device=dev, generator=g), torch.randn(16, 64, device=dev, generator=g)
            with sharded.no_sync() if m < micro - 1 else contextlib.nullcontext():
                nn.functional.mse_loss(sharded(x), y).backward()
        if mixed:
            hsdp.clip_grad_norm_(sharded, 1.0)
        opt.step()
        opt.zero_grad()
    torch.cuda.synchronize(dev)
    hops = sharded.comm.stats.calls("replicate", "all_reduce")
    assert hops > 0, "no hop was issued: the replicate group was not posed as 2 ranks"
    return {"config": config, "hop_all_reduces": hops, "units": len(sharded.units)}


if __name__ == "__main__":
    main()
