"""``hsdp.integrations.transformers.HSDPTrainer`` trains like ``transformers.Trainer`` on the plain model on one
process, checkpoints through hsdp's sharded checkpoints and resumes exactly.

One spawn of 4 gloo ranks (2 x 2 mesh, ``sharding_degree=2``), a tiny tied-embedding LlamaForCausalLM,
Trainer's default AdamW and linear schedule, ``max_grad_norm`` clipping, 2 accumulation micro-batches per
step, Trainer's shuffled sampler; the reference is plain ``Trainer`` in the test process with the 4 ranks'
batches as one:

* the logged loss and grad norm of every step, the eval loss and the final full parameters agree to 1e-5
  (so each rank read its own part of every global batch); clipping is active; the model was not wrapped in
  DDP and crossed nodes once per optimizer step (one replicate all-reduce per unit and step);
* ``checkpoint-2`` holds an hsdp checkpoint (no consolidated weights, no ``optimizer.pt``) next to Trainer's
  scheduler, per-rank RNG and state files; a new trainer on a model with other weights, with
  ``shard_optimizer_across_replicas`` and ``gradient_checkpointing`` on, resumed from it logs the straight run's
  last losses and ends on its parameters;
* ``save_model()`` (every rank) writes a folder ``from_pretrained`` loads equal to ``hsdp.full_state_dict``, with
  ``config.json`` naming ``LlamaForCausalLM`` and the tied head stored once;
* the big-model path: the tiny config's parameters built on the meta device, wrapped, ``hsdp.load_pretrained`` from that
  folder, handed to ``HSDPTrainer``: the same eval loss.
"""

from __future__ import annotations

import json
import os

import pytest
from harness import run_distributed
from hf_tiny import CausalLMData, max_abs_diff, tiny_llama, token_batches

pytest.importorskip("transformers", reason="the hf extra (pip install 'hsdp[hf]'); `make test` installs it")

import hsdp

WORLD, MICRO, ACCUM, STEPS, SAVE_EVERY = 4, 2, 2, 4, 2  # ranks, per-rank micro-batch, micro-batches/step
TOKENS = token_batches(WORLD * MICRO * ACCUM * STEPS)
EVAL_TOKENS = token_batches(WORLD * MICRO * 2, seed=1)
# No GPUs: accelerate sees the torchrun world only with ACCELERATE_USE_CPU (torchrun sets the rest).
ENV = {"ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1", "LOCAL_WORLD_SIZE": str(WORLD),
       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


def _args(output_dir: str, per_device: int, **overrides: object):
    from transformers import TrainingArguments

    return TrainingArguments(output_dir=output_dir, per_device_train_batch_size=per_device,
                             per_device_eval_batch_size=per_device, gradient_accumulation_steps=ACCUM,
                             max_steps=STEPS, learning_rate=1e-3, max_grad_norm=0.5, logging_steps=1,
                             save_strategy="steps", save_steps=SAVE_EVERY, report_to="none", disable_tqdm=True,
                             use_cpu=True, seed=0, **overrides)


def _logged(trainer) -> dict:
    steps = [e for e in trainer.state.log_history if "loss" in e and "grad_norm" in e]
    return {"losses": [e["loss"] for e in steps], "norms": [e["grad_norm"] for e in steps]}


def _reference(tmp: str) -> dict:
    from accelerate.state import AcceleratorState, GradientState
    from transformers import Trainer

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    try:
        model = tiny_llama(0)
        trainer = Trainer(model=model, args=_args(os.path.join(tmp, "ref"), MICRO * WORLD),
                          train_dataset=CausalLMData(TOKENS), eval_dataset=CausalLMData(EVAL_TOKENS))
        trainer.train()
        out = _logged(trainer)
        out["eval"] = trainer.evaluate()["eval_loss"]
        out["params"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        return out
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()


def _trainer(model, output_dir: str, args: dict | None = None, **hsdp_options):
    from hsdp.integrations.transformers import HSDPTrainer

    return HSDPTrainer(model=model, args=_args(output_dir, MICRO, **(args or {})), train_dataset=CausalLMData(TOKENS),
                       eval_dataset=CausalLMData(EVAL_TOKENS), **hsdp_options)


def _ranks(rank: int, world: int, tmp: str) -> dict:
    from accelerate import init_empty_weights
    from transformers import LlamaForCausalLM

    model = tiny_llama(0)
    trainer = _trainer(model, os.path.join(tmp, "run"), sharding_degree=2)
    model.reset_comm_stats()
    trainer.train()
    out = _logged(trainer)
    stats = model.comm_stats()
    out["hops"] = int(stats["replicate"]["all_reduce"]["calls"]) / (STEPS * len(model.units))
    out["sharded"] = isinstance(trainer.model_wrapped, hsdp.ShardedModel) and trainer.model_wrapped is model
    out["eval"] = trainer.evaluate()["eval_loss"]
    out["files"] = sorted(os.listdir(os.path.join(tmp, "run", f"checkpoint-{SAVE_EVERY}")))
    full = hsdp.full_state_dict(model)
    folder = os.path.join(tmp, "final")
    trainer.save_model(folder)
    if rank == 0:
        out["params"] = full
        out["loaded"] = max_abs_diff(LlamaForCausalLM.from_pretrained(folder).state_dict(), full)
        with open(os.path.join(folder, "config.json")) as f:
            out["architectures"] = json.load(f)["architectures"]
        from safetensors import safe_open

        with safe_open(os.path.join(folder, "model.safetensors"), "pt") as f:
            out["stored"] = sorted(f.keys())

    # Resumed with two options that must not change the numbers: the hsdp checkpoint loads into the
    # replica-sliced optimizer, and HF's activation checkpointing recomputes exactly.
    resumed_model = tiny_llama(1)
    resumed = _trainer(resumed_model, os.path.join(tmp, "resumed"), {"gradient_checkpointing": True},
                       mesh=hsdp.init_mesh(sharding_degree=2), shard_optimizer_across_replicas=True)
    resumed.train(resume_from_checkpoint=os.path.join(tmp, "run", f"checkpoint-{SAVE_EVERY}"))
    out["resumed"] = _logged(resumed)
    out["resumed_options"] = resumed_model.shards_optimizer_across_replicas and resumed_model.is_gradient_checkpointing
    resumed_full = hsdp.full_state_dict(resumed_model)
    if rank == 0:
        out["resumed_params"] = max_abs_diff(resumed_full, full)

    # Parameters on meta, buffers real: Llama's rotary tables are computed at construction, never stored.
    with init_empty_weights(include_buffers=False):
        big = tiny_llama(2)
    big.tie_weights()  # init_empty_weights re-creates each parameter on meta, the tied head as a second one
    big = hsdp.ShardedModel(big, mesh=hsdp.init_mesh(sharding_degree=2))
    hsdp.load_pretrained(big, folder)
    out["meta_eval"] = _trainer(big, os.path.join(tmp, "meta")).evaluate()["eval_loss"]
    return out


def test_hsdp_trainer_trains_checkpoints_and_resumes_like_one_process(tmp_path) -> None:
    results = run_distributed(_ranks, WORLD, str(tmp_path), env=ENV, timeout=300)
    ref = _reference(str(tmp_path))
    r0 = results[0]
    assert all(r["sharded"] for r in results)

    assert len(r0["losses"]) == STEPS and r0["losses"] == pytest.approx(ref["losses"], abs=1e-5)
    assert r0["norms"] == pytest.approx(ref["norms"], abs=1e-5)
    assert max(ref["norms"]) > 0.5  # clipping changed the updates
    assert r0["eval"] == pytest.approx(ref["eval"], abs=1e-5)
    assert max_abs_diff(r0["params"], ref["params"]) < 1e-5
    assert max_abs_diff(ref["params"], tiny_llama(0).state_dict()) > 1e-3  # the weights did move
    assert all(r["hops"] == 1 for r in results)  # one inter-node hop per unit per optimizer step

    files = set(r0["files"])
    assert {"hsdp_model", "scheduler.pt", "trainer_state.json", "config.json"} <= files
    assert {f"rng_state_{i}.pth" for i in range(WORLD)} <= files
    assert not {"model.safetensors", "pytorch_model.bin", "optimizer.pt"} & files

    # The resumed log starts with the checkpoint's own history (trainer_state.json), then its own steps.
    assert r0["resumed"]["losses"] == pytest.approx(r0["losses"], abs=1e-6)
    assert r0["resumed"]["norms"] == pytest.approx(r0["norms"], abs=1e-6)
    assert r0["resumed_params"] < 1e-6 and r0["resumed_options"]

    assert r0["loaded"] == 0.0
    assert r0["architectures"] == ["LlamaForCausalLM"]
    assert "lm_head.weight" not in r0["stored"] and "model.embed_tokens.weight" in r0["stored"]
    assert r0["meta_eval"] == pytest.approx(r0["eval"], abs=1e-6)


def test_hsdp_trainer_refuses_compile_and_foreign_checkpoints_before_any_collective(tmp_path) -> None:
    from hsdp.integrations.transformers import HSDPTrainer, resume_dir

    with pytest.raises(ValueError, match="compile its blocks"):
        HSDPTrainer(model=tiny_llama(0), args=_args(str(tmp_path), MICRO, torch_compile=True))
    with pytest.raises(ValueError, match="not written by HSDPTrainer"):  # before any collective: no mesh here
        resume_dir(str(tmp_path))
