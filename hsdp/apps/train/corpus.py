"""The text ``hsdp train`` learns from, and its tokenizer.

Sources (see :class:`~hsdp.apps.train.config.DataConfig`): the Python standard library's sources (the default:
every machine has them), a text file, a folder of text files, a ``.jsonl`` file with one record per line,
or a Hugging Face ``datasets`` directory written by ``save_to_disk``. Tokenizers: bytes (vocabulary 256,
any text) or characters (the distinct characters of the corpus; smaller vocabulary, longer context per
token for non-ASCII text). Every rank reads the same corpus the same way, so all agree on the vocabulary.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from hsdp.apps.train.config import STDLIB, DataConfig
from hsdp.data.text import ByteTokenizer, as_tokens, default_corpus_bytes, split_tokens

_DATASET_MARKERS = ("dataset_dict.json", "state.json", "dataset_info.json")
_RECORD_SEPARATOR = b"\n\n"


class Tokenizer(Protocol):
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Any) -> str: ...


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


# ---------------------------------------------------------------------------------------------------------
# Reading the raw bytes.
# ---------------------------------------------------------------------------------------------------------
def detect_format(cfg: DataConfig) -> str:
    """``text``, ``jsonl`` or ``dataset`` for ``cfg.source`` (``stdlib`` is text)."""
    if cfg.format != "auto" or cfg.source == STDLIB:
        return "text" if cfg.format == "auto" else cfg.format
    if os.path.isdir(cfg.source) and any(os.path.exists(os.path.join(cfg.source, m)) for m in _DATASET_MARKERS):
        return "dataset"
    return "jsonl" if cfg.source.endswith((".jsonl", ".ndjson")) else "text"


def _text_files(folder: str, extensions: tuple[str, ...]) -> list[str]:
    out = []
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        out += [os.path.join(dirpath, n) for n in sorted(filenames) if n.endswith(extensions)]
    return out


def _read_text(cfg: DataConfig) -> bytes:
    if cfg.source == STDLIB:
        return default_corpus_bytes(cfg.max_bytes)
    paths = _text_files(cfg.source, cfg.extensions) if os.path.isdir(cfg.source) else [cfg.source]
    if not paths:
        raise ValueError(f"data.source = {cfg.source!r} holds no file ending in {list(cfg.extensions)}: "
                         f"set data.extensions")
    chunks, total = [], 0
    for path in paths:
        with open(path, "rb") as f:
            chunks.append(f.read(cfg.max_bytes - total))
        total += len(chunks[-1])
        if total >= cfg.max_bytes:
            break
    return b"".join(chunks)


def _join_records(texts: Any, cfg: DataConfig) -> bytes:
    chunks, total = [], 0
    for text in texts:
        data = str(text).encode("utf-8") + _RECORD_SEPARATOR
        chunks.append(data)
        total += len(data)
        if total >= cfg.max_bytes:
            break
    return b"".join(chunks)[: cfg.max_bytes]


def _jsonl_texts(cfg: DataConfig) -> Any:
    with open(cfg.source, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            record = json.loads(line)
            if not isinstance(record, dict) or cfg.text_field not in record:
                raise ValueError(f"{cfg.source}:{number} has no field {cfg.text_field!r}: set data.text_field")
            yield record[cfg.text_field]


def _dataset_texts(cfg: DataConfig) -> Any:
    try:
        import datasets
    except ImportError:
        raise ValueError(f"data.source = {cfg.source!r} is a `datasets` directory but the `datasets` package "
                         f"is not installed: pip install datasets") from None
    loaded = datasets.load_from_disk(cfg.source)
    if isinstance(loaded, datasets.DatasetDict):
        loaded = loaded["train"] if "train" in loaded else loaded[next(iter(loaded))]
    if cfg.text_field not in loaded.column_names:
        raise ValueError(f"the dataset at {cfg.source!r} has columns {loaded.column_names}, not "
                         f"{cfg.text_field!r}: set data.text_field")
    return (row[cfg.text_field] for row in loaded)


def read_corpus_bytes(cfg: DataConfig) -> bytes:
    """The first ``cfg.max_bytes`` bytes of the source (records joined by a blank line)."""
    if not os.path.exists(cfg.source) and cfg.source != STDLIB:
        raise ValueError(f"data.source = {cfg.source!r} does not exist: name a text file or folder, or 'stdlib'")
    kind = detect_format(cfg)
    if kind == "jsonl":
        data = _join_records(_jsonl_texts(cfg), cfg)
    elif kind == "dataset":
        data = _join_records(_dataset_texts(cfg), cfg)
    else:
        data = _read_text(cfg)
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


def load_corpus(cfg: DataConfig) -> Corpus:
    """Read, tokenize and split the configured source."""
    data = read_corpus_bytes(cfg)
    tokenizer: Tokenizer
    if cfg.tokenizer == "char":
        tokenizer, tokens = char_tokens(data.decode("utf-8", errors="replace"))
    else:
        tokenizer, tokens = ByteTokenizer(), as_tokens(data)
    train, held_out = split_tokens(tokens, cfg.eval_fraction)
    name = "Python standard library sources" if cfg.source == STDLIB else cfg.source
    description = (f"{name}: {len(data) / 1e6:.2f} MB, {len(tokens):,} {cfg.tokenizer} tokens "
                   f"(vocabulary {tokenizer.vocab_size})")
    return Corpus(train, held_out, tokenizer, description)
