"""The tokens ``hsdp train`` learns from, and their tokenizer.

The documents come from :mod:`hsdp.apps.train.sources` (the Python standard library's sources by default, a
text file or folder, a ``.jsonl`` file, parquet, or a ``datasets`` directory). Tokenizers: bytes (vocabulary
256, any text), characters (the distinct characters of the corpus; smaller vocabulary, longer context per
token for non-ASCII text), or a model's own (``model.kind = "hf"``: the folder's Hugging Face tokenizer,
each document followed by its end-of-text token). Every rank reads the same corpus the same way, so all agree
on the vocabulary. The tokens form one stream that :class:`hsdp.data.text.TokenStream` cuts into
fixed-length windows (packing: a window may span documents, as the end-of-text tokens mark).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hsdp.apps.train.config import STDLIB, DataConfig
from hsdp.apps.train.sources import detect_format, documents, is_records, within_budget
from hsdp.apps.train.tokenizing import DocumentTokenizer, Tokenizer
from hsdp.data.text import ByteTokenizer, as_tokens, split_tokens

__all__ = ["CharTokenizer", "Corpus", "DocumentTokenizer", "Tokenizer", "char_tokens", "detect_format",
           "load_corpus", "read_corpus_bytes"]

_RECORD_SEPARATOR = b"\n\n"


class CharTokenizer:
    """Characters as tokens: token ``i`` is ``chars[i]``. ``encode`` drops characters outside the
    vocabulary (a prompt may contain some the corpus never had)."""

    def __init__(self, chars: str) -> None:
        if not chars:
            raise ValueError("a character tokenizer needs at least one character: the corpus is empty")
        self.chars = chars
        self.vocab_size = len(chars)
        self._index = {c: i for i, c in enumerate(chars)}

    def encode(self, text: str) -> list[int]:
        return [self._index[c] for c in text if c in self._index]

    def decode(self, ids: Any) -> str:
        values = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        return "".join(self.chars[i] for i in values)


@dataclass(frozen=True)
class Corpus:
    """Training and held-out tokens (1-D integer tensors), their tokenizer, and a line describing them."""

    train: torch.Tensor
    held_out: torch.Tensor
    tokenizer: Tokenizer
    description: str


def read_corpus_bytes(cfg: DataConfig) -> bytes:
    """The first ``cfg.max_bytes`` bytes of the source (files concatenated, records joined by a blank line)."""
    separator = _RECORD_SEPARATOR if is_records(cfg) else b""
    data = b"".join(within_budget(documents(cfg), cfg.max_bytes, separator))
    if not data:
        raise ValueError(f"data.source = {cfg.source!r} holds no text")
    return data


# ---------------------------------------------------------------------------------------------------------
# Tokens.
# ---------------------------------------------------------------------------------------------------------
def char_tokens(text: str) -> tuple[CharTokenizer, torch.Tensor]:
    """The character vocabulary of ``text`` (sorted by code point) and ``text`` as int32 token ids."""
    codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    vocab = np.unique(codes)
    ids = np.searchsorted(vocab, codes).astype(np.int32)
    return CharTokenizer("".join(map(chr, vocab.tolist()))), torch.from_numpy(ids)


def _model_tokens(cfg: DataConfig, tokenizer: DocumentTokenizer) -> tuple[int, torch.Tensor]:
    """``(bytes read, ids)``: the first ``cfg.max_bytes`` bytes of documents, each encoded on its own."""
    docs = within_budget(documents(cfg), cfg.max_bytes)
    texts = [d.decode("utf-8", errors="replace") for d in docs]  # the last one may be cut inside a character
    ids = tokenizer.encode_documents([t for t in texts if t])
    return sum(map(len, docs)), torch.tensor(ids, dtype=torch.int32)


def load_corpus(cfg: DataConfig, tokenizer: DocumentTokenizer | None = None) -> Corpus:
    """Read, tokenize and split the configured source: with ``tokenizer`` (a model's own) each document is
    encoded with it, else with ``cfg.tokenizer`` (``auto``: bytes)."""
    chosen: Tokenizer
    if tokenizer is not None:
        size, tokens = _model_tokens(cfg, tokenizer)
        chosen, kind = tokenizer, tokenizer.name
    else:
        data = read_corpus_bytes(cfg)
        size, kind = len(data), "char" if cfg.tokenizer == "char" else "byte"
        if kind == "char":
            chosen, tokens = char_tokens(data.decode("utf-8", errors="replace"))
        else:
            chosen, tokens = ByteTokenizer(), as_tokens(data)
    if not len(tokens):
        raise ValueError(f"data.source = {cfg.source!r} holds no text")
    train, held_out = split_tokens(tokens, cfg.eval_fraction)
    name = "Python standard library sources" if cfg.source == STDLIB else cfg.source
    counted = f"{len(tokens):,} {kind} tokens (" if tokenizer is None else f"{len(tokens):,} tokens ({kind}, "
    description = f"{name}: {size / 1e6:.2f} MB, {counted}vocabulary {chosen.vocab_size})"
    return Corpus(train, held_out, chosen, description)
