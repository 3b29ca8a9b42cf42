"""Every torch.optim optimizer hsdp accepts trains to one plain process's parameters; the others raise.

Element-wise optimizers step the shards with their own code; Adafactor and Muon get hsdp's sharded step
(hsdp/engine/optim/adafactor.py, hsdp/engine/optim/muon.py). The model has the awkward shapes: 17 rows (uneven
chunks), one row and three rows (empty chunks on 2 and 4 ranks), a 3-D weight, 1-D biases and a 0-d scale.
All cases run in one spawn.
"""

from __future__ import annotations

import copy
import warnings

import torch
from harness import run_distributed
from torch import nn

import hsdp

STEPS, WORLD, HIDDEN = 3, 4, 17
# (class name, kwargs): every torch.optim optimizer hsdp accepts, with options that exercise its state.
ACCEPTED = [
    ("SGD", {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}),
    ("Adam", {"lr": 1e-2, "amsgrad": True}),
    ("AdamW", {"lr": 1e-2, "weight_decay": 0.1}),
    ("AdamW", {"lr": 1e-2, "foreach": True}),
    ("Adamax", {"lr": 1e-2}),
    ("NAdam", {"lr": 1e-2}),
    ("RAdam", {"lr": 1e-2}),
    ("Adagrad", {"lr": 5e-2}),
    ("Adadelta", {"lr": 1.0}),
    ("RMSprop", {"lr": 1e-2, "momentum": 0.5, "centered": True}),
    ("Rprop", {"lr": 1e-2}),
    ("ASGD", {"lr": 1e-2, "t0": 1}),
    ("Adafactor", {"lr": 1e-2}),
    ("Adafactor", {"lr": 1e-2, "weight_decay": 0.1, "maximize": True, "foreach": True}),
]
REJECTED = ["LBFGS", "SparseAdam"]


class OddNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, HIDDEN)                          # 17 rows: chunks 9/8 and 5/5/5/2
        self.row = nn.Parameter(torch.randn(1, HIDDEN) * 0.1)    # 1 row: empty chunks from 2 ranks on
        self.gate = nn.Linear(HIDDEN, 3)                         # 3 rows: an empty chunk on 4 ranks
        self.mix = nn.Parameter(torch.randn(3, HIDDEN, 2) * 0.3)  # 3-D (Adafactor factors the last two dims)
        self.out = nn.Linear(HIDDEN, 5)
        self.scale = nn.Parameter(torch.tensor(1.5))              # 0-d: whole on every rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x)) * (1 + self.row)
        m = torch.einsum("bi,ijk->bj", torch.sigmoid(self.gate(h)), self.mix)
        return self.out(h + m) * self.scale


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 8, generator=g), torch.randn(4, 5, generator=g)


def _global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    xs, ys = zip(*(_batch(step, r) for r in range(WORLD)))
    return torch.cat(xs), torch.cat(ys)


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(model(x), y)


def _optimizers(params: list[nn.Parameter], name: str, kwargs: dict) -> list[torch.optim.Optimizer]:
    if name != "Muon":
        return [getattr(torch.optim, name)(params, **kwargs)]
    # As Muon users do: the matrices to Muon, the rest (biases, the 3-D weight, the scale) to AdamW.
    return [torch.optim.Muon([p for p in params if p.dim() == 2], **kwargs),
            torch.optim.AdamW([p for p in params if p.dim() != 2], lr=1e-2)]


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in b)


def _train(rank: int, degree: int, name: str, kwargs: dict, same_grads: bool = False) -> tuple[float, float]:
    """(max parameter difference to the reference, max change of the reference) after STEPS steps;
    ``same_grads``: the reference steps on hsdp's gradients (gathered), so only the optimizers are compared."""
    torch.manual_seed(0)
    ref = OddNet()
    initial = {k: v.clone() for k, v in ref.state_dict().items()}
    ref_opts = _optimizers(list(ref.parameters()), name, kwargs)
    torch.manual_seed(0)
    model = hsdp.ShardedModel(OddNet(), mesh=hsdp.init_mesh(degree))
    opts = [hsdp.ShardedOptimizer(model, o) for o in _optimizers(list(model.parameters()), name, kwargs)]
    for step in range(STEPS):
        _loss(model, *_batch(step, rank)).backward()
        if same_grads:
            for p, q in zip(model.parameters(), ref.parameters(), strict=True):
                q.grad = p.grad.full_tensor()
        else:
            _loss(ref, *_global_batch(step)).backward()
        for o in opts + ref_opts:
            o.step()
            o.zero_grad()
    full = hsdp.full_state_dict(model)  # on rank 0
    return (_max_diff(full, ref.state_dict()), _max_diff(initial, ref.state_dict())) if full else (0.0, 0.0)


def _adafactor_state_dicts(rank: int, degree: int) -> tuple[float, float]:
    """Adafactor's row/column factors through state dicts: a plain process's (full tensors) loads into hsdp
    and continues as that process does; hsdp's own round-trips into a fresh optimizer. Max differences."""
    torch.manual_seed(0)
    ref = OddNet()
    ref_opt = torch.optim.Adafactor(ref.parameters(), lr=1e-2)
    models, opts = [], []
    for _ in range(2):
        model = hsdp.ShardedModel(OddNet(), mesh=hsdp.init_mesh(degree))
        models.append(model)
        opts.append(hsdp.ShardedOptimizer(model, torch.optim.Adafactor(model.parameters(), lr=1e-2)))
    for step in range(STEPS):
        _loss(ref, *_global_batch(step)).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    names = [n for n, _ in ref.named_parameters()]
    plain = copy.deepcopy(ref_opt.state_dict())  # as saved: torch's state_dict() returns live tensors
    models[0].load_state_dict(ref.state_dict())
    opts[0].load_state_dict({"state": {names[i]: v for i, v in plain["state"].items()},
                             "param_groups": [{**g, "params": [names[i] for i in g["params"]]}
                                              for g in plain["param_groups"]]})
    models[1].load_state_dict(models[0].state_dict())
    opts[1].load_state_dict(copy.deepcopy(opts[0].state_dict()))
    _loss(ref, *_global_batch(STEPS)).backward()
    ref_opt.step()
    for model, opt in zip(models, opts, strict=True):
        _loss(model, *_batch(STEPS, rank)).backward()
        opt.step()
    full = [hsdp.full_state_dict(m) for m in models]
    return (_max_diff(full[0], ref.state_dict()), _max_diff(full[1], full[0])) if full[0] else (0.0, 0.0)


def _adafactor_checkpoint(rank: int, tmp: str) -> float:
    """Adafactor saved by hsdp.save_checkpoint on 2x2 loads on 1x4 (factors of other shapes than the
    parameter, resharded) and the next step equals the uninterrupted run's. Max difference."""
    runs = []
    for degree in (2, 4):
        torch.manual_seed(0)
        model = hsdp.ShardedModel(OddNet(), mesh=hsdp.init_mesh(degree))
        runs.append((model, hsdp.ShardedOptimizer(model, torch.optim.Adafactor(model.parameters(), lr=1e-2))))
    (first, first_opt), (second, second_opt) = runs
    for step in range(STEPS):
        _loss(first, *_batch(step, rank)).backward()
        first_opt.step()
        first_opt.zero_grad()
    hsdp.save_checkpoint(tmp, first, first_opt)
    hsdp.load_checkpoint(tmp, second, second_opt)
    for model, opt in runs:
        _loss(model, *_batch(STEPS, rank)).backward()
        opt.step()
    full = [hsdp.full_state_dict(m) for m, _ in runs]
    return _max_diff(full[0], full[1]) if full[0] else 0.0


def _step_traffic(rank: int) -> dict[str, dict]:
    """comm_stats of one Muon (the matrices) and one Adafactor step on 2x2."""
    out = {}
    for name in ("Muon", "Adafactor"):
        model = hsdp.ShardedModel(OddNet(), mesh=hsdp.init_mesh(2))
        opt = hsdp.ShardedOptimizer(model, _optimizers(list(model.parameters()), name, {})[0])
        _loss(model, *_batch(0, rank)).backward()
        model.reset_comm_stats()
        opt.step()
        out[name] = model.comm_stats()
    return out


def _rejections() -> dict[str, str]:
    out = {}
    for name in REJECTED:
        model = hsdp.ShardedModel(OddNet(), mesh=hsdp.init_mesh(2))
        try:
            hsdp.ShardedOptimizer(model, getattr(torch.optim, name)(model.parameters()))
            out[name] = "accepted"
        except ValueError as e:
            out[name] = str(e)
    # Not wrapped at all: Muon and Adafactor straight on the DTensor parameters are refused at their step.
    model = hsdp.ShardedModel(OddNet(), mesh=hsdp.init_mesh(2))
    for name in ("Muon", "Adafactor"):
        params = [p for p in model.parameters() if p.dim() == 2] if name == "Muon" else model.parameters()
        opt = getattr(torch.optim, name)(params)
        try:
            opt.step()
            out[f"unwrapped {name}"] = "accepted"
        except ValueError as e:
            out[f"unwrapped {name}"] = str(e)
    return out


class SignSGD(torch.optim.Optimizer):
    """A third-party element-wise optimizer."""

    def __init__(self, params, lr: float = 1e-2) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad.sign(), alpha=-group["lr"])


class NormalizedSGD(SignSGD):
    """A third-party optimizer that is not element-wise: it divides by the whole gradient's norm."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad / p.grad.norm().clamp(min=1e-12), alpha=-group["lr"])


def _third_party(rank: int) -> dict[str, list[str]]:
    """Runtime warnings of the first two steps of each third-party optimizer."""
    out = {}
    for cls in (SignSGD, NormalizedSGD):
        model = hsdp.ShardedModel(OddNet(), mesh=hsdp.init_mesh(2))
        opt = hsdp.ShardedOptimizer(model, cls(model.parameters()))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(2):
                _loss(model, *_batch(step, rank)).backward()
                opt.step()
                opt.zero_grad()
        out[cls.__name__] = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    return out


def _all_cases(rank: int, world: int, tmp: str) -> dict:
    errors = {}
    for degree in (2, 4):
        for name, kwargs in ACCEPTED:
            errors[f"{world // degree}x{degree} {name} {kwargs}"] = _train(rank, degree, name, kwargs)
        errors[f"{world // degree}x{degree} Muon (same grads)"] = _train(rank, degree, "Muon", {"lr": 2e-2}, True)
        errors[f"{world // degree}x{degree} Muon nesterov=False (same grads)"] = _train(
            rank, degree, "Muon", {"lr": 2e-2, "nesterov": False, "adjust_lr_fn": "match_rms_adamw"}, True)
    # Sharding degree 1 (plain replication): the sharded steps' one-rank paths.
    errors["4x1 Adafactor"] = _train(rank, 1, "Adafactor", {"lr": 1e-2})
    errors["4x1 Muon (same grads)"] = _train(rank, 1, "Muon", {"lr": 2e-2}, True)
    loaded = {f"{world // d}x{d}": _adafactor_state_dicts(rank, d) for d in (2, 4)}
    return {"errors": errors, "loaded": loaded, "traffic": _step_traffic(rank), "rejected": _rejections(),
            "checkpoint": _adafactor_checkpoint(rank, f"{tmp}/adafactor"),
            "third_party": _third_party(rank)}


def test_optimizers_match_one_process_and_the_rest_raise(tmp_path: object) -> None:
    results = run_distributed(_all_cases, WORLD, str(tmp_path), timeout=300)
    assert results[0]["checkpoint"] < 1e-5, results[0]["checkpoint"]
    errors = results[0]["errors"]
    bad = {k: v for k, (v, _) in errors.items() if not v < 1e-5}
    assert not bad, f"parameters differ from one process beyond 1e-5: {bad}"
    still = {k: moved for k, (_, moved) in errors.items() if not moved > 1e-3}
    assert not still, f"the reference barely trained, the comparison proves little: {still}"
    for mesh, (from_plain, round_trip) in results[0]["loaded"].items():
        assert from_plain < 1e-5 and round_trip < 1e-5, (mesh, from_plain, round_trip)
    for r in results:
        # Shard group only (replicas hold identical gradient shards): Muon two all-to-alls (gather to the
        # owners, scatter back), Adafactor two small all-reduces.
        traffic = r["traffic"]
        assert {op: s["calls"] for op, s in traffic["Muon"]["shard"].items()} == {"all_to_all": 2}, traffic
        assert {op: s["calls"] for op, s in traffic["Adafactor"]["shard"].items()} == {"all_reduce": 2}, traffic
        assert set(traffic["Muon"]) == set(traffic["Adafactor"]) == {"shard"}, traffic
        for name, message in r["rejected"].items():
            if name.startswith("unwrapped"):
                assert "hsdp.ShardedOptimizer(model, optimizer)" in message, (name, message)
                continue
            assert message != "accepted" and name in message and "use " in message, (name, message)
        third = r["third_party"]
        assert third["SignSGD"] == [], third
        assert len(third["NormalizedSGD"]) == 1 and "NormalizedSGD" in third["NormalizedSGD"][0], third
