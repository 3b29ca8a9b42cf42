"""``.to(dtype)``, ``.double()``, ``.bfloat16()``, ``.float()``, ``.to(device)`` and ``to_empty`` after wrapping keep
the flat shards, the DTensor parameters, their gradients, the unsharded compute copies and the reductions
consistent: a model moved to float64 after wrapping trains like one plain float64 process."""

from __future__ import annotations

import pytest
import torch
from harness import run_distributed
from models import ParityNet, batch, global_batch, loss_fn
from torch import nn
from torch.distributed.tensor import DTensor

import hsdp

STEPS = 3


def _wrapped(seed: int = 0, **kwargs: object) -> nn.Module:
    torch.manual_seed(seed)
    return hsdp.ShardedModel(ParityNet(), mesh=hsdp.init_mesh(2), **kwargs)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _views_into_flats(model: nn.Module) -> bool:
    """Every sharded parameter's local tensor lies inside its unit's flat buffer, with the buffer's dtype."""
    for unit in model.units:
        flat = unit.sharded_flat
        lo, hi = flat.data_ptr(), flat.data_ptr() + flat.numel() * flat.element_size()
        for p in unit.params:
            local = p.sharded.to_local()
            if p.sharded_local.numel() and not lo <= local.data_ptr() < hi:
                return False
            if local.dtype != flat.dtype or p.sharded.dtype != flat.dtype:
                return False
    return True


def _float64_training(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    ref = ParityNet().double()
    model = _wrapped()
    before = [id(p) for p in model.parameters()]
    model.double()
    state = {
        "same_objects": before == [id(p) for p in model.parameters()],
        "views": _views_into_flats(model),
        "compute_dtypes": {str(p.unsharded.dtype) for p in model.sharded_params()},
        "buffer_dtypes": {str(b.dtype) for b in model.buffers()},
    }
    opt = hsdp.ShardedOptimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(STEPS):
        x, y = global_batch(step, world)
        loss_fn(ref(x), y).backward()
        xb, yb = batch(step, rank)
        loss_fn(model(xb), yb).backward()
        state.setdefault("grad_dtypes", {str(p.grad.dtype) for p in model.parameters() if p.grad is not None})
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    state["diff"] = max((_full(p.detach()) - ref.get_parameter(n).detach()).abs().max().item()
                        for n, p in model.named_parameters())
    state["wire_dtypes_ok"] = all(u.sharded_flat.dtype == torch.float64 for u in model.units if u.params)
    return state


def _low_precision_round_trip(rank: int, world: int) -> dict:
    """bf16 forward equals a plain bf16 forward; grads come back bf16; .float() restores fp32 shards."""
    torch.manual_seed(0)
    ref = ParityNet().bfloat16()
    model = _wrapped().bfloat16()
    x, y = batch(0, rank)
    out = {"forward_diff": (model(x).float() - ref(x).float()).abs().max().item()}
    loss_fn(model(x).float(), y).backward()
    out["grad_dtypes"] = {str(p.grad.dtype) for p in model.parameters() if p.grad is not None}
    model.float()
    out["fp32_after"] = {str(p.dtype) for p in model.parameters()} | {str(p.grad.dtype) for p in model.parameters()
                                                                        if p.grad is not None}
    out["values_kept"] = all(torch.equal(_full(p.detach()), ref.get_parameter(n).detach().float())
                             for n, p in model.named_parameters())
    out["views"] = _views_into_flats(model)
    return out


def _mixed_precision_policy(rank: int, world: int) -> dict:
    """param_dtype and buffer_dtype of MixedPrecision survive a .double() of the master weights."""
    mp = hsdp.MixedPrecision(param_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16)
    model = _wrapped(mixed_precision=mp).double()
    x, y = batch(0, rank)
    loss_fn(model(x).float(), y).backward()
    return {"master": {str(u.sharded_flat.dtype) for u in model.units if u.params},
            "compute": {str(p.compute_dtype) for p in model.sharded_params()},
            "grads": {str(p.grad.dtype) for p in model.parameters() if p.grad is not None},
            "buffers": {str(b.dtype) for b in model.buffers()}}


def _no_ops_and_errors(rank: int, world: int) -> dict:
    model = _wrapped()
    params, flats = list(model.parameters()), [u.sharded_flat for u in model.units]
    model.to("cpu").float().to(torch.float32)
    out = {"no_op_kept": all(a is b for a, b in zip(params, model.parameters(), strict=True))
           and all(a is u.sharded_flat for a, u in zip(flats, model.units, strict=True))}
    errors = {}
    for name, call in {"meta": lambda: model.to("meta"), "shape": lambda: model._apply(lambda t: t[:1])}.items():
        try:
            call()
            errors[name] = "no error"
        except ValueError as e:
            errors[name] = str(e)
    out["errors"] = errors
    out["still_trains"] = torch.isfinite(loss_fn(model(batch(0, rank)[0]), batch(0, rank)[1])).item()
    torch.manual_seed(0)
    inner = hsdp.ShardedModel(ParityNet(), mesh=hsdp.init_mesh(2))
    outer = hsdp.ShardedModel(nn.Sequential(inner, nn.Linear(17, 3)), mesh=inner.mesh)
    try:
        inner.double()
        errors["nested"] = "no error"
    except ValueError as e:
        errors["nested"] = str(e)
    outer.double()
    out["nested_root_ok"] = {str(p.dtype) for p in outer.parameters()} == {"torch.float64"}
    return out


def _all_cases(rank: int, world: int) -> dict:
    return {"f64": _float64_training(rank, world), "low": _low_precision_round_trip(rank, world),
            "mp": _mixed_precision_policy(rank, world), "misc": _no_ops_and_errors(rank, world)}


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_distributed(_all_cases, 4)


def test_double_after_wrapping_trains_like_a_plain_float64_process(results: list[dict]) -> None:
    for r in results:
        f = r["f64"]
        assert f["same_objects"] and f["views"] and f["wire_dtypes_ok"], f
        assert f["compute_dtypes"] == {"torch.float64"} and f["grad_dtypes"] == {"torch.float64"}, f
        assert f["buffer_dtypes"] == {"torch.float64"}, f
        assert f["diff"] < 1e-10, f["diff"]


def test_bfloat16_then_float_round_trip(results: list[dict]) -> None:
    for r in results:
        low = r["low"]
        assert low["forward_diff"] == 0.0, low
        assert low["grad_dtypes"] == {"torch.bfloat16"}, low
        assert low["fp32_after"] == {"torch.float32"} and low["values_kept"] and low["views"], low


def test_mixed_precision_policy_survives_a_dtype_change(results: list[dict]) -> None:
    for r in results:
        mp = r["mp"]
        assert mp["master"] == {"torch.float64"} and mp["compute"] == {"torch.bfloat16"}, mp
        assert mp["grads"] == {"torch.float64"} and mp["buffers"] == {"torch.bfloat16"}, mp


def test_no_op_conversions_keep_everything_and_bad_ones_raise(results: list[dict]) -> None:
    for r in results:
        misc = r["misc"]
        assert misc["no_op_kept"] and misc["still_trains"] and misc["nested_root_ok"], misc
        assert "mesh communicates on cpu" in misc["errors"]["meta"], misc["errors"]
        assert "shape" in misc["errors"]["shape"], misc["errors"]
        assert "outermost ShardedModel" in misc["errors"]["nested"], misc["errors"]
