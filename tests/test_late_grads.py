"""Late gradients (``hsdp/engine/runtime/late_grads.py``) on a 2x2 gloo mesh: the backward returns with its last
inter-node hops in flight and ``ShardedOptimizer.step`` lands them unit by unit, stepping each unit as it lands.

Whatever a training loop does between ``backward()`` and ``step()`` must see what it would see on a plain model:
every case trains a model whose parameters are all used (so the hops are left in flight) for three steps beside
one process training the same model on the global batch, and compares the gradients read in between and the
parameters after (accumulation over two backwards, synced or with the first micro-batch's hop deferred,
included). Torch's step hooks run once per step. The step as the gradients land is bit for bit the step after
landing them all, also with the bf16 and int8 hops, where only some ranks leave their hops in flight, and on
replicas of different shard degrees (a second spawn of 3 ranks). The other cases run in one spawn.
"""

from __future__ import annotations

import torch
from harness import run_distributed
from models import DIM, VOCAB, Block, batch, loss_fn
from torch import nn

import hsdp
from hsdp.engine.hops import AllReduceHop, Int8ErrorFeedbackHop

STEPS, LR, SEED = 3, 1e-2, 11


class LateNet(nn.Module):
    """Every parameter used on every rank (unless ``rare_on`` names the rank), each block its own unit."""

    def __init__(self, rare_on: int | None = None) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([Block() for _ in range(3)])
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)
        self.rare = nn.Linear(DIM, DIM)
        self.rare_on = rare_on  # the one rank whose forward uses ``rare`` (None: every rank)

    def forward(self, ids: torch.Tensor, rank: int | None = None) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        if self.rare_on is None or rank == self.rare_on:
            x = x + self.rare(x)
        return self.head(self.norm(x))


def _sharded(rank: int, hop: object = None, rare_on: int | None = None,
             degrees: int | list[int] = 2) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(SEED)
    model = hsdp.ShardedModel(LateNet(rare_on), mesh=hsdp.init_mesh(degrees), wrap=Block, replica_hop=hop)
    return model, hsdp.ShardedOptimizer(model, torch.optim.AdamW(model.parameters(), lr=LR))


def _global(step: int, part: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    xs, ys = zip(*(batch(2 * step + part, r, per_rank=2) for r in range(world)))
    return torch.cat(xs), torch.cat(ys)


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.full_tensor() for k, v in model.state_dict().items()}


def _full_grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.full_tensor() for n, p in model.named_parameters()}


def _case(rank: int, world: int, between: str) -> dict:
    """Train 3 steps doing ``between`` after each backward; the largest distances to the plain model."""
    model, opt = _sharded(rank)
    torch.manual_seed(SEED)
    plain = LateNet()
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=LR)
    hooks: list[str] = []
    opt.register_step_pre_hook(lambda *_: hooks.append("pre"))
    opt.register_step_post_hook(lambda *_: hooks.append("post"))
    late, grad_err = [], 0.0
    for step in range(STEPS):
        parts = 2 if between in ("accumulate", "deferred sync") else 1
        for part in range(parts):
            x, y = batch(2 * step + part, rank, per_rank=2)
            if between == "deferred sync":  # the first micro-batch crosses no node: its backward has no hop
                model.set_requires_all_reduce(part == parts - 1)
            (loss_fn(model(x), y) / parts).backward()
            if part == parts - 1 or between != "deferred sync":
                late.append(model._hsdp_state.step.late is not None)
            if between == "zero_grad" and part == 0:
                opt.zero_grad()  # lands the hops and drops them: only the second backward counts
                x, y = batch(2 * step + 1, rank, per_rank=2)
                loss_fn(model(x), y).backward()
            gx, gy = _global(step, 1 if between == "zero_grad" else part, world)
            (loss_fn(plain(gx), gy) / parts).backward()
        if between == "read":
            mine, ref = _full_grads(model), {n: p.grad for n, p in plain.named_parameters()}
            grad_err = max(grad_err, max((mine[n] - ref[n]).abs().max().item() for n in ref))
        elif between in ("clip", "hsdp clip"):
            if between == "clip":
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            else:
                hsdp.clip_grad_norm_(model, 0.05)
            torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.05)
        elif between == "eval":
            with torch.no_grad():
                model(batch(99, rank)[0])
        opt.step()
        opt.zero_grad()
        plain_opt.step()
        plain_opt.zero_grad()
    mine, ref = _full(model), plain.state_dict()
    return {"late": late, "hooks": hooks, "grad_err": grad_err,
            "param_err": max((mine[k] - v).abs().max().item() for k, v in ref.items())}


def _stepped(rank: int, hop: object, rare_on: int | None, land_first: bool,
             degrees: int | list[int] = 2) -> tuple[dict[str, torch.Tensor], bool]:
    """Three steps; ``land_first``: read a gradient right after backward, which lands them all before the step.
    The parameters after, and whether the hops were left in flight at every backward."""
    model, opt = _sharded(rank, hop, rare_on, degrees)
    late = True
    for step in range(STEPS):
        x, y = batch(step, rank, per_rank=2)
        loss_fn(model(x, rank), y).backward()
        late &= model._hsdp_state.step.late is not None
        if land_first:
            assert next(model.parameters()).grad is not None
            assert model._hsdp_state.step.idle
        opt.step()
        opt.zero_grad()
    return _full(model), late


def _bitwise(rank: int) -> dict[str, tuple[bool, bool]]:
    """Per hop: (late at every backward, the step as they land equal to the step after landing them all)."""
    hops = {"fp32": lambda: None, "bf16": lambda: AllReduceHop(torch.bfloat16), "int8": Int8ErrorFeedbackHop}
    runs = {name: (hop, None) for name, hop in hops.items()} | {"rank 0 alone late": (hops["fp32"], 0)}
    out = {}
    for name, (hop, rare_on) in runs.items():
        (a, late), (b, _) = _stepped(rank, hop(), rare_on, False), _stepped(rank, hop(), rare_on, True)
        out[name] = (late, all(torch.equal(a[k], b[k]) for k in a))
    return out


def _hetero(rank: int, world: int) -> tuple[bool, bool]:
    """Replicas of 2 and 1 ranks (the hop piece by piece): late at every backward, and equal to landing first."""
    (a, late), (b, _) = _stepped(rank, None, None, False, [2, 1]), _stepped(rank, None, None, True, [2, 1])
    return late, all(torch.equal(a[k], b[k]) for k in a)


def _worker(rank: int, world: int) -> dict:
    between = ("step", "read", "clip", "hsdp clip", "accumulate", "deferred sync", "zero_grad", "eval")
    cases = {c: _case(rank, world, c) for c in between}
    return {"cases": cases, "bitwise": _bitwise(rank)}


def test_late_gradients_give_a_plain_models_gradients_and_steps_whatever_the_loop_does_in_between() -> None:
    results = run_distributed(_worker, 4)
    for rank, result in enumerate(results):
        for name, case in result["cases"].items():
            assert all(case["late"]), (rank, name, case["late"])  # the hops were left in flight every time
            assert case["param_err"] < 1e-5, (rank, name, case["param_err"])
            assert case["hooks"] == ["pre", "post"] * STEPS, (rank, name, case["hooks"])
        assert result["cases"]["read"]["grad_err"] < 1e-6, (rank, result["cases"]["read"]["grad_err"])
        bitwise = result["bitwise"]
        assert all(equal for _, equal in bitwise.values()), (rank, bitwise)
        # Every parameter had a gradient on rank 0 only: it alone left its hops in flight.
        assert all(late for name, (late, _) in bitwise.items() if name != "rank 0 alone late"), (rank, bitwise)
        assert bitwise["rank 0 alone late"][0] == (rank == 0), (rank, bitwise)


def test_late_gradients_on_replicas_of_different_degrees_step_as_landing_them_first_does() -> None:
    assert run_distributed(_hetero, 3) == [(True, True)] * 3
