"""HSDP + tensor parallelism: hsdp's GPT on a (replicate, shard, tp) mesh, the recipe end to end.

One node, 4 ranks (R=1, S=2, T=2), or two replicas of one tensor-parallel pair each (R=2, S=1, T=2)::

    torchrun --nproc-per-node 4 examples/tensor_parallel.py --steps 20
    torchrun --nproc-per-node 4 examples/tensor_parallel.py --shard 1 --preset tiny --lr 3e-3

Two emulated nodes of 4 ranks (R=2, S=2, T=2), the inter-node bytes measured on the links::

    sudo hsdp launch --nodes 2 --nproc-per-node 4 --inter-node-bandwidth 1gbit -- examples/tensor_parallel.py

Each rank of a tensor-parallel group reads the same batch (``hsdp.data_parallel_rank``); rank 0 prints the loss,
and at the end the inter-node bytes per step per node that hsdp sent, against the floor 2(R-1)/R x P x 4.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

import hsdp
from hsdp.models.gpt import GPT, preset


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--preset", default="small", help="a GPT preset of hsdp.models.gpt (default: small)")
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel degree T (divides the ranks per node)")
    parser.add_argument("--shard", type=int, default=None, help="sharding degree S (default: ranks per node / T)")
    parser.add_argument("--batch", type=int, default=4, help="sequences per data-parallel rank")
    parser.add_argument("--lr", type=float, default=3e-4)
    args = parser.parse_args()

    mesh = hsdp.init_mesh(args.shard, tensor_parallel_degree=args.tp)
    cfg = preset(args.preset)
    torch.manual_seed(0)  # the same model on every rank: sequence-parallel norm weights are not scattered
    model = GPT(cfg)
    hsdp.tp_plans.gpt_plan(model, mesh.tp_mesh)  # torch's parallelize_module on each block
    model = hsdp.ShardedModel(model, mesh=mesh)
    opt = hsdp.ShardedOptimizer(model, torch.optim.AdamW(model.parameters(), lr=args.lr))
    n_params = sum(p.numel() for p in model.parameters())  # global sizes: DTensors
    if mesh.rank == 0:
        print(f"{mesh}: GPT {args.preset}, {n_params / 1e6:.1f}M parameters")

    inter_node = 0.0
    for step in range(args.steps):
        # Data-parallel rank, not global rank: the T ranks of a tensor-parallel group read the same rows.
        g = torch.Generator().manual_seed(1000 * step + hsdp.data_parallel_rank(mesh))
        # Sequences that count up modulo the vocabulary from a random start: learnable, so the loss falls.
        start = torch.randint(0, cfg.vocab_size, (args.batch, 1), generator=g)
        ids = (start + torch.arange(cfg.block_size + 1)) % cfg.vocab_size
        model.reset_comm_stats()
        _, loss = model(ids[:, :-1].to(mesh.device), ids[:, 1:].to(mesh.device))
        loss.backward()
        hsdp.clip_grad_norm_(model, 1.0)
        opt.step()
        opt.zero_grad()
        if step > 0:  # the first step's numbers include warm-up; every later step sends the same bytes
            inter_node += sum(op["wire_bytes"] for op in model.comm_stats().get("replicate", {}).values())
        if mesh.rank == 0:
            print(f"step {step}: loss {loss.item():.4f}")
    _report(mesh, n_params, inter_node / max(1, args.steps - 1))


def _report(mesh: hsdp.HSDPMesh, n_params: int, per_rank: float) -> None:
    """Inter-node bytes per step per node (the node's ranks summed) against the floor."""
    total = torch.tensor([per_rank], dtype=torch.float64, device=mesh.device)
    dist.all_reduce(total)
    per_node = total.item() / mesh.replicate_degree  # S x T ranks per node
    r = mesh.replicate_degree
    floor = 2 * (r - 1) / r * n_params * 4
    if mesh.rank == 0 and r > 1:
        print(f"inter-node bytes per step per node (hsdp's count): {per_node / 1e6:.3f} MB = "
              f"{per_node / floor:.4f} x the floor 2(R-1)/R x P x 4 = {floor / 1e6:.3f} MB")


if __name__ == "__main__":
    main()
