"""DiLoCo's global copy follows every load of the model made after the optimizer was built.

torch lets the optimizer be built before the weights are loaded (its docs build it first, then
``model.load_state_dict``); so do hsdp's meta-device recipe and a model-only ``hsdp.load_checkpoint``. The global
copy DiLoCo syncs toward must be the loaded weights then, not the weights the optimizer first saw: otherwise the
first sync pulls every replica back toward its initial weights (``(1 - outer_lr) x initial + outer_lr x loaded``
at inner lr 0).

One 4-rank spawn on 2 x 2: for each load path (``load_state_dict``, ``hsdp.load_pretrained``, ``hsdp.materialize``
of a meta-built model, a model-only ``hsdp.load_checkpoint``, a user's own in-place write) and for plain and
Streaming DiLoCo (outer lr 0.7, so a stale copy shows), the optimizer is built first, the weights loaded, then
enough inner steps at lr 0 for every fragment to sync and land: the weights must still be the loaded ones (1e-6).
"""

from __future__ import annotations

import os

import pytest
import torch
from harness import run_distributed
from models import DIM, ParityNet, batch, loss_fn
from safetensors.torch import save_file

import hsdp

PLAIN = hsdp.DiLoCo(every=3, outer_lr=0.7, outer_momentum=0.0)
STREAMING = hsdp.DiLoCo(every=4, outer_lr=0.7, outer_momentum=0.0, fragments=2, delay=1)
LOADS = ("load_state_dict", "load_pretrained", "materialize", "load_checkpoint", "in_place")


def _full(model: hsdp.ShardedModel) -> dict[str, torch.Tensor]:
    return {n: p.detach().full_tensor().clone() for n, p in model.named_parameters()}


def _loaded_weights() -> dict[str, torch.Tensor]:
    """The weights every path loads: another seed's model (far from the seed-0 initial weights)."""
    torch.manual_seed(7)
    return {k: v.clone() for k, v in ParityNet().state_dict().items()}


def _init(module: torch.nn.Module) -> None:
    """``reset_parameters()`` where a module has one; the root's own buffer as ``ParityNet`` creates it."""
    if hasattr(module, "reset_parameters"):
        module.reset_parameters()
    elif isinstance(module, ParityNet):
        module.scale.copy_(torch.linspace(0.5, 1.5, DIM))


def _build(sync: hsdp.DiLoCo, meta: bool) -> tuple[hsdp.ShardedModel, hsdp.ShardedOptimizer]:
    torch.manual_seed(0)
    if meta:
        with torch.device("meta"):
            module = ParityNet()
    else:
        module = ParityNet()
    model = hsdp.ShardedModel(module, mesh=hsdp.init_mesh(2), replica_sync=sync)
    if meta:  # the optimizer needs real shards: the seed-0 init, then the load below replaces them
        hsdp.materialize(model, init=_init)
    return model, hsdp.ShardedOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.0))


def _load(how: str, model: hsdp.ShardedModel, weights: dict[str, torch.Tensor], tmp: str) -> None:
    if how == "load_state_dict":
        model.load_state_dict(weights)
    elif how == "load_pretrained":
        hsdp.load_pretrained(model, os.path.join(tmp, "weights.safetensors"))
    elif how == "materialize":  # re-initialise: seed 7's reset_parameters() gives the loaded weights
        torch.manual_seed(7)
        hsdp.materialize(model, init=_init)
    elif how == "load_checkpoint":
        hsdp.load_checkpoint(os.path.join(tmp, "ckpt"), model)
    else:  # a user's own write into the DTensor parameters
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)


def _worker(rank: int, world: int, tmp: str) -> dict[str, float]:
    weights = _loaded_weights()
    if rank == 0:
        save_file({k: v for k, v in weights.items() if k != "head.weight"}, os.path.join(tmp, "weights.safetensors"))
    torch.manual_seed(7)
    source = hsdp.ShardedModel(ParityNet(), mesh=hsdp.init_mesh(2))
    hsdp.save_checkpoint(os.path.join(tmp, "ckpt"), source)  # barrier: the file above is written too
    errors = {}
    for name, sync in (("plain", PLAIN), ("streaming", STREAMING)):
        for how in LOADS:
            model, opt = _build(sync, meta=how == "materialize")
            _load(how, model, weights, tmp)
            loaded = _full(model)
            for step in range(sync.every + sync.delay):  # every fragment's sync started and landed
                x, y = batch(step, rank)
                loss_fn(model(x), y).backward()
                opt.step()
                opt.zero_grad()
            after = _full(model)
            errors[f"{name}/{how}"] = max((after[k] - loaded[k]).abs().max().item() for k in loaded)
            if how != "in_place":
                errors[f"{name}/{how}/is_seed7"] = max((loaded[k] - weights[k]).abs().max().item() for k in loaded)
    return errors


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, float]]:
    return run_distributed(_worker, 4, str(tmp_path_factory.mktemp("loads")))


@pytest.mark.parametrize("how", LOADS)
@pytest.mark.parametrize("sync", ["plain", "streaming"])
def test_h_inner_steps_at_lr_0_after_a_load_leave_the_loaded_weights(results: list[dict[str, float]], sync: str,
                                                                      how: str) -> None:
    for rank, errors in enumerate(results):
        assert errors.get(f"{sync}/{how}/is_seed7", 0.0) < 1e-6, (rank, errors)  # the load itself worked
        assert errors[f"{sync}/{how}"] < 1e-6, (rank, errors)
