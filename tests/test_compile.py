"""torch.compile on a ShardedModel trains like eager; compiled autograd is refused with the fix.

One spawn, 2 ranks (1x2 mesh), 3 AdamW steps of the small ParityNet each (compilation is slow on 2 cores):
  * per-block compile (``block.compile()``, the fast recipe): no graph break, no warning and no log record
    from Dynamo or hsdp (the hooks run eagerly, outside the graphs);
  * ``torch.compile(model)`` of the whole wrapped model (graph breaks at the hooks are expected);
  * both match one plain eager process on the global batch within 1e-5;
  * a backward under compiled autograd raises a ValueError naming the fix, on every rank, and the same
    model then trains eagerly like a fresh one.
"""

from __future__ import annotations

import logging
import warnings

import torch
from harness import run_distributed
from models import ParityNet, batch, global_batch, loss_fn
from torch import nn

import hsdp

STEPS, LR = 3, 1e-2


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(f"{record.name}: {record.getMessage()[:200]}")


def _train(model: nn.Module, run: nn.Module, rank: int | None, world: int) -> dict[str, torch.Tensor]:
    """``run`` is what is called (the model, or its compiled wrapper); ``rank=None`` trains the global batch."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    if isinstance(model, hsdp.ShardedModel):
        opt = hsdp.ShardedOptimizer(model, opt)
    for step in range(STEPS):
        x, y = global_batch(step, world) if rank is None else batch(step, rank)
        loss_fn(run(x), y).backward()
        opt.step()
        opt.zero_grad()
    return hsdp.full_state_dict(model) if isinstance(model, hsdp.ShardedModel) else model.state_dict()


def _sharded() -> hsdp.ShardedModel:
    torch.manual_seed(0)
    return hsdp.ShardedModel(ParityNet(), mesh=hsdp.init_mesh(2))


def _max_err(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    return max((got[k] - v).abs().max().item() for k, v in ref.items())


def _per_block(rank: int, world: int) -> tuple[dict[str, torch.Tensor], list[str], dict]:
    from torch._dynamo.utils import counters

    handler = _Records()
    loggers = [logging.getLogger(), logging.getLogger("torch"), logging.getLogger("hsdp")]
    for lg in loggers:
        lg.addHandler(handler)
    counters.clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = _sharded()
            for block in model.blocks:
                block.compile()
            full = _train(model, model, rank, world)
    finally:
        for lg in loggers:
            lg.removeHandler(handler)
    # torch's own deprecation notices during compilation are not hsdp's business.
    noise = [f"{w.filename}: {w.message}" for w in caught if not issubclass(w.category, DeprecationWarning)]
    return full, noise + handler.messages, {k: dict(counters[k]) for k in ("graph_break", "stats")}


def _compiled_autograd_refused(model: hsdp.ShardedModel, rank: int) -> str:
    import torch._dynamo

    x, y = batch(0, rank)

    def step() -> torch.Tensor:
        loss = loss_fn(model(x), y)
        loss.backward()
        return loss

    torch._dynamo.config.compiled_autograd = True  # read when torch.compile wraps the function
    try:
        torch.compile(step)()
    except ValueError as e:
        return str(e)
    finally:
        torch._dynamo.config.compiled_autograd = False
    return "not refused"


def _worker(rank: int, world: int) -> dict:
    ref = None
    if rank == 0:
        torch.manual_seed(0)
        plain = ParityNet()
        ref = _train(plain, plain, None, world)
    blocks, noise, counters = _per_block(rank, world)
    model = _sharded()
    whole = _train(model, torch.compile(model), rank, world)
    model = _sharded()
    refused = _compiled_autograd_refused(model, rank)
    after = _train(model, model, rank, world)  # the same model, eager, after the refused backward
    errs = {}
    if ref is not None:
        errs = {"blocks": _max_err(blocks, ref), "whole": _max_err(whole, ref), "after": _max_err(after, ref)}
    return {"errs": errs, "noise": noise, "counters": counters, "refused": refused}


def test_compiled_model_trains_like_eager() -> None:
    results = run_distributed(_worker, 2, timeout=280)
    for rank, r in enumerate(results):
        assert r["noise"] == [], (rank, r["noise"])
        assert r["counters"]["graph_break"] == {}, (rank, r["counters"])
        assert r["counters"]["stats"].get("unique_graphs", 0) >= 1, (rank, r["counters"])  # it did compile
        assert "compiled_autograd = False" in r["refused"], (rank, r["refused"])
    errs = results[0]["errs"]
    assert max(errs.values()) < 1e-5, errs
