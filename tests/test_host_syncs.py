"""No host reads of tensors in forward and backward but one (the step's "has gradient" flags, read once after
every reduction): on a GPU each would stall the CPU's run-ahead of the device. Counted on CPU by patching the
ways a tensor's value reaches Python; parameters unused on every rank still end with ``grad = None``."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from harness import run_distributed
from models import ParityNet, batch, loss_fn

import hsdp

_READS = ("item", "tolist", "cpu", "__bool__", "numpy")


@contextlib.contextmanager
def _count_host_reads(counter: list[str]) -> Iterator[None]:
    originals = {name: getattr(torch.Tensor, name) for name in _READS}

    def counting(name: str) -> Callable[..., object]:
        def read(self: torch.Tensor, *args: object, **kwargs: object) -> object:
            counter.append(name)
            return originals[name](self, *args, **kwargs)
        return read

    for name in _READS:
        setattr(torch.Tensor, name, counting(name))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(torch.Tensor, name, fn)


def _steps(rank: int, world: int) -> dict:
    out = {}
    for sliced in (False, True):
        torch.manual_seed(0)
        model = hsdp.ShardedModel(ParityNet(), mesh=hsdp.init_mesh(1 if sliced else 2),
                                  shard_optimizer_across_replicas=sliced)
        opt = hsdp.ShardedOptimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        counts = []
        for step in range(3):
            x, y = batch(step, rank)
            reads: list[str] = []
            with _count_host_reads(reads):
                loss = loss_fn(model(x), y)
                loss.backward()
            counts.append(reads)
            opt.step()
            opt.zero_grad(set_to_none=step == 0)  # zeroed in place later: unused ones must stay None
        unused = [p.grad for n, p in model.named_parameters() if n.startswith("unused.")]
        out["sliced" if sliced else "plain"] = {"reads": counts, "unused_none": all(g is None for g in unused)}
    return out


def test_forward_and_backward_read_one_tensor_on_the_host() -> None:
    for r in run_distributed(_steps, 2):
        for mode, got in r.items():
            # The one read: the flags of every unit at once, at the end of backward.
            assert all(reads == ["tolist"] for reads in got["reads"]), (mode, got["reads"])
            assert got["unused_none"], mode
