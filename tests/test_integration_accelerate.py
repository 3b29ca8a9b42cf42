"""An hsdp model under ``accelerate.Accelerator`` (``hsdp.integrations.accelerate``) trains like the plain model
under accelerate on one process, and ``save_state``/``load_state`` go through hsdp's sharded checkpoints.

One spawn of 4 gloo ranks (2 x 2 mesh), a tiny tied-embedding LlamaForCausalLM, AdamW with clipping, a
scheduler, 2 micro-batches per optimizer step:

* ``prepare`` leaves the model unwrapped (no DDP) and a later ``accelerator.prepare(model)`` returns it as is
  (accelerate's "already prepared" path, which Trainer relies on: this fails if accelerate changes it);
* every micro-batch's loss, every step's gradient norm and the final full parameters equal accelerate running
  the plain model on one process on the global batch (1e-5); clipping is active;
* accumulation maps to ``model.no_sync()``: a micro-batch inside the window reduce-scatters in the node and
  sends nothing across replicas, the last one crosses once;
* ``save_state`` mid-run writes an hsdp checkpoint (no ``model.safetensors``, no ``optimizer.bin``) next to
  accelerate's scheduler and per-rank RNG files; a fresh model with other weights, ``load_state`` and
  ``skip_first_batches`` continue with the straight run's losses and end on its parameters;
* ``save_pretrained`` (every rank) writes a folder ``from_pretrained`` loads equal to ``hsdp.full_state_dict``,
  ``config.json`` naming ``LlamaForCausalLM``, the tied head stored once.
The one-process reference runs in the test process.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from harness import run_distributed
from hf_tiny import max_abs_diff, tiny_llama, token_batches
from torch.utils.data import DataLoader

pytest.importorskip("accelerate", reason="the hf extra (pip install 'hsdp[hf]'); `make test` installs it")

import hsdp

WORLD, MICRO, ACCUM, STEPS, SAVE_AFTER = 4, 2, 2, 4, 2  # ranks, per-rank micro-batch, micro-batches/step, steps
MAX_NORM, LR = 0.5, 1e-3
TOKENS = token_batches(WORLD * MICRO * ACCUM * STEPS)
# No GPUs: accelerate sees the torchrun world only with ACCELERATE_USE_CPU (torchrun sets the rest).
ENV = {"ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1", "LOCAL_WORLD_SIZE": str(WORLD),
       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


def _scheduler(optimizer: torch.optim.Optimizer, processes: int) -> torch.optim.lr_scheduler.LRScheduler:
    # accelerate steps a prepared scheduler once per process per optimizer step: the same LR per step either way.
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.7 ** (s / processes))


def _calls(model: object, group: str, op: str | None = None) -> int:
    if not isinstance(model, hsdp.ShardedModel):
        return 0
    ops = model.comm_stats().get(group, {})
    return sum(int(v["calls"]) for k, v in ops.items() if op is None or k == op)


def _loop(accelerator, model, optimizer, loader, scheduler, save_after: int | None = None,
          save_dir: str | None = None) -> dict:
    """The usual accelerate loop; per micro-batch: global loss, and the replicate / intra-node reduce-scatter
    calls its backward made; per step: the gradient norm."""
    losses, norms, hops, scatters = [], [], [], []
    for i, batch in enumerate(loader):
        with accelerator.accumulate(model):
            before = _calls(model, "replicate"), _calls(model, "shard", "reduce_scatter")
            loss = model(input_ids=batch, labels=batch).loss
            accelerator.backward(loss)
            hops.append(_calls(model, "replicate") - before[0])
            scatters.append(_calls(model, "shard", "reduce_scatter") - before[1])
            if accelerator.sync_gradients:
                norms.append(float(accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        losses.append(float(accelerator.reduce(loss.detach(), "mean")))
        if save_after is not None and i + 1 == save_after:
            accelerator.save_state(save_dir)
    return {"losses": losses, "norms": norms, "hops": hops, "scatters": scatters}


def _reference() -> dict:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    try:
        accelerator = Accelerator(gradient_accumulation_steps=ACCUM)
        model = tiny_llama(0)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        scheduler = _scheduler(optimizer, accelerator.num_processes)
        loader = DataLoader(TOKENS, batch_size=MICRO * WORLD)
        out = _loop(accelerator, *accelerator.prepare(model, optimizer, loader, scheduler))
        out["params"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        return out
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()


def _prepared(mesh: hsdp.HSDPMesh, seed: int) -> tuple:
    from accelerate import Accelerator

    from hsdp.integrations import accelerate as hsdp_accelerate

    accelerator = Accelerator(gradient_accumulation_steps=ACCUM)
    model = hsdp.ShardedModel(tiny_llama(seed), mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    scheduler = _scheduler(optimizer, accelerator.num_processes)
    loader = DataLoader(TOKENS, batch_size=MICRO)
    return accelerator, model, hsdp_accelerate.prepare(accelerator, model, optimizer, loader, scheduler)


def _ranks(rank: int, world: int, tmp: str) -> dict:
    from accelerate.optimizer import AcceleratedOptimizer
    from transformers import LlamaForCausalLM

    from hsdp.integrations import accelerate as hsdp_accelerate

    mesh = hsdp.init_mesh(sharding_degree=2)
    accelerator, model, (prepared, optimizer, loader, scheduler) = _prepared(mesh, seed=0)
    out: dict = {"unwrapped": prepared is model and accelerator.prepare(model) is model,
                 "optimizer": isinstance(optimizer, AcceleratedOptimizer)
                 and isinstance(optimizer.optimizer, hsdp.ShardedOptimizer)}
    ckpt = os.path.join(tmp, "ckpt")
    model.reset_comm_stats()
    out["straight"] = _loop(accelerator, prepared, optimizer, loader, scheduler, SAVE_AFTER * ACCUM, ckpt)
    out["files"] = sorted(os.listdir(ckpt))
    full = hsdp.full_state_dict(model)
    folder = hsdp_accelerate.save_pretrained(model, os.path.join(tmp, "hf"))
    if rank == 0:
        out["params"] = full
        # On a GPU full_state_dict copies each name to the CPU on its own: the tie must be restored for HF.
        copies = {k: v.clone() for k, v in full.items()}
        hsdp_accelerate.tie_aliases(model, copies)
        out["retied"] = copies["lm_head.weight"] is copies["model.embed_tokens.weight"]
        out["loaded"] = max_abs_diff(LlamaForCausalLM.from_pretrained(folder).state_dict(), full)
        with open(os.path.join(folder, "config.json")) as f:
            out["architectures"] = json.load(f)["architectures"]
        from safetensors import safe_open

        with safe_open(os.path.join(folder, "model.safetensors"), "pt") as f:
            out["stored"] = sorted(f.keys())

    accelerator2, model2, (prepared2, optimizer2, loader2, scheduler2) = _prepared(mesh, seed=1)
    accelerator2.load_state(ckpt)
    skipped = accelerator2.skip_first_batches(loader2, SAVE_AFTER * ACCUM)
    out["resumed"] = _loop(accelerator2, prepared2, optimizer2, skipped, scheduler2)
    resumed = hsdp.full_state_dict(model2)
    if rank == 0:
        out["resumed_params"] = max_abs_diff(resumed, full)
    return out


def test_accelerate_trains_saves_and_resumes_like_one_process(tmp_path) -> None:
    results = run_distributed(_ranks, WORLD, str(tmp_path), env=ENV, timeout=240)
    ref = _reference()
    r0 = results[0]
    assert all(r["unwrapped"] and r["optimizer"] for r in results)

    straight = r0["straight"]
    assert straight["losses"] == pytest.approx(ref["losses"], abs=1e-5)
    assert len(straight["norms"]) == STEPS and straight["norms"] == pytest.approx(ref["norms"], abs=1e-5)
    assert max(ref["norms"]) > MAX_NORM  # clipping changed the updates
    assert max_abs_diff(r0["params"], ref["params"]) < 1e-5
    assert max_abs_diff(ref["params"], tiny_llama(0).state_dict()) > 1e-3  # the weights did move

    # Inside a window: reduce-scatter in the node, nothing across replicas; the window's last: one crossing.
    for r in results:
        inside = [i for i in range(len(r["straight"]["hops"])) if i % ACCUM != ACCUM - 1]
        assert all(r["straight"]["hops"][i] == 0 and r["straight"]["scatters"][i] > 0 for i in inside)
        assert all(r["straight"]["hops"][i] > 0 for i in range(ACCUM - 1, len(r["straight"]["hops"]), ACCUM))

    files = r0["files"]
    assert "hsdp_model" in files and "scheduler.bin" in files
    assert {f"random_states_{i}.pkl" for i in range(WORLD)} <= set(files)
    assert not {"model.safetensors", "pytorch_model.bin", "optimizer.bin"} & set(files)

    resumed = r0["resumed"]
    assert resumed["losses"] == pytest.approx(straight["losses"][SAVE_AFTER * ACCUM:], abs=1e-6)
    assert resumed["norms"] == pytest.approx(straight["norms"][SAVE_AFTER:], abs=1e-6)
    assert r0["resumed_params"] < 1e-6

    assert r0["loaded"] == 0.0 and r0["retied"]
    assert r0["architectures"] == ["LlamaForCausalLM"]
    assert "lm_head.weight" not in r0["stored"] and "model.embed_tokens.weight" in r0["stored"]
