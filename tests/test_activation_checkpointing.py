"""Activation checkpointing on hsdp: gradients as on a plain model, every unit resharded after its backward.

A tiny Hugging Face GPT-2 (4 blocks, each a unit) trains 2 AdamW steps on 2 ranks (1x2 mesh) with its
blocks checkpointed four ways: ``gradient_checkpointing_enable`` non-reentrant and reentrant (recent
transformers checkpoint the block's ``forward``, so hsdp's hooks stay outside), and
``torch.utils.checkpoint`` around each block's *call*, non-reentrant and reentrant (older transformers
and hand-written loops: the hooks run inside; a reentrant original forward runs without grad and its
recomputation sees detached inputs). Each must match one plain process using the same checkpointing on
the global batch within 1e-5, keep at most two units besides the root gathered at any time (each unit
reshards right after its own backward, prefetch aside), and a third step's peak tensor memory with
reentrant checkpointing must stay within 1.1x of non-reentrant (``hsdp/tools/bench/peak_memory.py``).
"""

from __future__ import annotations

import functools

import pytest
import torch
from harness import run_distributed
from torch import nn
from torch.utils.checkpoint import checkpoint

pytest.importorskip("transformers", reason="the hf extra (pip install 'hsdp[hf]'); `make test` installs it")

import hsdp
from hsdp.tools.bench.peak_memory import measure_step_peak

VOCAB, CONTEXT, BATCH, STEPS = 64, 16, 2, 2
VARIANTS = {"hf_non_reentrant": ("hf", False), "hf_reentrant": ("hf", True),
            "call_non_reentrant": ("call", False), "call_reentrant": ("call", True)}


class CheckpointedCall(nn.Module):
    """Checkpoints the whole call of ``block``, its forward hooks included."""

    def __init__(self, block: nn.Module, reentrant: bool) -> None:
        super().__init__()
        self.block = block
        self.reentrant = reentrant

    def forward(self, hidden_states: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        return checkpoint(functools.partial(self.block, **kwargs), hidden_states, *args, use_reentrant=self.reentrant)


def _gpt2(style: str, reentrant: bool) -> tuple[nn.Module, type]:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=CONTEXT, n_embd=32, n_layer=4, n_head=2, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, use_cache=False)
    model = GPT2LMHeadModel(cfg)
    block_type = type(model.transformer.h[0])
    if style == "hf":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    else:
        for i, block in enumerate(model.transformer.h):
            model.transformer.h[i] = CheckpointedCall(block, reentrant)
    return model, block_type


def _ids(step: int, ranks: list[int]) -> torch.Tensor:
    return torch.cat([torch.randint(0, VOCAB, (BATCH, CONTEXT), generator=torch.Generator().manual_seed(100 * step + r))
                      for r in ranks])


def _parts(model: nn.Module, opt: torch.optim.Optimizer, ids: torch.Tensor) -> list:
    def forward_backward() -> None:
        model(input_ids=ids, labels=ids).loss.backward()

    def step() -> None:
        opt.step()
        opt.zero_grad()

    return [forward_backward, step]


def _most_gathered(model: hsdp.ShardedModel, run: list) -> int:
    """Run the parts, counting the most units (besides the root) unsharded at once."""
    from hsdp.engine.runtime.unit import ShardedState, ShardUnit

    others = model.units[1:]
    most = [0]
    original = ShardUnit.unshard

    def counting_unshard(self: ShardUnit, async_op: bool = True) -> None:
        original(self, async_op)
        most[0] = max(most[0], sum(u.state is not ShardedState.SHARDED for u in others))

    ShardUnit.unshard = counting_unshard
    try:
        for part in run:
            part()
    finally:
        ShardUnit.unshard = original
    return most[0]


def _variant(rank: int, world: int, style: str, reentrant: bool) -> dict:
    plain, block_type = _gpt2(style, reentrant)
    model = hsdp.ShardedModel(plain, mesh=hsdp.init_mesh(2), wrap=block_type)
    opt = hsdp.ShardedOptimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    most = max(_most_gathered(model, _parts(model, opt, _ids(step, [rank]))) for step in range(STEPS))
    full = hsdp.full_state_dict(model)
    _, peak = measure_step_peak(_parts(model, opt, _ids(STEPS, [rank])), model, opt, torch.device("cpu"))
    err = None
    if rank == 0:
        ref, _ = _gpt2(style, reentrant)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
        for step in range(STEPS):
            for part in _parts(ref, ref_opt, _ids(step, list(range(world)))):
                part()
        err = max((full[k] - v).abs().max().item() for k, v in ref.state_dict().items())
    return {"units": len(model.units), "most_gathered": most, "peak": peak, "err": err}


def _worker(rank: int, world: int) -> dict:
    return {name: _variant(rank, world, style, reentrant) for name, (style, reentrant) in VARIANTS.items()}


def test_checkpointed_units_reshard_after_backward_and_match_plain() -> None:
    results = run_distributed(_worker, 2)
    for rank, result in enumerate(results):
        for name, r in result.items():
            assert r["units"] == 5, (name, r)  # the root and 4 blocks
            assert r["most_gathered"] <= 2, (rank, name, r)
            if rank == 0:
                assert r["err"] < 1e-5, (name, r)
        for style in ("hf", "call"):
            ratio = result[f"{style}_reentrant"]["peak"] / result[f"{style}_non_reentrant"]["peak"]
            assert ratio <= 1.1, (rank, style, ratio, result)
