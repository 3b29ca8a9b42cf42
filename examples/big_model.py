"""The big-model recipe: build on the meta device, shard, then create only this rank's shards.

A model too big for one device's memory cannot be built whole on every rank first. Built under
``torch.device("meta")`` it has shapes but no storage; ``hsdp.ShardedModel`` shards it without allocating
or broadcasting anything; then either

* ``hsdp.materialize(model, init=...)`` allocates this rank's shards and initialises the model one module
  at a time at full size (so inits that depend on shapes see the real ones), keeping this rank's rows.
  Every rank uses the same seed, so replicas agree with nothing sent between nodes; or
* ``hsdp.load_pretrained(model, path)`` reads this rank's rows of a ``.safetensors`` file or a Hugging Face
  folder straight into the shards (replica 0 reads, then broadcasts to the other replicas).

The optimizer comes after (it must see the materialised parameters). The model here is the tiny GPT
preset so the example runs in seconds on CPU; the same lines scale to models that only fit sharded.

    torchrun --nproc-per-node 4 examples/big_model.py                          # materialize, 2 x 2 mesh
    torchrun --nproc-per-node 4 examples/big_model.py --export /tmp/gpt.safetensors
    torchrun --nproc-per-node 4 examples/big_model.py --pretrained /tmp/gpt.safetensors
    torchrun --nproc-per-node 4 examples/big_model.py --pretrained /tmp/gpt.safetensors --epochs 0 \
        --export /tmp/again.safetensors                                         # load and write back: equal files
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import hsdp
from hsdp.models.gpt import GPT, GPTConfig, preset


def gpt_init(model: nn.Module, cfg: GPTConfig):  # a closure: init(module) -> None
    """GPT's own initialisation, per module (``materialize`` calls it for every module with tensors of its
    own, in ``model.modules()`` order, at full size): N(0, 0.02), residual projections scaled by depth."""
    proj = {id(m) for name, m in model.named_modules() if name.endswith(".proj")}

    def init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            std = 0.02 / math.sqrt(2 * cfg.n_layer) if id(m) in proj else 0.02
            nn.init.normal_(m.weight, mean=0.0, std=std)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
        else:
            m.reset_parameters()  # LayerNorm: ones and zeros

    return init


def counting_dataset(cfg: GPTConfig, n: int = 256) -> TensorDataset:
    """Sequences that count up modulo the vocabulary from a random start: learnable, so the loss falls."""
    g = torch.Generator().manual_seed(0)  # the same dataset on every rank; the sampler splits it
    starts = torch.randint(0, cfg.vocab_size, (n, 1), generator=g)
    seq = (starts + torch.arange(cfg.block_size + 1)) % cfg.vocab_size
    return TensorDataset(seq[:, :-1], seq[:, 1:])


def main() -> None:
    parser = argparse.ArgumentParser(description="meta device -> ShardedModel -> materialize / load_pretrained")
    parser.add_argument("--sharding-degree", type=int, default=2)
    parser.add_argument("--pretrained", help="a .safetensors file or Hugging Face folder to load instead")
    parser.add_argument("--export", help="after training, write the weights to this .safetensors file")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    mesh = hsdp.init_mesh(args.sharding_degree)  # process group from torchrun's environment
    cfg = preset("tiny")
    with torch.device("meta"):
        model = GPT(cfg)  # shapes only: no memory, no init
    model = hsdp.ShardedModel(model, mesh=mesh)  # nothing allocated, nothing broadcast
    if args.pretrained:
        hsdp.load_pretrained(model, args.pretrained)
    else:
        torch.manual_seed(args.seed)  # the same RNG state on every rank: materialize checks it
        hsdp.materialize(model, init=gpt_init(model, cfg))
    opt = hsdp.ShardedOptimizer(model, torch.optim.AdamW(model.parameters(), lr=3e-3))

    dataset = counting_dataset(cfg)
    sampler = hsdp.distributed_sampler(dataset, mesh, shuffle=True, seed=args.seed)  # distinct data per rank
    loader = DataLoader(dataset, batch_size=8, sampler=sampler)
    losses = []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        for x, y in loader:
            _, loss = model(x.to(mesh.device), y.to(mesh.device))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    model.check_replicas()  # replicas hold the same bits after training
    if mesh.rank == 0:
        trained = f"; loss {losses[0]:.3f} -> {losses[-1]:.3f}" if losses else ""  # --epochs 0: load, export
        print(f"{'loaded' if args.pretrained else 'materialized'} {sum(p.numel() for p in model.parameters()):,} "
              f"parameters; {len(losses)} steps on a {mesh}{trained}", flush=True)
    if args.export:
        export(model, args.export)
    dist.destroy_process_group()


def export(model: nn.Module, path: str) -> None:
    """Consolidate on rank 0 and write each tied tensor once (what load_pretrained reads back)."""
    from safetensors.torch import save_file

    full = hsdp.full_state_dict(model)  # a collective: every rank calls it
    if full:
        weights, seen = {}, set()
        for name, t in full.items():
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                weights[name] = t.contiguous()
        save_file(weights, path)
        print(f"wrote {path}", flush=True)


if __name__ == "__main__":
    main()
