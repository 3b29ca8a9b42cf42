"""``hsdp.load_pretrained`` reads a safetensors file or a Hugging Face sharded folder straight into the shards
(replica 0 reads its rows, then broadcasts in the replicate group): the model then equals the plain model
whose weights were saved, bitwise, and trains like it; names map through ``key_map``; a checkpoint that does
not fit raises one ValueError listing every problem, on every rank, before any collective."""

from __future__ import annotations

import json
import os

import pytest
import torch
from harness import run_distributed
from meta_models import MetaNet, train_diff
from models import ParityNet
from safetensors.torch import save_file
from torch import nn
from torch.distributed.tensor import DTensor

import hsdp

STEPS = 3


def _plain_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """State dict with each tied tensor once (safetensors refuses shared memory)."""
    out, seen = {}, set()
    for name, t in model.state_dict().items():
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            out[name] = t.contiguous()
    return out


def _write_checkpoints(folder: str) -> None:
    torch.manual_seed(0)
    weights = _plain_weights(ParityNet())
    save_file({f"model.{k}": v for k, v in weights.items()}, os.path.join(folder, "prefixed.safetensors"))
    hf = os.path.join(folder, "hf")
    os.makedirs(hf)
    names = sorted(weights)
    parts = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in parts.items():
        save_file({k: weights[k] for k in keys}, os.path.join(hf, file))
    index = {"metadata": {}, "weight_map": {k: file for file, keys in parts.items() for k in keys}}
    with open(os.path.join(hf, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f)
    bad = dict(weights, junk=torch.zeros(2))
    del bad["norm.bias"]
    bad["twice.weight"] = torch.zeros(3, 3)
    save_file(bad, os.path.join(folder, "bad.safetensors"))
    torch.manual_seed(0)
    save_file(_plain_weights(MetaNet()), os.path.join(folder, "metanet.safetensors"))


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _bitwise_equal(model: nn.Module, ref: nn.Module) -> bool:
    params = all(torch.equal(_full(p.detach()), ref.get_parameter(n).detach()) for n, p in model.named_parameters())
    return params and all(torch.equal(b, ref.get_buffer(n)) for n, b in model.named_buffers())


def _meta(factory: type) -> nn.Module:
    with torch.device("meta"):
        model = factory()
    return hsdp.ShardedModel(model, mesh=hsdp.init_mesh(2))


def _meta_prefixed_then_train(rank: int, world: int, folder: str) -> dict:
    torch.manual_seed(0)
    ref = ParityNet()
    model = _meta(ParityNet)
    model.reset_comm_stats()
    hsdp.load_pretrained(model, os.path.join(folder, "prefixed.safetensors"), key_map={"model.": ""})
    stats = model.comm_stats()
    shard_bytes = sum(u.sharded_flat.numel() * u.sharded_flat.element_size() for u in model.units)
    out = {"equal": _bitwise_equal(model, ref), "groups": sorted(stats),
           "replicate_broadcast_bytes": stats["replicate"]["broadcast"]["bytes"], "shard_bytes": shard_bytes}
    out["train_diff"] = train_diff(model, ref, rank, world, STEPS)
    return out


def _other_sources(rank: int, world: int, folder: str) -> dict:
    torch.manual_seed(0)
    ref = ParityNet()
    real = hsdp.ShardedModel(ParityNet(), mesh=hsdp.init_mesh(2))  # seed 1's weights, overwritten
    hsdp.load_pretrained(real, os.path.join(folder, "hf"))
    torch.manual_seed(0)
    ref_meta = MetaNet()
    metanet = _meta(MetaNet)
    hsdp.load_pretrained(metanet, os.path.join(folder, "metanet.safetensors"))
    mapped = _meta(ParityNet)
    hsdp.load_pretrained(mapped, os.path.join(folder, "prefixed.safetensors"),
                         key_map=lambda k: k.removeprefix("model."))
    bad = os.path.join(folder, "bad.safetensors")
    return {"hf_folder": _bitwise_equal(real, ref), "rebuilt_rotary": _bitwise_equal(metanet, ref_meta),
            "callable_map": _bitwise_equal(mapped, ref),
            "error": _error(lambda: hsdp.load_pretrained(_meta(ParityNet), bad)),
            "error_junk_dropped": _error(lambda: hsdp.load_pretrained(
                _meta(ParityNet), bad, key_map=lambda k: None if k == "junk" else k))}


def _error(fn: object) -> str:
    try:
        fn()
    except ValueError as e:
        return str(e)
    return "no error"


def _all_cases(rank: int, world: int, folder: str) -> dict:
    return {"meta": _meta_prefixed_then_train(rank, world, folder), **_other_sources(rank, world, folder)}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    folder = str(tmp_path_factory.mktemp("pretrained"))
    _write_checkpoints(folder)
    return run_distributed(_all_cases, 4, folder)


def test_meta_model_loads_prefixed_file_bitwise_and_trains_like_plain(results: list[dict]) -> None:
    for r in results:
        m = r["meta"]
        assert m["equal"], m
        assert m["groups"] == ["replicate"], m  # nothing in the shard or world groups: replica 0 reads rows
        assert m["shard_bytes"] <= m["replicate_broadcast_bytes"] < m["shard_bytes"] + 1024, m
        assert m["train_diff"] < 1e-5, m["train_diff"]


def test_hf_folder_callable_key_map_and_rebuilt_meta_buffers(results: list[dict]) -> None:
    for r in results:
        assert r["hf_folder"] and r["callable_map"], r
        assert r["rebuilt_rotary"], r  # inv_freq is not in the file: Rotary.reset_parameters re-created it


def test_a_checkpoint_that_does_not_fit_lists_every_problem_on_every_rank(results: list[dict]) -> None:
    for r in results:
        e = r["error"]
        assert "missing (1): norm.bias" in e and "unexpected (1): junk" in e, e
        assert "twice.weight: checkpoint (3, 3), model (16, 16)" in e and "key_map=" in e, e
        assert "unexpected" not in r["error_junk_dropped"] and "norm.bias" in r["error_junk_dropped"], r
