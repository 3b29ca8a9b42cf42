"""``decentralized.py``'s data: the training windows every launch draws alike, the held-out split, its loss.

A byte-level GPT (``hsdp.models.gpt``) on the standard library's sources (``hsdp.data.text``, the last 5 % of the
tokens held out); at inner step k, rank s of replica r trains on windows drawn by a generator seeded (seed, k, r, s),
so every launch (alone, decentralized, torchft, plain) sees the same data.

Held-out loss: by default the whole held-out split, cut into consecutive windows (every held-out token predicted
once), token-weighted over chunks of windows. Why not a few random windows: on 64 of them (4,096 predicted tokens,
what this benchmark used until 2026-12-07) the same plain-HSDP models scored up to 2.2 % away from their loss on
512 windows, as much as the benchmark's gap line (3 %) allows (docs/reference/benchmarks.md).
``--eval-windows N`` still draws N random windows (a fixed generator) where a quick run wants them.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

CHUNK = 256  # windows per forward when evaluating: bounded activation memory, whatever the split's size


def _windows(tokens: Any, block: int, count: int, generator: Any) -> Any:
    import torch

    starts = torch.randint(0, len(tokens) - block - 1, (count,), generator=generator)
    return torch.stack([tokens[s:s + block + 1] for s in starts.tolist()]).long()


def split_windows(tokens: Any, block: int) -> Any:
    """``tokens`` as consecutive windows of ``block + 1`` tokens overlapping by one: every token after the first
    is a target exactly once (the remainder shorter than a window dropped)."""
    count = (len(tokens) - 1) // block
    return tokens[: count * block + 1].unfold(0, block + 1, block).long()


def _seed(seed: int, step: int, replica: int, rank: int) -> int:
    """The batch's seed of ``rank`` of ``replica`` at inner step ``step``: the same data in every launch."""
    return ((seed * 1_000_003 + step) * 64 + replica) * 64 + rank


def data(args: argparse.Namespace) -> tuple[Any, Callable[[int, int, int, int], Any], Any]:
    """Both systems' data: the model's config, the batch of (step, replica, rank, sequences) and the held-out
    windows (every replica evaluates all of them: the whole split, or ``--eval-windows`` random ones)."""
    import torch

    from hsdp.data.text import as_tokens, default_corpus_bytes, split_tokens
    from hsdp.models.gpt import preset

    cfg = preset(args.preset)
    train, held = split_tokens(as_tokens(default_corpus_bytes(args.corpus_bytes)), 0.05)

    def batch_of(step: int, replica: int, rank: int, count: int) -> Any:
        generator = torch.Generator().manual_seed(_seed(args.seed, step, replica, rank))
        return _windows(train, cfg.block_size, count, generator)

    if args.eval_windows:
        return cfg, batch_of, _windows(held, cfg.block_size, args.eval_windows, torch.Generator().manual_seed(12345))
    return cfg, batch_of, split_windows(held, cfg.block_size)


def held_out_loss(model: Any, held: Any) -> float:
    """The mean next-token loss over every window of ``held`` (chunks of ``CHUNK`` windows, each weighted by its
    window count: the model's loss is a mean over its batch). Every rank of a replica must call it with the same
    windows: a sharded model all-gathers its units in each forward."""
    import torch

    was_training = model.training
    model.eval()
    total = 0.0
    with torch.no_grad():
        for start in range(0, len(held), CHUNK):
            chunk = held[start:start + CHUNK]
            _, loss = model(chunk[:, :-1], chunk[:, 1:])
            total += float(loss.item()) * len(chunk)
    model.train(was_training)
    return total / len(held)
