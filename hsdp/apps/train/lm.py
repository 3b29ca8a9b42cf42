"""The language models ``hsdp train`` builds, behind one interface: logits and next-token loss.

``gpt``: :class:`hsdp.models.GPT` (``forward(idx, targets) -> (logits, loss)``). ``hf-gpt2``: a Hugging
Face ``GPT2LMHeadModel`` of the same shape with random weights (built from a config, nothing is
downloaded; its tied ``wte``/``lm_head`` matrix stays one parameter under hsdp). Both see the same
``(x, y)`` batches, ``y`` being ``x`` shifted by one token, and the same loss: mean cross entropy.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from hsdp.apps.train.config import ModelConfig
from hsdp.models import GPT, GPTConfig, preset


@dataclass(frozen=True)
class BuiltModel:
    """An unwrapped model, its kind, class name (before wrapping renames it), context length and distinct
    parameter count (a tied matrix counts once)."""

    module: nn.Module
    kind: str
    class_name: str
    block_size: int
    n_params: int

    @property
    def description(self) -> str:
        return f"{self.class_name}, {self.n_params:,} parameters, context {self.block_size}"


def gpt_shape(cfg: ModelConfig, vocab_size: int) -> GPTConfig:
    """The preset's shape with the tokenizer's vocabulary and the configured context and dropout."""
    shape = preset(cfg.preset)
    return dataclasses.replace(shape, vocab_size=vocab_size, block_size=cfg.block_size or shape.block_size,
                               dropout=cfg.dropout)


def hf_gpt2(shape: GPTConfig) -> nn.Module:
    """A randomly initialised ``GPT2LMHeadModel`` of ``shape`` (needs the ``hf`` extra)."""
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError:
        raise ValueError("model.kind = 'hf-gpt2' needs Hugging Face transformers: pip install 'hsdp[hf]'") from None
    # bos/eos default to GPT-2's 50256, outside a byte or character vocabulary: transformers warns.
    config = GPT2Config(vocab_size=shape.vocab_size, n_positions=shape.block_size, n_embd=shape.n_embd,
                        n_layer=shape.n_layer, n_head=shape.n_head, resid_pdrop=shape.dropout,
                        embd_pdrop=shape.dropout, attn_pdrop=shape.dropout, bos_token_id=0, eos_token_id=0,
                        tie_word_embeddings=shape.tie_embeddings)
    return GPT2LMHeadModel(config)


def build_model(cfg: ModelConfig, vocab_size: int) -> BuiltModel:
    """The configured model with freshly initialised weights (from torch's global generator)."""
    shape = gpt_shape(cfg, vocab_size)
    module = GPT(shape) if cfg.kind == "gpt" else hf_gpt2(shape)
    n_params = sum(p.numel() for p in module.parameters())  # parameters() yields a tied matrix once
    return BuiltModel(module, cfg.kind, type(module).__name__, shape.block_size, n_params)


def logits_of(module: nn.Module, kind: str, idx: torch.Tensor) -> torch.Tensor:
    """``(B, T, vocab)`` logits of token ids ``idx`` (B, T)."""
    if kind == "gpt":
        return module(idx)[0]
    return module(input_ids=idx).logits


def lm_loss(module: nn.Module, kind: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy of predicting ``y`` from ``x``."""
    if kind == "gpt":
        return module(x, y)[1]
    logits = logits_of(module, kind, x)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1))


@torch.no_grad()
def sample(logits_fn: Callable[[torch.Tensor], torch.Tensor], prompt: list[int], tokens: int, block_size: int,
           *, seed: int = 0, temperature: float = 0.8, top_k: int = 20) -> list[int]:
    """``prompt`` followed by ``tokens`` sampled ids. Exactly one forward per new token: under a
    ShardedModel every rank must call it with the same ``tokens`` (each forward runs collectives)."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.tensor([prompt], dtype=torch.long)
    for _ in range(tokens):
        # On the CPU: the generator is a CPU one, whatever device the model runs on.
        logits = logits_fn(idx[:, -block_size:])[:, -1, :].float().cpu() / temperature
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
        probs = F.softmax(logits.masked_fill(logits < kth, float("-inf")), dim=-1)
        idx = torch.cat([idx, torch.multinomial(probs, 1, generator=g)], dim=1)
    return idx[0].tolist()
