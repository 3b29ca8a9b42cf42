"""The save a hand-written loop ends with: ``model.save_pretrained(dir)`` on every rank of a wrapped Hugging Face
model, and of a wrapped PEFT LoRA model, and LoRA training with PEFT on hsdp.

One spawn of 4 gloo ranks (2 x 2 mesh), the tiny tied-embedding LlamaForCausalLM:

* Hugging Face: 2 AdamW steps, then ``model.save_pretrained(dir)`` on every rank (it used to fail on safetensors'
  shared tensors): ``LlamaForCausalLM.from_pretrained(dir)`` equals ``hsdp.full_state_dict`` exactly,
  ``config.json`` names ``LlamaForCausalLM``; ``state_dict=hsdp.full_state_dict(model)`` written by rank 0 alone
  loads the same; ``state_dict=model.state_dict()`` (shards) is refused on every rank, nothing written;
* PEFT: LoRA on q/v of the same model trained 3 AdamW steps on hsdp: every rank's loss equals one plain process
  on the global batch (1e-5), the frozen base is bit-for-bit the initial one; ``model.save_pretrained(dir)`` on
  every rank (it used to fail on "invalid python storage") writes the adapter alone, and
  ``PeftModel.from_pretrained(plain base, dir)`` holds the trained adapter of the plain process (1e-5).
The one-process reference runs in the test process.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from harness import run_distributed
from hf_tiny import max_abs_diff, tiny_llama, token_batches

pytest.importorskip("peft", reason="the peft extra (pip install 'hsdp[peft]'); `make test` installs it")

import hsdp

WORLD, MICRO, HF_STEPS, LORA_STEPS, LR = 4, 2, 2, 3, 1e-2
TOKENS = token_batches(WORLD * MICRO * max(HF_STEPS, LORA_STEPS))


def _lora(model: torch.nn.Module) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"]))


def _batch(step: int, rank: int) -> torch.Tensor:
    start = (step * WORLD + rank) * MICRO
    return TOKENS[start:start + MICRO]


def _train(model: torch.nn.Module, steps: int, rank: int) -> list[float]:
    optimizer = hsdp.ShardedOptimizer(model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                                               lr=LR))
    losses = []
    for step in range(steps):
        batch = _batch(step, rank)
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def _hf_checks(rank: int, mesh: hsdp.HSDPMesh, out: str) -> dict:
    from transformers import LlamaForCausalLM

    model = hsdp.ShardedModel(tiny_llama(), mesh=mesh)
    _train(model, HF_STEPS, rank)
    model.save_pretrained(os.path.join(out, "hf"))  # every rank, as after a hand-written loop
    full = hsdp.full_state_dict(model)
    refused = ""
    try:
        model.save_pretrained(os.path.join(out, "refused"), state_dict=model.state_dict())
    except ValueError as e:
        refused = str(e)
    if rank == 0:  # the explicit pattern: consolidate on every rank, write on rank 0
        model.save_pretrained(os.path.join(out, "hf_rank0"), state_dict=full)
    torch.distributed.barrier()
    if rank != 0:
        return {"refused": refused}
    loaded = {name: LlamaForCausalLM.from_pretrained(os.path.join(out, name)).state_dict()
              for name in ("hf", "hf_rank0")}
    with open(os.path.join(out, "hf", "config.json")) as f:
        architectures = json.load(f)["architectures"]
    return {"refused": refused, "diff": {n: max_abs_diff(sd, full) for n, sd in loaded.items()},
            "architectures": architectures, "refused_dir": os.path.exists(os.path.join(out, "refused"))}


def _peft_checks(rank: int, mesh: hsdp.HSDPMesh, out: str) -> dict:
    from peft import PeftModel
    from safetensors.torch import load_file

    model = hsdp.ShardedModel(_lora(tiny_llama()), mesh=mesh)
    losses = _train(model, LORA_STEPS, rank)
    model.save_pretrained(os.path.join(out, "adapter"))  # every rank
    full = hsdp.full_state_dict(model)
    if rank != 0:
        return {"losses": losses}
    saved = load_file(os.path.join(out, "adapter", "adapter_model.safetensors"))
    loaded = PeftModel.from_pretrained(tiny_llama(), os.path.join(out, "adapter")).state_dict()
    return {"losses": losses, "full": full, "saved_keys": sorted(saved),
            "loaded": {k: v for k, v in loaded.items() if "lora_" in k}}


def _ranks(rank: int, world: int, out: str) -> dict:
    mesh = hsdp.init_mesh(sharding_degree=2)
    return {"hf": _hf_checks(rank, mesh, out), "peft": _peft_checks(rank, mesh, out)}


def _lora_reference() -> tuple[list[list[float]], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One process, the global batch: per step, every rank's slice loss; then the state dict, and the initial one."""
    model = _lora(tiny_llama())
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    losses = []
    for step in range(LORA_STEPS):
        per_rank = [model(input_ids=_batch(step, r), labels=_batch(step, r)).loss for r in range(WORLD)]
        torch.stack(per_rank).mean().backward()  # hsdp's gradient: the average of the ranks' gradients
        optimizer.step()
        optimizer.zero_grad()
        losses.append([float(loss.detach()) for loss in per_rank])
    return losses, model.state_dict(), initial


def test_save_pretrained_and_lora_on_2x2(tmp_path):
    results = run_distributed(_ranks, WORLD, str(tmp_path))
    hf = results[0]["hf"]
    for r in results:
        assert "hsdp.full_state_dict(model)" in r["hf"]["refused"], r["hf"]["refused"]
    assert not hf["refused_dir"]  # refused before writing anything
    assert hf["diff"] == {"hf": 0.0, "hf_rank0": 0.0}
    assert hf["architectures"] == ["LlamaForCausalLM"]

    ref_losses, ref_state, initial = _lora_reference()
    for rank, r in enumerate(results):
        got = r["peft"]["losses"]
        want = [step[rank] for step in ref_losses]
        assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-5, (rank, got, want)
    peft = results[0]["peft"]
    full = peft["full"]
    base = [k for k in full if "lora_" not in k]
    adapter = [k for k in full if "lora_" in k]
    assert adapter and max_abs_diff({k: full[k] for k in base}, {k: initial[k] for k in base}) == 0.0
    assert max_abs_diff({k: full[k] for k in adapter}, {k: ref_state[k] for k in adapter}) < 1e-5
    assert max(float((initial[k] - ref_state[k]).abs().max()) for k in adapter) > 1e-3  # the adapter did train
    # The file holds the adapter alone; from_pretrained on a plain base gives the trained adapter.
    assert peft["saved_keys"] and all("lora_" in k for k in peft["saved_keys"])
    assert len(peft["saved_keys"]) == len(adapter)
    assert max_abs_diff(peft["loaded"], {k: ref_state[k] for k in peft["loaded"]}) < 1e-5
    assert peft["loaded"].keys() == set(adapter)
