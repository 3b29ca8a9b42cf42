"""Lightning Fabric on hsdp: a tiny GPT trained with accumulation and clipping, saved, loaded, trained on.

    torchrun --nproc-per-node 4 examples/lightning_fabric.py             # CPU/gloo, 2 replicas x 2 shards
    torchrun --nproc-per-node 4 examples/lightning_fabric.py --precision bf16-mixed

Fabric launches nothing (torchrun did); ``fabric.setup`` returns an ``hsdp.ShardedModel`` and an
``hsdp.ShardedOptimizer``, ``fabric.no_backward_sync`` is hsdp's in-node-only accumulation, ``fabric.save``
writes an hsdp checkpoint (``hsdp export DIR --to model.safetensors`` consolidates it). Rank 0 prints each
step's loss and gradient norm and, per micro-batch, the collectives that crossed nodes.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from hsdp.integrations.lightning import HSDPFabricStrategy
from hsdp.models.gpt import GPT, GPTConfig

VOCAB, SEQ, ACCUMULATE = 64, 16, 2


def build(seed: int) -> tuple[GPT, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=2, n_embd=32))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def train(fabric: L.Fabric, model: torch.nn.Module, opt: torch.optim.Optimizer, loader: DataLoader,
          first: int, steps: int) -> None:
    """Optimizer steps ``first + 1 .. steps``, ACCUMULATE micro-batches each."""
    for i, (x, y) in enumerate(loader):
        if i < first * ACCUMULATE or i >= steps * ACCUMULATE:
            continue
        accumulating = (i + 1) % ACCUMULATE != 0
        model.reset_comm_stats()
        with fabric.no_backward_sync(model, enabled=accumulating):  # the last micro-batch crosses nodes, once
            _, loss = model(x, y)
            fabric.backward(loss / ACCUMULATE)
        crossed = model.comm_stats().get("replicate", {}).get("all_reduce", {}).get("calls", 0)
        if accumulating:
            fabric.print(f"  micro-batch {i}: loss {loss.item():.4f}, inter-node collectives {crossed}")
            continue
        norm = fabric.clip_gradients(model, opt, max_norm=1.0)  # hsdp.clip_grad_norm_: the whole gradient's norm
        opt.step()
        opt.zero_grad()
        fabric.print(f"step {(i + 1) // ACCUMULATE}: loss {loss.item():.4f}, grad norm {norm.item():.4f}, "
                     f"inter-node collectives {crossed}")


def probe_loss(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> float:
    """The loss on ``batch``, every rank (the sharded model's forward gathers its units)."""
    with torch.no_grad():
        return model(*batch)[1].item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shard", type=int, default=2, help="sharding degree (default 2: 2 replicas of 2 on 4 ranks)")
    parser.add_argument("--precision", default="32-true", choices=["32-true", "bf16-mixed"])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", default=None, help="checkpoint directory to keep (default: a temporary one)")
    args = parser.parse_args()

    accelerator = "cuda" if torch.cuda.is_available() else "cpu"
    fabric = L.Fabric(accelerator=accelerator, strategy=HSDPFabricStrategy(sharding_degree=args.shard),
                      precision=args.precision)
    fabric.launch()
    fabric.print(f"mesh: {fabric.strategy.mesh}")
    # Sequences that count up modulo the vocabulary from a random start: learnable, so the loss falls.
    starts = torch.randint(0, VOCAB, (64 * fabric.world_size, 1), generator=torch.Generator().manual_seed(0))
    ids = (starts + torch.arange(SEQ + 1)) % VOCAB
    probe = (ids[:8, :-1].to(fabric.device), ids[:8, 1:].to(fabric.device))  # a fixed batch to compare weights on
    loader = fabric.setup_dataloaders(DataLoader(TensorDataset(ids[:, :-1], ids[:, 1:]), batch_size=2))

    model, opt = fabric.setup(*build(seed=0))
    half = args.steps // 2
    train(fabric, model, opt, loader, 0, half)
    path = fabric.broadcast(args.out or tempfile.mkdtemp(prefix="hsdp-fabric-"))
    fabric.save(path, {"model": model, "optimizer": opt, "step": half})
    fabric.print(f"saved {path} (an hsdp run directory): loss on a fixed batch {probe_loss(model, probe):.6f}")

    model, opt = fabric.setup(*build(seed=1))  # fresh weights: the checkpoint must bring them back
    state = {"model": model, "optimizer": opt, "step": 0}
    fabric.load(path, state)
    fabric.print(f"loaded step {state['step']}: loss on a fixed batch {probe_loss(model, probe):.6f}; training on")
    train(fabric, model, opt, loader, state["step"], args.steps)
    fabric.barrier()
    if args.out is None and fabric.is_global_zero:
        shutil.rmtree(path)


if __name__ == "__main__":
    main()
