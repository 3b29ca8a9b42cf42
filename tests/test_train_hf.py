"""Hugging Face ``transformers`` models wrap and train unchanged under hsdp (the ``hf`` extra).

``GPT2LMHeadModel`` built from a config (random weights, nothing downloaded): Conv1D layers, blocks in a
``transformer.h`` ModuleList (the default policy makes each a unit), and ``lm_head.weight`` tied to
``transformer.wte.weight``. Trained with its own loss (``labels=``) on 2 ranks as 1x2 (sharded) and 2x1
(replicated), it must match one process training on both ranks' batches within 1e-5 (fp32). The same
spawn runs ``hsdp train`` with ``model.kind = "hf-gpt2"``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="the hf extra (pip install 'hsdp[hf]'); `make test` installs it")

from harness import run_distributed

STEPS = 3
VOCAB, CONTEXT, BATCH = 64, 16, 2


def _gpt2() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    # Dropout off: the reference and the ranks would draw different masks. bos/eos inside the vocabulary.
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=CONTEXT, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg)


def _batch(step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, VOCAB, (BATCH, CONTEXT), generator=g)


def _optimizer(params: object) -> torch.optim.Optimizer:
    # lr 1e-3: the attention key bias has a mathematically zero gradient (softmax ignores a constant per
    # query), so its gradient is pure round-off, which Adam normalises into lr-sized steps whose sign
    # differs between any two summation orders: at lr 1e-2 that alone is 2e-5 after 3 steps.
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)  # type: ignore[arg-type]


def _train_sharded(rank: int, degree: int) -> dict:
    import hsdp

    model = hsdp.ShardedModel(_gpt2(), mesh=hsdp.init_mesh(degree))
    tied = model.lm_head.weight is model.transformer.wte.weight
    units = [u.name for u in model.units]
    opt = hsdp.ShardedOptimizer(model, _optimizer(model.parameters()))
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        x = _batch(step, rank)
        loss = model(input_ids=x, labels=x).loss  # the model's own loss: nothing hsdp-specific
        loss.backward()
        opt.step()
        losses.append(loss.item())
    full = hsdp.full_state_dict(model)
    return {"losses": losses, "state": full if rank == 0 else None, "tied": tied, "units": units}


def _hf_worker(rank: int, world: int, tmp: str) -> dict:
    from rich.console import Console

    from hsdp.apps.train import resolve_config, run_job

    out = {degree: _train_sharded(rank, degree) for degree in (2, 1)}  # 1x2 mesh, then 2x1
    cfg = resolve_config(None, ["model.kind=hf-gpt2", "train.steps=4", "train.eval_every=2",
                                "train.checkpoint_every=2", "train.sample_tokens=8", "data.max_bytes=100000",
                                "optim.warmup_steps=1", f"train.out_dir={tmp}/run"])
    out["job"] = run_job(cfg, Console(quiet=True)).summary
    return out


def _reference(world: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = _gpt2()
    opt = _optimizer(model.parameters())
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        per_rank = [model(input_ids=_batch(step, r), labels=_batch(step, r)).loss for r in range(world)]
        loss = torch.stack(per_rank).mean()  # equal batches: the mean of the ranks' means
        loss.backward()
        opt.step()
        losses.append([x.item() for x in per_rank])
    return losses, model.state_dict()


def test_gpt2_lm_head_model_matches_one_process(tmp_path: Path) -> None:
    results = run_distributed(_hf_worker, 2, str(tmp_path), timeout=280)
    ref_losses, ref_state = _reference(2)
    for degree in (2, 1):
        r0, r1 = results[0][degree], results[1][degree]
        assert r0["tied"] and r1["tied"]
        assert r0["units"] == ["GPT2LMHeadModel(root)", "GPT2Block(transformer.h.0)", "GPT2Block(transformer.h.1)"]
        for step in range(STEPS):
            assert r0["losses"][step] == pytest.approx(ref_losses[step][0], abs=1e-5)
            assert r1["losses"][step] == pytest.approx(ref_losses[step][1], abs=1e-5)
        state = r0["state"]
        assert set(state) >= {k for k in ref_state if not k.endswith("attn.bias")}
        assert torch.equal(state["lm_head.weight"], state["transformer.wte.weight"])  # still tied after training
        worst = max((state[k] - ref_state[k]).abs().max().item() for k in state)
        assert worst < 1e-5, (degree, worst)
        moved = max((state[k] - _gpt2().state_dict()[k]).abs().max().item() for k in state)
        assert moved > 1e-3  # training changed the weights: the comparison is not vacuous
    job = results[0]["job"]
    assert job["model"]["kind"] == "hf-gpt2" and job["steps"]["last"] == 4
    assert job["loss_last"] < job["loss_first"]
    assert (tmp_path / "run" / "checkpoints" / "step_000004").is_dir()
