"""A model built under ``torch.device("meta")``, wrapped, then ``hsdp.materialize``d equals the same model built
plainly with the same seed (bitwise) and trains like it; FSDP2's recipe (``to_empty`` + your own init on the
DTensor parameters) works too; every misuse fails with a ValueError naming the fix, on every rank."""

from __future__ import annotations

import pytest
import torch
from harness import run_distributed
from meta_models import MetaNet, train_diff
from models import ParityNet, batch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

import hsdp

STEPS = 3


def _meta_wrapped(factory: type = MetaNet, **kwargs: object) -> nn.Module:
    with torch.device("meta"):
        model = factory(**kwargs)
    return hsdp.ShardedModel(model, mesh=hsdp.init_mesh(2))


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _bitwise_equal(model: nn.Module, ref: nn.Module) -> dict[str, bool]:
    out = {name: torch.equal(_full(p.detach()), ref.get_parameter(name).detach())
           for name, p in model.named_parameters()}
    out.update({f"buffer {name}": torch.equal(b, ref.get_buffer(name)) for name, b in model.named_buffers()})
    return out


def _train_diff(model: nn.Module, ref: nn.Module, rank: int, world: int) -> float:
    return train_diff(model, ref, rank, world, STEPS)


def _error(fn: object) -> str:
    try:
        fn()
    except ValueError as e:
        return str(e)
    return "no error"


def _default_init(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    ref = MetaNet()
    model = _meta_wrapped()
    meta_before = all(p.is_meta for p in model.parameters())
    params_before = [id(p) for p in model.parameters()]
    torch.manual_seed(0)
    hsdp.materialize(model)
    on_cpu = all(p.device.type == "cpu" and p.to_local().device.type == "cpu" for p in model.parameters())
    on_cpu = on_cpu and all(b.device.type == "cpu" for b in model.buffers())
    return {"meta_before": meta_before, "on_cpu": on_cpu, "equal": _bitwise_equal(model, ref),
            "same_param_objects": params_before == [id(p) for p in model.parameters()],
            "train_diff": _train_diff(model, ref, rank, world)}


def _custom_init(rank: int, world: int) -> dict[str, bool]:
    def init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        else:
            m.reset_parameters()

    torch.manual_seed(0)
    ref = MetaNet(tie=False)
    torch.manual_seed(1)
    for m in ref.modules():  # what init= promises: every module with tensors of its own, in modules() order
        if list(m.parameters(recurse=False)) or list(m.buffers(recurse=False)):
            init(m)
    model = _meta_wrapped(tie=False)
    torch.manual_seed(1)
    hsdp.materialize(model, init=init)
    return _bitwise_equal(model, ref)


def _fsdp2_recipe(rank: int, world: int) -> dict:
    """meta -> wrap -> to_empty(device=) -> the user's init on the DTensor parameters and buffers."""
    torch.manual_seed(0)
    ref = MetaNet()
    model = _meta_wrapped()
    model.to_empty(device="cpu")
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(distribute_tensor(ref.get_parameter(name).detach(), p.device_mesh, p.placements))
    model.rotary.reset_parameters()
    equal = _bitwise_equal(model, ref)
    torch.manual_seed(5)
    with torch.no_grad():
        for p in _meta_wrapped().to_empty(device="cpu").parameters():
            nn.init.normal_(p)  # runs on each rank's chunk; same seed everywhere -> replicas agree
    return {"equal": equal, "train_diff": _train_diff(model, ref, rank, world)}


def _misuse(rank: int, world: int) -> dict[str, str]:
    torch.manual_seed(rank)
    out = {"rng": _error(lambda: hsdp.materialize(_meta_wrapped()))}
    torch.manual_seed(0)
    out["no_reset"] = _error(lambda: hsdp.materialize(_meta_wrapped(ParityNet)))

    def skips_bias(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight)
        else:
            m.reset_parameters()

    out["unwritten"] = _error(lambda: hsdp.materialize(_meta_wrapped(), init=skips_bias))
    out["forward"] = _error(lambda: _meta_wrapped()(batch(0, rank)[0]))
    with torch.device("meta"):
        half = MetaNet()
    half.norm = nn.LayerNorm(16)
    out["half_meta"] = _error(lambda: hsdp.ShardedModel(half, mesh=hsdp.init_mesh(2)))
    out["not_wrapped"] = _error(lambda: hsdp.materialize(MetaNet()))
    return out


def _all_cases(rank: int, world: int) -> dict:
    return {"default": _default_init(rank, world), "custom": _custom_init(rank, world),
            "fsdp2": _fsdp2_recipe(rank, world), "misuse": _misuse(rank, world)}


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_distributed(_all_cases, 4)


def test_materialize_equals_a_plain_construction_bitwise_and_trains_like_it(results: list[dict]) -> None:
    for r in results:
        d = r["default"]
        assert d["meta_before"] and d["on_cpu"] and d["same_param_objects"]
        assert all(d["equal"].values()), {k: v for k, v in d["equal"].items() if not v}
        assert "buffer rotary.inv_freq" in d["equal"]
        assert d["train_diff"] < 1e-5, d["train_diff"]


def test_materialize_with_init_calls_it_per_module_in_modules_order(results: list[dict]) -> None:
    for r in results:
        assert r["custom"] and all(r["custom"].values()), r["custom"]


def test_to_empty_then_user_init_on_dtensor_parameters_trains_like_plain(results: list[dict]) -> None:
    for r in results:
        assert all(r["fsdp2"]["equal"].values()), r["fsdp2"]["equal"]
        assert r["fsdp2"]["train_diff"] < 1e-5, r["fsdp2"]["train_diff"]


def test_misuse_raises_a_value_error_naming_the_fix_on_every_rank(results: list[dict]) -> None:
    for r in results:
        m = r["misuse"]
        assert "manual_seed" in m["rng"] and "ranks [" in m["rng"], m["rng"]
        assert "buffer scale" in m["no_reset"] and "init=" in m["no_reset"], m["no_reset"]
        assert "blocks.0.up.bias" in m["unwritten"] and "never written" in m["unwritten"], m["unwritten"]
        assert "hsdp.materialize" in m["forward"], m["forward"]
        assert "meta device" in m["half_meta"] and "norm.weight" in m["half_meta"], m["half_meta"]
        assert "wrap the model first" in m["not_wrapped"], m["not_wrapped"]
