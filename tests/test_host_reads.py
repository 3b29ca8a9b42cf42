"""At most one host read per training step: forward, backward, clipping (hsdp's or torch's) and
``optimizer.step()`` (AdamW, hsdp's Adafactor) on a 2x2 gloo mesh.

A *host read* is a call that copies a tensor's value to Python or NumPy: ``Tensor.item``, ``tolist``,
``numpy``, ``__array__``, ``__bool__``, ``__float__``, ``__int__``, ``__index__`` and ``__complex__``. On
CUDA each one waits for the device (a sync that stops the host's run-ahead); counting them on CPU, where
they cost nothing, is how the CUDA path is kept free of them without a GPU. Excepted: reads of an
optimizer's ``step`` counters, which torch keeps on the CPU (``capturable=False``) so their reads never
wait for the device. ``.cpu()`` / ``.to("cpu")`` copies are not counted: nothing in a step calls them.

The count is over the second step (the first builds optimizer state). The one read allowed is the
backward's "has gradient" flags (``drop_unused_grads``), made only where some parameter had no gradient
on this rank (DDP's ``grad = None`` for unused parameters then needs the host to know whether another rank
used it), else ``hsdp.clip_grad_norm_``'s deferred norm check just before the optimizer step. All cases
run in one spawn.
"""

from __future__ import annotations

import contextlib
import traceback
import warnings
from collections.abc import Callable, Iterator

import torch
from harness import run_distributed
from torch import nn

import hsdp

READS = ("item", "tolist", "numpy", "__array__", "__bool__", "__float__", "__int__", "__index__", "__complex__")


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(16, 16) for _ in range(2)])
        self.head = nn.Linear(16, 4)
        self.scale = nn.Parameter(torch.tensor(1.5))  # 0-d: replicated

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x) * self.scale


@contextlib.contextmanager
def _counting(excepted: Callable[[], set[int]]) -> Iterator[list[str]]:
    """Patch every read method of ``torch.Tensor``; yield the list of the reads' call sites (a counted read
    inside another, e.g. ``__float__`` calling ``item``, counts once)."""
    sites: list[str] = []
    depth = [0]
    originals = {name: getattr(torch.Tensor, name) for name in READS}

    def wrap(name: str, original: Callable) -> Callable:
        def read(self: torch.Tensor, *args, **kwargs):
            if depth[0] == 0 and id(self) not in excepted():
                frame = traceback.extract_stack(limit=2)[0]
                sites.append(f"{name} at {frame.filename.rsplit('/', 1)[-1]}:{frame.lineno} ({frame.name})")
            depth[0] += 1
            try:
                return original(self, *args, **kwargs)
            finally:
                depth[0] -= 1
        return read

    for name, original in originals.items():
        setattr(torch.Tensor, name, wrap(name, original))
    try:
        yield sites
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def _step_counters(opt: torch.optim.Optimizer) -> set[int]:
    return {id(s["step"]) for s in opt.state.values() if isinstance(s.get("step"), torch.Tensor)}


def _count(rank: int, optimizer: str, clip: str) -> list[str]:
    """The host reads of this rank's second training step."""
    torch.manual_seed(0)
    model = hsdp.ShardedModel(Net(), mesh=hsdp.init_mesh(2))
    inner = (torch.optim.AdamW(model.parameters(), lr=1e-2) if optimizer == "AdamW"
             else torch.optim.Adafactor(model.parameters(), lr=1e-2))
    opt = hsdp.ShardedOptimizer(model, inner)
    clips = {"hsdp": lambda: hsdp.clip_grad_norm_(model, 0.5),
             "torch": lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5), "none": lambda: None}
    counted: list[str] = []
    for step in range(2):
        g = torch.Generator().manual_seed(10 * step + rank)
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        with _counting(lambda: _step_counters(inner)) if step == 1 else contextlib.nullcontext([]) as sites:
            counted = sites
            nn.functional.mse_loss(model(x), y).backward()
            clips[clip]()
            opt.step()
            opt.zero_grad()
    return counted


CASES = [("AdamW", "hsdp"), ("AdamW", "torch"), ("Adafactor", "none"), ("Adafactor", "hsdp")]


def _deferred_warning(rank: int) -> dict[str, object]:
    """hsdp.clip_grad_norm_ with a NaN gradient (default ``"warn"``): nothing scaled, no warning in the call,
    the warning when the optimizer steps (every parameter had a gradient: the backward read nothing, the
    norm is read just before the step)."""
    torch.manual_seed(0)
    model = hsdp.ShardedModel(Net(), mesh=hsdp.init_mesh(2))
    opt = hsdp.ShardedOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.0))
    x = torch.randn(8, 16)
    model(x).sum().backward()
    model.head.weight.grad.to_local().fill_(float("nan"))  # on every rank: as after a sync
    before = [p.grad.to_local().clone() for p in model.parameters()]
    with warnings.catch_warnings(record=True) as in_call:
        warnings.simplefilter("always")
        norm = hsdp.clip_grad_norm_(model, 1e-3)
    unscaled = all(torch.equal(b, p.grad.to_local()) or b.isnan().all().item()
                   for b, p in zip(before, model.parameters(), strict=True))
    with warnings.catch_warnings(record=True) as later:
        warnings.simplefilter("always")
        opt.step()
    return {"nan": torch.isnan(norm).item(), "unscaled": unscaled, "in_call": [str(w.message) for w in in_call],
            "later": [str(w.message) for w in later if issubclass(w.category, RuntimeWarning)]}


def _all(rank: int, world: int) -> dict[str, object]:
    return {"reads": {f"{o} + {c} clip": _count(rank, o, c) for o, c in CASES}, "warn": _deferred_warning(rank)}


def test_at_most_one_host_read_per_step_and_the_clip_warning_comes_at_the_optimizer_step() -> None:
    results = run_distributed(_all, 4)
    over = {f"rank {r}, {case}": sites for r, res in enumerate(results) for case, sites in res["reads"].items()
            if len(sites) > 1}
    assert not over, "more than one host read in a step:\n" + "\n".join(
        f"{where}: {len(sites)}: {sites}" for where, sites in over.items())
    for res in results:
        # Every parameter had a gradient on every rank: the flags need no read; without clipping, nothing is read.
        assert res["reads"]["Adafactor + none clip"] == [], res["reads"]
        warn = res["warn"]
        assert warn["nan"] and warn["unscaled"] and warn["in_call"] == [], warn
        assert len(warn["later"]) == 1 and "gradient norm of the last hsdp.clip_grad_norm_ was nan" in warn["later"][0]
