"""The HSDP tutorial's second example (SimpleModel + ShardedModel/ShardedOptimizer), made runnable.

The tutorial imports ``torch.distributed.sharded_model.ShardedModel, ShardedOptimizer``, which PyTorch does
not have; ``hsdp`` provides both. Differences from the tutorial, each fixing a bug in it:

* The process group comes from the torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT)
  instead of mp.spawn with a hard-coded MASTER_PORT, which collides with any other job on the machine.
* Backend nccl with CUDA, else gloo; device ``cuda:LOCAL_RANK`` (not ``rank % sharding_degree``, which is
  wrong whenever the sharding degree differs from the GPUs per node), else cpu.
* The model is always wrapped: ``sharding_degree=1`` is plain replication (DDP), and an unwrapped model
  would train every rank on its own with no gradient synchronisation at all.
* Every rank reads distinct data (see ``make_dataloader``), the dataset is identical on every rank, and the
  target is a learnable function of the input so the loss visibly falls.

Run (CPU or GPUs)::

    torchrun --nproc-per-node 4 examples/seed_tutorial.py                   # 2 replicas x 2 shards
    torchrun --nproc-per-node 4 examples/seed_tutorial.py --sharding-degree 4
    python examples/seed_tutorial.py --spawn 4                              # without torchrun
"""

from __future__ import annotations

import argparse
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.optim as optim
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import hsdp
from hsdp import ShardedModel, ShardedOptimizer


# 1. Initialise the distributed environment (from torchrun's environment variables).
def setup() -> torch.device:
    """Init the default process group and return this rank's device."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)  # before init, so NCCL binds this rank to its own GPU
        backend, device = "nccl", torch.device("cuda", local_rank)
    else:
        backend, device = "gloo", torch.device("cpu")
    dist.init_process_group(backend)  # rank, world size and rendezvous come from the environment
    return device


def cleanup() -> None:
    dist.destroy_process_group()


# 2. A simple model.
class SimpleModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear1 = nn.Linear(10, 20)
        self.relu = nn.ReLU()
        self.linear2 = nn.Linear(20, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.linear1(x)
        x = self.relu(x)
        x = self.linear2(x)
        return x


# 3. A dummy dataset.
class DummyDataset(Dataset):
    """``labels = data @ w + b + noise`` for a fixed random ``(w, b)``.

    Seeded, so every rank builds the same dataset: a sampler can only split a dataset into disjoint parts
    if it is the same dataset everywhere (the tutorial's unseeded ``randn`` gave each rank its own). Random
    labels, as in the tutorial, cannot be learnt, so its loss never fell.
    """

    def __init__(self, size: int, seed: int = 0, noise: float = 0.1) -> None:
        g = torch.Generator().manual_seed(seed)
        self.size = size
        self.data = torch.randn(size, 10, generator=g)
        w, b = torch.randn(10, 1, generator=g), torch.randn(1, generator=g)
        self.labels = self.data @ w + b + noise * torch.randn(size, 1, generator=g)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[idx], self.labels[idx]


def make_dataloader(dataset: Dataset, batch_size: int) -> DataLoader:
    """Every rank reads its own part of the dataset.

    The tutorial split the data per *node* (``num_replicas=node_size, rank=node_rank``). That was right
    only for its simulation, where DDP inside a node made the ranks of one node replicas that may share a
    batch. In HSDP the ranks of a node split the *parameters*, not the batch: each is a full data-parallel
    worker, so per-node splitting would make the ranks of a node compute identical gradients and waste
    (sharding_degree - 1) / sharding_degree of the compute. ``hsdp.distributed_sampler`` is
    ``DistributedSampler(num_replicas=world_size, rank=global_rank)``.
    """
    sampler = hsdp.distributed_sampler(dataset, shuffle=True)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler)


def global_mean(total: float, count: int, device: torch.device) -> float:
    """Average over every rank's samples (the loss of the whole step, not of rank 0's batch)."""
    t = torch.tensor([total, float(count)], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return (t[0] / t[1]).item()


def train(sharding_degree: int, epochs: int, batch_size: int, dataset_size: int) -> bool:
    """Train; return whether the average loss of the last epoch is below that of the first."""
    device = setup()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    # Replica = "node" of the tutorial: ranks [r*S, (r+1)*S) shard one copy of the model.
    replica_rank, shard_rank = divmod(rank, sharding_degree)
    print(f"Rank {rank}: replica {replica_rank} of {world_size // sharding_degree}, "
          f"shard {shard_rank} of {sharding_degree}, device {device}", flush=True)

    # 4. Build the model, then shard it inside each replica (rank 0's initial weights are broadcast).
    torch.manual_seed(0)
    model = SimpleModel().to(device)
    model = ShardedModel(model, sharding_degree=sharding_degree)

    # 5. Loss and optimizer: built on model.parameters() after wrapping, i.e. on this rank's shards.
    criterion = nn.MSELoss()
    optimizer = optim.Adam(model.parameters(), lr=0.001)
    optimizer = ShardedOptimizer(model, optimizer)

    # 6. Dataset and dataloader.
    dataset = DummyDataset(size=dataset_size)
    dataloader = make_dataloader(dataset, batch_size)
    sampler = dataloader.sampler
    assert isinstance(sampler, DistributedSampler)

    # 7. Training loop. Every print flushes: ranks share one stdout pipe, and a line written in one piece
    # is not split by another rank's output.
    model.train()
    epoch_losses = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)  # a new shuffle every epoch (the tutorial reused epoch 0's order)
        total, count = 0.0, 0
        for i, (inputs, labels) in enumerate(dataloader):
            inputs = inputs.to(device)
            labels = labels.to(device)

            # Forward.
            outputs = model(inputs)
            loss = criterion(outputs, labels)

            # Backward and update: gradients are reduce-scattered in the shard group and all-reduced
            # across replicas during backward; each rank then steps only its shards.
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

            total += loss.item() * len(inputs)
            count += len(inputs)
            if i % 10 == 0:
                print(f"Rank {rank}, Epoch {epoch}, Batch {i}, Loss: {loss.item():.4f}", flush=True)
        epoch_losses.append(global_mean(total, count, device))
        if rank == 0:
            print(f"Epoch {epoch}: average loss {epoch_losses[-1]:.4f}", flush=True)

    fell = epoch_losses[-1] < epoch_losses[0]
    if rank == 0:
        verdict = "loss fell" if fell else "ERROR: loss did not fall"
        print(f"first average loss: {epoch_losses[0]:.6f}\nlast average loss: {epoch_losses[-1]:.6f}\n{verdict}",
              flush=True)
    cleanup()
    return fell


def _spawned(rank: int, world_size: int, port: int, args: argparse.Namespace) -> None:
    """One ``--spawn`` process: fake torchrun's environment, then train as under torchrun."""
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
                       "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    if not train(args.sharding_degree, args.epochs, args.batch_size, args.dataset_size):
        sys.exit(1)  # mp.spawn turns a non-zero exit into an exception in the parent


def _free_port() -> int:
    # A port the OS just handed out, instead of the tutorial's fixed 12355 that a second job would clash on.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sharding-degree", type=int, default=2,
                   help="ranks that shard one model copy (GPUs per node in the tutorial); default 2")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=32)
    # The tutorial's 1000 samples are only 8 batches per rank and epoch on 4 ranks: too few Adam steps at
    # lr 1e-3 for the loss to fall visibly in 3 epochs.
    p.add_argument("--dataset-size", type=int, default=8000)
    p.add_argument("--spawn", type=int, default=0, metavar="N",
                   help="start N local processes with mp.spawn instead of running under torchrun")
    args = p.parse_args(argv)
    if args.epochs < 2:
        p.error("--epochs must be at least 2: the check compares the first epoch's loss with the last's")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.spawn:
        mp.spawn(_spawned, args=(args.spawn, _free_port(), args), nprocs=args.spawn, join=True)
        return 0
    return 0 if train(args.sharding_degree, args.epochs, args.batch_size, args.dataset_size) else 1


if __name__ == "__main__":
    sys.exit(main())
