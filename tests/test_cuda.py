"""The GPU path, on one CUDA device with NCCL (skipped without; run by ``benchmarks/gpu_check.sh``).

One process, one rank: a 1 x 1 mesh over a real NCCL group, so every collective, stream and allocation is
the GPU's. Checked: a model built on the CPU is moved to ``cuda:LOCAL_RANK`` at wrap, shard by shard (never
the whole model at once), with its buffers, gradients and optimizer state there too, and one step equals
the plain model's; forward, backward and the optimizer step make no host sync but the one hsdp intends;
an optimizer editing the shards in place while prefetched all-gathers run trains exactly as the plain
model does over many steps; a meta-built model stays on meta until ``hsdp.materialize`` puts it on the GPU.
"""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from meta_models import MetaNet
from models import ParityNet, batch, loss_fn
from torch import nn
from torch.distributed.tensor import DTensor

import hsdp
from hsdp.engine.runtime import step_read

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available() or not dist.is_nccl_available(),
                       reason="needs a CUDA device and NCCL"),
]


@pytest.fixture(scope="module")
def mesh(nccl_mesh: hsdp.HSDPMesh) -> hsdp.HSDPMesh:
    """The 1 x 1 NCCL mesh of ``conftest.py``."""
    return nccl_mesh


def _device() -> torch.device:
    return torch.device("cuda", int(os.environ["LOCAL_RANK"]))


def _tensors_of_state(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    # torch keeps a non-capturable optimizer's "step" counter on the CPU on purpose: only per-element state.
    return [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0]


def test_a_cpu_built_model_moves_to_the_mesh_device_and_steps_like_the_plain_model(mesh: hsdp.HSDPMesh) -> None:
    dev = _device()
    assert mesh.device == dev
    torch.manual_seed(0)
    model = ParityNet()  # on the CPU: tied weights, a frozen layer, a buffer, an unused parameter
    plain = copy.deepcopy(model).to(dev)
    sharded = hsdp.ShardedModel(model, mesh=mesh)
    for unit in sharded.units:
        assert unit.sharded_flat.device == dev, unit
        for p in unit.params:
            assert p.unsharded_padded.device == dev, p.fqn
    for name, p in sharded.named_parameters():
        assert isinstance(p, DTensor) and p.device == dev and p.to_local().device == dev, name
    for name, b in sharded.named_buffers():
        assert b.device == dev, name
    opt = hsdp.ShardedOptimizer(sharded, torch.optim.AdamW(sharded.parameters(), lr=1e-2))
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    x, y = (t.to(dev) for t in batch(0, 0))
    loss = loss_fn(sharded(x), y)
    loss.backward()
    plain_loss = loss_fn(plain(x), y)
    plain_loss.backward()
    torch.testing.assert_close(loss, plain_loss, rtol=1e-6, atol=1e-6)
    grads = {n: p.grad for n, p in sharded.named_parameters() if p.grad is not None}
    assert grads and all(g.device == dev and g.to_local().device == dev for g in grads.values()), grads.keys()
    opt.step()
    plain_opt.step()
    state = _tensors_of_state(opt)
    assert state and all(t.device == dev for t in state)
    expected = dict(plain.named_parameters())
    for name, p in sharded.named_parameters():
        torch.testing.assert_close(p.full_tensor(), expected[name].detach(), rtol=1e-5, atol=1e-6, msg=name)


def test_the_state_dict_and_parameters_live_on_the_mesh_device(mesh: hsdp.HSDPMesh) -> None:
    dev = _device()
    sharded = hsdp.ShardedModel(ParityNet(), mesh=mesh)
    for key, value in sharded.state_dict().items():
        assert value.device == dev, key
        if isinstance(value, DTensor):
            assert value.to_local().device == dev, key
    assert {p.device for p in sharded.parameters()} == {dev}
    assert sharded.to(dev) is sharded and sharded.units[0].sharded_flat.device == dev  # a no-op, not an error


def test_wrapping_copies_shards_without_the_whole_model_on_the_gpu_first(mesh: hsdp.HSDPMesh) -> None:
    dev = _device()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(6)])  # on the CPU
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    unit_bytes = model_bytes // 6
    torch.cuda.synchronize(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    before = torch.cuda.memory_allocated(dev)
    sharded = hsdp.ShardedModel(model, mesh=mesh, wrap=nn.Linear)  # six equal units
    torch.cuda.synchronize(dev)
    peak = torch.cuda.max_memory_allocated(dev) - before
    # S = 1: the shards are the whole model. Moving the model first, then sharding it, would peak at twice
    # that; shard by shard costs at most one unit more (a parameter's unsharded face is created, then freed).
    assert model_bytes <= peak <= model_bytes + unit_bytes, (peak, model_bytes, unit_bytes)
    assert all(u.sharded_flat.device == dev for u in sharded.units)


@contextlib.contextmanager
def _sync_debug_errors(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Any host sync raises, but the one hsdp intends: the step's read of the "has gradient" flags of every
    reduction of a backward (``drop_unused_grads``, before the optimizer step), counted in the yielded list."""
    allowed: list[int] = []
    original = getattr(step_read, "drop_unused_grads", None)
    if original is not None:
        def drop_unused_grads(*args: object, **kwargs: object) -> None:
            allowed.append(1)
            torch.cuda.set_sync_debug_mode(0)
            try:
                original(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode("error")
        monkeypatch.setattr(step_read, "drop_unused_grads", drop_unused_grads)
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield allowed
    finally:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.parametrize("optimizer", ["AdamW", "Adafactor"])
def test_forward_backward_and_step_make_no_unintended_host_sync(mesh: hsdp.HSDPMesh, optimizer: str,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    dev = _device()
    torch.manual_seed(0)
    # Linear layers and an MSE loss only: no torch kernel of the model itself syncs (an embedding's
    # backward may), so whatever raises is hsdp's. The unused layer makes the step's flags matter.
    model = _Stack(dim=256, depth=3)
    model.unused = nn.Linear(256, 3)
    sharded = hsdp.ShardedModel(model, mesh=mesh)
    opt = hsdp.ShardedOptimizer(sharded, getattr(torch.optim, optimizer)(sharded.parameters(), lr=1e-2))
    g = torch.Generator(device=dev).manual_seed(0)
    batches = [(torch.randn(32, 256, device=dev, generator=g), torch.randn(32, 256, device=dev, generator=g))
               for _ in range(3)]

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = nn.functional.mse_loss(sharded(x), y)
        loss.backward()
        hsdp.clip_grad_norm_(sharded, 1.0)  # "warn": its non-finite check rides on the step's one read
        opt.step()
        # The flags were read (by the optimizer step's pre-hook): no rank used this layer (a Python check, no sync).
        assert sharded.unused.weight.grad is None and sharded.head.weight.grad is not None
        opt.zero_grad()
        return loss.detach()

    step(*batches[0])  # lazy one-time set-up (optimizer state, library handles) is not a per-step cost
    with _sync_debug_errors(monkeypatch) as allowed:
        losses = [step(x, y) for x, y in batches[1:]]
    assert len(allowed) <= len(losses), allowed  # at most the one intended read per step
    assert all(torch.isfinite(v) for v in losses)


class _Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


# The stress test's size: big enough that kernels outlast their launch, so the host runs ahead of the GPU.
_DIM, _BATCH, _STEPS = 1024, 512, 40


class _Stack(nn.Module):
    def __init__(self, dim: int = _DIM, depth: int = 4) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[_Block(dim) for _ in range(depth)])  # one unit each
        self.head = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))


def test_in_place_optimizer_updates_do_not_race_prefetched_gathers(mesh: hsdp.HSDPMesh) -> None:
    """A plain torch optimizer editing the shards in place (the all-gathers' inputs) while the next forward's
    gathers are prefetched on their own streams: any missing stream ordering shows as drift from the plain
    model, which runs the same arithmetic on one stream."""
    dev = _device()
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 matmuls on both sides (torch's default)
    torch.manual_seed(0)
    model = _Stack(_DIM).to(dev)
    plain = copy.deepcopy(model)
    sharded = hsdp.ShardedModel(model, mesh=mesh, reshard_after_forward=True)
    sharded.set_prefetch(True)
    assert len(sharded.units) >= 5
    opt = hsdp.ShardedOptimizer(sharded, torch.optim.SGD(sharded.parameters(), lr=0.01, momentum=0.9,
                                                         foreach=False))
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.01, momentum=0.9, foreach=False)
    g = torch.Generator(device=dev).manual_seed(1)
    data = [(torch.randn(_BATCH, _DIM, device=dev, generator=g), torch.randn(_BATCH, _DIM, device=dev, generator=g))
            for _ in range(_STEPS)]
    for net, optimizer in ((sharded, opt), (plain, plain_opt)):
        for x, y in data:
            loss = nn.functional.mse_loss(net(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        assert torch.isfinite(loss)
    expected = dict(plain.named_parameters())
    for name, p in sharded.named_parameters():
        torch.testing.assert_close(p.full_tensor(), expected[name].detach(), rtol=1e-5, atol=1e-5, msg=name)


def test_a_meta_built_model_stays_on_meta_until_materialized_on_the_gpu(mesh: hsdp.HSDPMesh) -> None:
    dev = _device()
    with torch.device("meta"):
        model = MetaNet()
    sharded = hsdp.ShardedModel(model, mesh=mesh)
    assert all(u.sharded_flat.is_meta for u in sharded.units if u.params)
    assert all(b.is_meta for b in sharded.buffers())
    hsdp.materialize(sharded)
    assert all(u.sharded_flat.device == dev for u in sharded.units)
    assert {p.device for p in sharded.parameters()} == {dev}
    assert {b.device for b in sharded.buffers()} == {dev}
    x, y = (t.to(dev) for t in batch(0, 0))
    assert torch.isfinite(loss_fn(sharded(x), y))
