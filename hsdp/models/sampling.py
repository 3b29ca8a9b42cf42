"""Sampling text from a language model: temperature, top-k, one forward per new token.

One owner for :meth:`hsdp.models.GPT.generate` and ``hsdp train``'s end-of-run sample, so the same seed
gives the same tokens whichever of them drew them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.nn import functional as F


def _check_temperature(temperature: float) -> None:
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")


def sample_next(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """``(B, 1)`` token ids drawn from the last position's ``logits`` ``(B, vocab)``: ``temperature``
    divides the logits (below 1 sharpens), ``top_k`` keeps only the k most likely tokens, ``generator``
    makes the draw reproducible (it must live on ``logits``' device)."""
    _check_temperature(temperature)
    logits = logits / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(F.softmax(logits, dim=-1), num_samples=1, generator=generator)


@torch.no_grad()
def generate(logits_fn: Callable[[torch.Tensor], torch.Tensor], idx: torch.Tensor, max_new_tokens: int,
             block_size: int, *, temperature: float = 1.0, top_k: int | None = None,
             generator: torch.Generator | None = None) -> torch.Tensor:
    """``idx`` ``(B, T)`` followed by ``max_new_tokens`` tokens drawn with :func:`sample_next`;
    ``logits_fn`` maps the last ``block_size`` ids ``(B, t)`` to logits ``(B, t, vocab)``.

    Exactly one ``logits_fn`` call per new token, so under a ShardedModel every rank must call it with
    the same ``max_new_tokens`` (each forward runs collectives).
    """
    _check_temperature(temperature)  # before the first forward, even when no token is asked for
    for _ in range(max_new_tokens):
        logits = logits_fn(idx[:, -block_size:])[:, -1, :]
        idx = torch.cat([idx, sample_next(logits, temperature, top_k, generator)], dim=1)
    return idx
