"""The side streams on one GPU: real NCCL hops issued from the hop stream, delays that would expose a missing
wait, and torch's CUDA sanitizer (skipped without CUDA and NCCL; run by ``benchmarks/gpu_check.sh``).

One process, one rank, the 1 x 1 NCCL mesh of ``conftest.py``. A 1-rank group's collective is skipped by
``Comm``, which would leave the hop stream idle; :func:`pose_replicas` makes the model's ``Comm`` count its
replicate group as 2 ranks, so every unit's inter-node hop is a real NCCL all-reduce issued from the hop
stream. An average over the one real rank leaves the values as they are, so the model must still train
exactly as the plain one. Only ``"replicate"`` is posed: its all-reduce takes any tensor, while the
``"shard"`` size also shapes every unit's buffers (``ShardUnit.sharding_degree``), which must match the real
group's single rank for NCCL's reduce-scatter and all-gather to be well-formed.

* parity: fp32 hops, a bf16 wire (``AllReduceHop(torch.bfloat16)``: the gradient is rounded to bf16 once,
  which the plain model is given too), and gradient accumulation (``no_sync`` micro-batches, fp32 partial sums
  on the hop stream, one hop per unit and step), against the plain model over three AdamW steps;
* race amplification: a ``torch.cuda._sleep`` enqueued on each side stream as work enters it, and on the
  waiting stream after each cross-stream wait, so every stream runs late against the others in turn; three
  AdamW steps must stay bitwise equal to the same steps without the delays (the premise, two undelayed runs
  bitwise equal, is checked too);
* the sanitizer: ``tests/programs/sanitized_step.py`` in a subprocess under ``TORCH_CUDA_SANITIZER=1``
  (it must report no data race and exit 0).
"""

from __future__ import annotations

import contextlib
import copy
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import hsdp
from hsdp.engine.runtime.streams import Streams

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available() or not dist.is_nccl_available(),
                       reason="needs a CUDA device and NCCL"),
]

ROOT = Path(__file__).resolve().parents[1]
SANITIZED = ROOT / "tests" / "programs" / "sanitized_step.py"
CSAN_RACE = "CSAN detected a possible data race"  # torch/cuda/_sanitizer.py, UnsynchronizedAccessError
STEPS = 3


class _Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, 2 * dim + 1)
        self.down = nn.Linear(2 * dim + 1, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(x)))


class _Stack(nn.Module):
    """Linear layers, GELU, an MSE loss: deterministic kernels only, one unit per block."""

    def __init__(self, dim: int, depth: int) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[_Block(dim) for _ in range(depth)])
        self.head = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))


def pose_replicas(model: hsdp.ShardedModel, n: int = 2) -> None:
    """Make ``model``'s ``Comm`` count the 1-rank replicate group as ``n`` ranks (see the module docstring)."""
    comm = model.comm
    comm._sizes["replicate"] = n
    assert comm.size("replicate") == n and all(u.comm is comm for u in model.units)


def _hop_calls(model: hsdp.ShardedModel) -> int:
    # Read from the counters, not comm_stats(): that resolves CUDA timings (a synchronize).
    return model.comm.stats.calls("replicate", "all_reduce")


def _reduced_units(model: hsdp.ShardedModel) -> int:
    return sum(1 for u in model.units if any(p.requires_grad for p in u.params))


def _data(dev: torch.device, n: int, dim: int, rows: int = 64) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator(device=dev).manual_seed(1)
    return [(torch.randn(rows, dim, device=dev, generator=g), torch.randn(rows, dim, device=dev, generator=g))
            for _ in range(n)]


@pytest.fixture(autouse=True)
def _fp32_matmuls() -> Iterator[None]:
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 on both sides of every comparison (torch's default)
    yield
    torch.backends.cuda.matmul.allow_tf32 = previous


# ---------------------------------------------------------------------------------------------------------
# Real NCCL hops from the hop stream: parity with the plain model.
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("wire", "micro_batches"), [(None, 1), (torch.bfloat16, 1), (None, 3), (torch.bfloat16, 2)],
                         ids=["fp32", "bf16-wire", "accumulation", "accumulation-bf16-wire"])
def test_hops_issued_as_real_nccl_all_reduces_train_like_the_plain_model(
        nccl_mesh: hsdp.HSDPMesh, wire: torch.dtype | None, micro_batches: int) -> None:
    dev = nccl_mesh.device
    torch.manual_seed(0)
    model = _Stack(dim=256, depth=3)
    plain = copy.deepcopy(model).to(dev)
    sharded = hsdp.ShardedModel(model, mesh=nccl_mesh, replica_hop=hsdp.AllReduceHop(wire))
    pose_replicas(sharded)
    opt = hsdp.ShardedOptimizer(sharded, torch.optim.AdamW(sharded.parameters(), lr=1e-2))
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    data = _data(dev, STEPS * micro_batches, 256)
    for step in range(STEPS):
        for m in range(micro_batches):
            x, y = data[step * micro_batches + m]
            with sharded.no_sync() if m < micro_batches - 1 else contextlib.nullcontext():
                loss = nn.functional.mse_loss(sharded(x), y)
                loss.backward()
            plain_loss = nn.functional.mse_loss(plain(x), y)
            plain_loss.backward()
            torch.testing.assert_close(loss, plain_loss, rtol=1e-5, atol=1e-6, msg=f"step {step}.{m}")
        # One hop per unit and step, whatever the micro-batch count: the partial sums stay on this rank.
        assert _hop_calls(sharded) == _reduced_units(sharded) * (step + 1), (step, _hop_calls(sharded))
        _check_grads(sharded, plain, wire, step)
        opt.step()
        plain_opt.step()
        opt.zero_grad()
        plain_opt.zero_grad()
    expected = dict(plain.named_parameters())
    for name, p in sharded.named_parameters():
        torch.testing.assert_close(p.full_tensor(), expected[name].detach(), rtol=1e-5, atol=1e-6, msg=name)


def _check_grads(sharded: hsdp.ShardedModel, plain: nn.Module, wire: torch.dtype | None, step: int) -> None:
    """The reduced gradients against the plain model's; with a low-precision wire, the plain gradients are
    rounded as the wire rounds them (once, the micro-batches' sum), so both optimizers then see the same."""
    expected = dict(plain.named_parameters())
    for name, p in sharded.named_parameters():
        g, ref = p.grad.full_tensor(), expected[name].grad
        if wire is not None:
            assert torch.equal(g, g.to(wire).to(g.dtype)), f"{name}: not rounded to {wire} (was the wire used?)"
            # One ulp of the wire dtype apart at most: the fp32 sums may differ in their last bit.
            torch.testing.assert_close(g, ref.to(wire).to(ref.dtype), rtol=2 * torch.finfo(wire).eps, atol=1e-7,
                                       msg=f"step {step}: {name}")
            with torch.no_grad():
                ref.copy_(g)  # the plain model steps on the wire's gradient too
        else:
            torch.testing.assert_close(g, ref, rtol=1e-5, atol=1e-7, msg=f"step {step}: {name}")


# ---------------------------------------------------------------------------------------------------------
# Race amplification.
# ---------------------------------------------------------------------------------------------------------
def _cycles_per_ms() -> int:
    """How many ``torch.cuda._sleep`` cycles make a millisecond on this GPU (measured once with events)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000)  # warm-up
    start.record()
    torch.cuda._sleep(20_000_000)
    end.record()
    end.synchronize()
    return max(1, int(20_000_000 / max(start.elapsed_time(end), 1e-3)))


@contextlib.contextmanager
def _delayed_streams(cycles: int) -> Iterator[list[int]]:
    """Enqueue a ``cycles`` sleep on a side stream each time work enters it (after it was ordered behind the
    compute stream, when it is), and on the current stream right after each wait for a side stream's event.
    Yields a one-element list counting the sleeps."""
    count = [0]
    original_on, original_wait = Streams.on, Streams.wait

    @contextlib.contextmanager
    def on(self: Streams, *args: object, **kwargs: object) -> Iterator[None]:
        with original_on(self, *args, **kwargs):
            if self.enabled:
                torch.cuda._sleep(cycles)
                count[0] += 1
            yield

    def wait(self: Streams, *args: object, **kwargs: object) -> None:
        original_wait(self, *args, **kwargs)
        event = args[0] if args else kwargs.get("event")
        if self.enabled and event is not None:
            torch.cuda._sleep(cycles)
            count[0] += 1

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Streams, "on", on)
        mp.setattr(Streams, "wait", wait)
        yield count


@dataclass
class _Run:
    losses: list[torch.Tensor] = field(default_factory=list)
    params: dict[str, torch.Tensor] = field(default_factory=dict)
    grads: dict[str, torch.Tensor] = field(default_factory=dict)  # of the last step, before it
    sleeps: int = 0


RACE_CASES = {
    "fp32": {"micro_batches": 1},
    "accumulation": {"micro_batches": 2},
    "mixed-bf16-wire-accumulation-prefetch-2": {
        "micro_batches": 2, "prefetch": 2, "replica_hop": hsdp.AllReduceHop(torch.bfloat16),
        "mixed_precision": hsdp.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)},
}


def _train(mesh: hsdp.HSDPMesh, case: dict, cycles: int) -> _Run:
    dev = mesh.device
    torch.manual_seed(0)
    options = {k: v for k, v in case.items() if k in ("replica_hop", "mixed_precision")}
    sharded = hsdp.ShardedModel(_Stack(dim=512, depth=4), mesh=mesh, **options)
    pose_replicas(sharded)
    sharded.set_prefetch(case.get("prefetch", 1))
    opt = hsdp.ShardedOptimizer(sharded, torch.optim.AdamW(sharded.parameters(), lr=1e-2))
    micro = case["micro_batches"]
    data = _data(dev, STEPS * micro, 512, rows=256)
    run = _Run()
    torch.cuda.synchronize(dev)
    with _delayed_streams(cycles) if cycles else contextlib.nullcontext([0]) as sleeps:
        for step in range(STEPS):
            for m in range(micro):
                x, y = data[step * micro + m]
                with sharded.no_sync() if m < micro - 1 else contextlib.nullcontext():
                    loss = nn.functional.mse_loss(sharded(x), y)
                    loss.backward()
                run.losses.append(loss.detach().clone())
            if step == STEPS - 1:
                run.grads = {n: p.grad.to_local().clone() for n, p in sharded.named_parameters()}
            opt.step()
            opt.zero_grad()
    torch.cuda.synchronize(dev)
    run.sleeps = sleeps[0]
    run.params = {n: p.to_local().detach().clone() for n, p in sharded.named_parameters()}
    return run


def _bitwise_differences(a: _Run, b: _Run) -> list[str]:
    out = [f"loss {i}: {x.item()} vs {y.item()}" for i, (x, y) in enumerate(zip(a.losses, b.losses, strict=True))
           if not torch.equal(x, y)]
    for kind in ("grads", "params"):
        mine, theirs = getattr(a, kind), getattr(b, kind)
        out += [f"{kind} {n}: max |diff| {(mine[n].float() - theirs[n].float()).abs().max().item():.3e}"
                for n in mine if not torch.equal(mine[n], theirs[n])]
    return out


@pytest.mark.parametrize("case", list(RACE_CASES), ids=list(RACE_CASES))
def test_delaying_each_stream_in_turn_changes_no_bit(nccl_mesh: hsdp.HSDPMesh, case: str) -> None:
    cycles = 2 * _cycles_per_ms()  # about 2 ms a sleep: far longer than any kernel of this model
    first = _train(nccl_mesh, RACE_CASES[case], 0)
    again = _train(nccl_mesh, RACE_CASES[case], 0)
    premise = _bitwise_differences(first, again)
    assert not premise, f"two undelayed runs differ, so bitwise comparison means nothing here: {premise[:8]}"
    delayed = _train(nccl_mesh, RACE_CASES[case], cycles)
    # Every unit's gathers, reduce-scatter and hop, and the waits for them, were delayed in every step.
    assert delayed.sleeps >= 3 * STEPS * RACE_CASES[case]["micro_batches"], delayed.sleeps
    differences = _bitwise_differences(first, delayed)
    assert not differences, f"delayed streams changed the result ({delayed.sleeps} sleeps): {differences[:12]}"


# ---------------------------------------------------------------------------------------------------------
# The CUDA sanitizer.
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("config", ["fp32", "mixed-bf16-wire-accumulation"])
def test_the_cuda_sanitizer_finds_no_race_in_two_steps(tmp_path: Path, config: str) -> None:
    env = {**os.environ, "TORCH_CUDA_SANITIZER": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    env["LOCAL_RANK"] = "0"
    proc = subprocess.run([sys.executable, "-W", "ignore", str(SANITIZED), "--store", str(tmp_path / "store"),
                           "--config", config], capture_output=True, text=True, timeout=60, env=env, cwd=ROOT)
    output = proc.stdout + proc.stderr
    assert CSAN_RACE not in output, output[-12000:]
    assert proc.returncode == 0, f"exit {proc.returncode}\n{output[-12000:]}"
    assert "SANITIZED_STEPS_OK" in proc.stdout, output[-4000:]
