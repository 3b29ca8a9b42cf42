"""One rank of a 2 x 4 ("replicate", "shard") mesh over torch's fake process group, in a process of its own.

The fake process group (``torch.testing._internal.distributed.fake_pg``) lets one process play rank ``r`` of a
world of 8: its collectives move no data (an all-gather copies this rank's input into every chunk, a
reduce-scatter keeps this rank's chunk of the input, an all-reduce leaves the tensor as it is), so values are
meaningless but every shape, buffer, stream and allocation is the one rank ``r`` of a real 8-rank job would
have. Checked, for each rank of ``--ranks``:

* the mesh: replicate 2 x shard 4, this rank's coordinates, tensors on ``--device``;
* shapes: every parameter a ``DTensor`` of its original shape, ``Shard(0)`` on the replica's shard mesh, its
  local tensor this rank's dim-0 chunk of ``ceil(rows / 4)`` rows (fewer on the last ranks, none past the end: hsdp pads
  each chunk to ``ceil(rows / 4)`` rows in its flat buffer), the same local shape FSDP2's ``fully_shard``
  gives it on the same mesh; gradients shaped like their parameters; an unused layer's gradient ``None``
  after the step;
* host reads: over two steps (after one of set-up), no read of a tensor's value on the host but the one hsdp
  intends per step (``drop_unused_grads``), counted on any device; on CUDA the steps also run under
  ``torch.cuda.set_sync_debug_mode("error")``, so any synchronising CUDA call raises;
* ``--memory`` (CUDA, first rank of ``--ranks``): peak ``torch.cuda.max_memory_allocated`` over three steps of
  hsdp and of FSDP2 (same model, mesh, batch, AdamW), printed; the caller compares them.

Prints one line ``FAKE_MESH_RESULT <json>``; any failed check raises (non-zero exit, traceback on stderr).
Run: ``python tests/programs/fake_mesh.py --device cpu --ranks 0 7`` (the tree on ``PYTHONPATH``).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import gc
import json
import math
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.testing._internal.distributed.fake_pg import FakeStore

import hsdp
from hsdp.engine.runtime import reduction as runtime_reduction
from hsdp.engine.runtime import step_read as runtime_step_read

REPLICAS, SHARDS = 2, 4
READS = ("item", "tolist", "numpy", "__array__", "__bool__", "__float__", "__int__", "__index__")


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden)  # hidden rows, not a multiple of 4: the last chunks are padded
        self.down = nn.Linear(hidden, dim)
        self.gate = nn.Linear(dim, 3)  # 3 rows over 4 ranks: the last rank's chunk is empty

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(x))) * self.gate(x).sigmoid().mean(-1, keepdim=True)


class Stack(nn.Module):
    """Linear layers, GELU and an MSE loss only: no kernel of the model itself syncs with the host."""

    def __init__(self, dim: int, hidden: int, depth: int) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[Block(dim, hidden) for _ in range(depth)])  # one unit each
        self.head = nn.Linear(dim, dim)
        self.unused = nn.Linear(dim, 3)  # never called: its gradient must end as None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--ranks", type=int, nargs="+", default=[0], help="which of the 8 ranks to play, in turn")
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--hidden", type=int, default=17)
    p.add_argument("--depth", type=int, default=2)
    p.add_argument("--batch", type=int, default=8, help="rows of the (batch, dim) input")
    p.add_argument("--memory", action="store_true", help="CUDA: compare peak memory with FSDP2")
    return p.parse_args(argv)


def expected_local_shape(shape: torch.Size, shard_rank: int) -> tuple[int, ...]:
    """This rank's dim-0 chunk: ``ceil(rows / S)`` rows per rank, the last ones shorter or empty."""
    rows, chunk = shape[0], math.ceil(shape[0] / SHARDS)
    return (max(0, min(chunk, rows - shard_rank * chunk)), *shape[1:])


def build(args: argparse.Namespace) -> Stack:
    torch.manual_seed(0)
    return Stack(args.dim, args.hidden, args.depth)  # on the CPU: each framework moves it to the mesh device


def batches(args: argparse.Namespace, device: torch.device, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(args.batch, args.dim, generator=g).to(device),
             torch.randn(args.batch, args.dim, generator=g).to(device)) for _ in range(n)]


def train_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
               after_backward: Callable[[], None] | None = None) -> None:
    nn.functional.mse_loss(model(x), y).backward()
    if after_backward is not None:
        after_backward()
    opt.step()
    opt.zero_grad()


# ---------------------------------------------------------------------------------------------------------
# Host reads.
# ---------------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def host_reads(device: torch.device, optimizer: torch.optim.Optimizer) -> Iterator[dict[str, list]]:
    """Count the host reads made inside: ``intended`` (calls of ``drop_unused_grads``, hsdp's one read per
    step) and ``other`` (call sites of every other read of a tensor's value). Reads of the optimizer's
    ``step`` counters are left out: torch keeps them on the CPU (``capturable=False``), they never wait
    for the device; so are, on CUDA, reads of other CPU tensors. On CUDA everything but ``drop_unused_grads``
    also runs under ``set_sync_debug_mode("error")``."""
    found: dict[str, list] = {"intended": [], "other": []}
    inside = [0]
    cuda = device.type == "cuda"

    def counters() -> set[int]:
        return {id(s["step"]) for s in optimizer.state.values() if isinstance(s.get("step"), torch.Tensor)}

    def allowed(original: Callable[..., Any]) -> Callable[..., Any]:
        def drop_unused_grads(*a: Any, **k: Any) -> Any:
            found["intended"].append(1)
            inside[0] += 1
            if cuda:
                torch.cuda.set_sync_debug_mode(0)
            try:
                return original(*a, **k)
            finally:
                inside[0] -= 1
                if cuda:
                    torch.cuda.set_sync_debug_mode("error")
        return drop_unused_grads

    def counted(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def read(self: torch.Tensor, *a: Any, **k: Any) -> Any:
            # On CUDA a read of a CPU tensor waits for nothing (the sync debug mode catches every real sync).
            if not inside[0] and id(self) not in counters() and not (cuda and self.device.type == "cpu"):
                frame = traceback.extract_stack(limit=2)[0]
                found["other"].append(f"{name} at {frame.filename}:{frame.lineno} ({frame.name})")
            inside[0] += 1  # a read inside another (__float__ calling item) counts once
            try:
                return original(self, *a, **k)
            finally:
                inside[0] -= 1
        return read

    # Both bindings: the runtime calls it through the state module (or reduction's own, wherever it moves).
    patched = [(mod, "drop_unused_grads", mod.drop_unused_grads)
               for mod in (runtime_step_read, runtime_reduction) if hasattr(mod, "drop_unused_grads")]
    patched += [(torch.Tensor, name, getattr(torch.Tensor, name)) for name in READS]
    for owner, name, original in patched:
        setattr(owner, name, allowed(original) if name == "drop_unused_grads" else counted(name, original))
    if cuda:
        torch.cuda.set_sync_debug_mode("error")
    try:
        yield found
    finally:
        if cuda:
            torch.cuda.set_sync_debug_mode(0)
        for owner, name, original in patched:
            setattr(owner, name, original)


# ---------------------------------------------------------------------------------------------------------
# One rank.
# ---------------------------------------------------------------------------------------------------------
def check_mesh(mesh: hsdp.HSDPMesh, rank: int, device: torch.device) -> None:
    assert (mesh.replicate_degree, mesh.sharding_degree) == (REPLICAS, SHARDS), mesh
    assert (mesh.replicate_rank, mesh.shard_rank) == divmod(rank, SHARDS), mesh
    assert mesh.device == device, (mesh.device, device)


def check_shapes(sharded: hsdp.ShardedModel, reference: Stack, shard_rank: int, device: torch.device) -> int:
    """Every parameter's sharded face against its original; returns how many were checked."""
    originals = dict(reference.named_parameters())
    for name, p in sharded.named_parameters():
        full = originals[name].shape
        assert isinstance(p, DTensor) and p.shape == full, (name, type(p), p.shape, full)
        assert tuple(p.placements) == (Shard(0),), (name, p.placements)
        assert p.device_mesh.mesh_dim_names == ("shard",), (name, p.device_mesh)  # the replica's own mesh
        local = p.to_local()
        assert tuple(local.shape) == expected_local_shape(full, shard_rank), (name, local.shape, full)
        assert local.device == device, (name, local.device)
    for unit in sharded.units:
        # The flat buffer holds every chunk padded to ceil(rows / S) rows, back to back.
        padded = sum(math.ceil(p.layout.global_shape[0] / SHARDS) * math.prod(p.layout.global_shape[1:])
                     for p in unit.params)
        assert unit.sharded_flat.numel() == padded, (unit.name, unit.sharded_flat.numel(), padded)
    return len(originals)


def check_grads(sharded: hsdp.ShardedModel) -> None:
    for name, p in sharded.named_parameters():
        if name.startswith("unused."):
            continue
        assert isinstance(p.grad, DTensor), (name, type(p.grad))
        assert p.grad.shape == p.shape and p.grad.to_local().shape == p.to_local().shape, (name, p.grad.shape)


def fsdp2_local_shapes(reference: Stack, dm: DeviceMesh) -> dict[str, tuple[int, ...]]:
    model = copy.deepcopy(reference)
    for block in model.blocks:
        fully_shard(block, mesh=dm)
    fully_shard(model, mesh=dm)
    return {name: tuple(p.to_local().shape) for name, p in model.named_parameters()}


def play_rank(rank: int, args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=REPLICAS * SHARDS)
    try:
        # A DeviceMesh of the device wanted: on a fake process group hsdp.init_mesh(4) would choose the CPU
        # (the backend's name, "fake", names no GPU backend).
        dm = init_device_mesh(args.device, (REPLICAS, SHARDS), mesh_dim_names=("replicate", "shard"))
        mesh = hsdp.init_mesh(device_mesh=dm, fault_policy=None)
        check_mesh(mesh, rank, device)
        reference = build(args)
        sharded = hsdp.ShardedModel(copy.deepcopy(reference), mesh=mesh)
        checked = check_shapes(sharded, reference, mesh.shard_rank, device)
        ours = {name: tuple(p.to_local().shape) for name, p in sharded.named_parameters()}
        theirs = fsdp2_local_shapes(reference, dm)
        assert ours == theirs, {n: (ours[n], theirs.get(n)) for n in ours if ours[n] != theirs.get(n)}
        opt = hsdp.ShardedOptimizer(sharded, torch.optim.AdamW(sharded.parameters(), lr=1e-3))
        data = batches(args, device, 3)
        train_step(sharded, opt, *data[0], after_backward=functools.partial(check_grads, sharded))  # set-up step
        assert sharded.unused.weight.grad is None and sharded.unused.bias.grad is None
        with host_reads(device, opt) as reads:
            for x, y in data[1:]:
                train_step(sharded, opt, x, y)
        assert not reads["other"], reads["other"]
        assert len(reads["intended"]) <= len(data) - 1, reads["intended"]
        result: dict[str, Any] = {"rank": rank, "params_checked": checked, "intended_reads": len(reads["intended"]),
                                  "steps_under_check": len(data) - 1}
        del sharded, opt
        if args.memory and rank == args.ranks[0]:
            result["peak_bytes"] = {name: peak_bytes(name, reference, mesh, dm, args, device)
                                    for name in ("hsdp", "fsdp2")}
        return result
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------------------
# Peak memory (CUDA).
# ---------------------------------------------------------------------------------------------------------
def peak_bytes(framework: str, reference: Stack, mesh: hsdp.HSDPMesh, dm: DeviceMesh,
               args: argparse.Namespace, device: torch.device) -> int:
    """Peak allocated bytes over three training steps (the first creates the optimizer state), above what was
    allocated before wrapping (the batches, cuBLAS's workspace, the other framework's leftovers). Wrapping
    itself is left out: FSDP2 moves the whole model to the device before sharding it, hsdp one unit at a
    time, and that is not what this compares."""
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    data = batches(args, device, 3)
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    model = copy.deepcopy(reference)
    if framework == "hsdp":
        model = hsdp.ShardedModel(model, mesh=mesh)
        opt = hsdp.ShardedOptimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    else:
        for block in model.blocks:
            fully_shard(block, mesh=dm)
        fully_shard(model, mesh=dm)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    for x, y in data:
        train_step(model, opt, x, y)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del model, opt, data
    return peak


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.memory and args.device != "cuda":
        raise SystemExit("--memory needs --device cuda (peak memory is the CUDA caching allocator's)")
    if args.device == "cuda":
        torch.cuda.set_device(0)
        torch.matmul(torch.ones(64, 64, device="cuda"), torch.ones(64, 64, device="cuda"))  # cuBLAS handle first
    results = [play_rank(rank, args) for rank in args.ranks]
    print("FAKE_MESH_RESULT " + json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
