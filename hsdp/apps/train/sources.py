"""Where ``hsdp train``'s text comes from: the documents of each kind of ``data.source``, and the check of a
source made before any rank starts.

A document is one file of a text source (``stdlib``, a file, a folder) or one record of a ``.jsonl`` file, a
parquet file or folder, or a ``datasets`` directory; :func:`documents` yields each one's UTF-8 bytes, in
order, lazily (reading stops when the caller has enough). :func:`source_problem` runs the cheap part of the
same checks (the path exists, a folder holds matching files, the first record or the parquet schema has
``data.text_field``, the package a format needs is installed) so that ``hsdp train --data /nonexistent``
says so in one line before spawning, rather than in every rank under torchrun's tracebacks; the readers
raise the same messages.
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Iterator
from typing import Any

from hsdp.apps.train.config import STDLIB, DataConfig
from hsdp.data.text import stdlib_sources

_DATASET_MARKERS = ("dataset_dict.json", "state.json", "dataset_info.json")
_PARQUET = ".parquet"
_RECORD_FORMATS = ("jsonl", "parquet", "dataset")  # one document per record, not per file


def _walk(folder: str, extensions: tuple[str, ...]) -> list[str]:
    """Files under ``folder`` ending in ``extensions``, sorted depth-first, hidden folders skipped."""
    out = []
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        out += [os.path.join(dirpath, n) for n in sorted(filenames) if n.endswith(extensions)]
    return out


def detect_format(cfg: DataConfig) -> str:
    """``text``, ``jsonl``, ``parquet`` or ``dataset`` for ``cfg.source`` (``stdlib`` is text)."""
    if cfg.format != "auto" or cfg.source == STDLIB:
        return "text" if cfg.format == "auto" else cfg.format
    if os.path.isdir(cfg.source):
        if any(os.path.exists(os.path.join(cfg.source, m)) for m in _DATASET_MARKERS):
            return "dataset"
        return "parquet" if _walk(cfg.source, (_PARQUET,)) else "text"
    if cfg.source.endswith(_PARQUET):
        return "parquet"
    return "jsonl" if cfg.source.endswith((".jsonl", ".ndjson")) else "text"


def is_records(cfg: DataConfig) -> bool:
    """Whether the source's documents are records (joined by a blank line for byte and char tokens)."""
    return detect_format(cfg) in _RECORD_FORMATS


# ---------------------------------------------------------------------------------------------------------
# Checks shared by source_problem and the readers.
# ---------------------------------------------------------------------------------------------------------
def _text_paths(cfg: DataConfig) -> list[str]:
    if cfg.source == STDLIB:
        return list(stdlib_sources())
    if not os.path.isdir(cfg.source):
        return [cfg.source]
    paths = _walk(cfg.source, cfg.extensions)
    if not paths:
        raise ValueError(f"data.source = {cfg.source!r} holds no file ending in {list(cfg.extensions)}: "
                         f"set data.extensions")
    return paths


def _jsonl_field(cfg: DataConfig, number: int, line: str) -> Any:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg.source}:{number} is not JSON ({e.msg}): data.source must hold one JSON object "
                         f"per line, or set data.format") from None
    if not isinstance(record, dict) or cfg.text_field not in record:
        raise ValueError(f"{cfg.source}:{number} has no field {cfg.text_field!r}: set data.text_field")
    return record[cfg.text_field]


def _pyarrow_parquet() -> Any:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError("a parquet data.source needs pyarrow: pip install pyarrow (or 'hsdp[data]')") from None
    return pq


def _parquet_paths(cfg: DataConfig) -> list[str]:
    paths = _walk(cfg.source, (_PARQUET,)) if os.path.isdir(cfg.source) else [cfg.source]
    if not paths:
        raise ValueError(f"data.source = {cfg.source!r} holds no {_PARQUET} file: name a parquet file or a "
                         f"folder of them, or set data.format")
    return paths


def _parquet_file(pq: Any, cfg: DataConfig, path: str) -> Any:
    try:
        f = pq.ParquetFile(path)
    except Exception as e:  # pyarrow's own error types: not a parquet file, truncated footer
        raise ValueError(f"{path} is not a readable parquet file ({e}): check data.source") from None
    names = f.schema_arrow.names
    if cfg.text_field not in names:
        raise ValueError(f"the parquet file {path} has columns {names}, not {cfg.text_field!r}: set "
                         f"data.text_field")
    return f


def _check(cfg: DataConfig) -> None:
    """Raise the reader's ``ValueError`` for what can be seen cheaply (no full read, no ``datasets`` import)."""
    if cfg.source == STDLIB:
        return
    if not os.path.exists(cfg.source):
        raise ValueError(f"data.source = {cfg.source!r} does not exist: name a text file or folder, a .jsonl or "
                         f".parquet file, a datasets directory, or 'stdlib'")
    kind = detect_format(cfg)
    if kind == "text":
        _text_paths(cfg)
    elif kind == "jsonl":
        if os.path.isdir(cfg.source):
            raise ValueError(f"data.source = {cfg.source!r} is a folder, but data.format = 'jsonl' reads one "
                             f"file: name the .jsonl file")
        with open(cfg.source, encoding="utf-8") as f:
            first = next(((n, line) for n, line in enumerate(f, 1) if line.strip()), None)
        if first is not None:
            _jsonl_field(cfg, *first)
    elif kind == "parquet":
        _parquet_file(_pyarrow_parquet(), cfg, _parquet_paths(cfg)[0])
    elif importlib.util.find_spec("datasets") is None:
        raise ValueError(f"data.source = {cfg.source!r} is a `datasets` directory but the `datasets` package is "
                         f"not installed: pip install datasets")


def source_problem(cfg: DataConfig) -> str | None:
    """Why ``cfg.source`` cannot be read (``None``: it looks readable), in one line naming the fix; checked
    before any rank starts."""
    try:
        _check(cfg)
    except (ValueError, OSError) as e:
        return str(e)
    return None


# ---------------------------------------------------------------------------------------------------------
# Documents.
# ---------------------------------------------------------------------------------------------------------
def _text_documents(cfg: DataConfig) -> Iterator[bytes]:
    # Each file read up to max_bytes at most: the caller stops once it has max_bytes in all.
    for path in _text_paths(cfg):
        try:
            with open(path, "rb") as f:
                yield f.read(cfg.max_bytes)
        except OSError:
            if cfg.source != STDLIB:
                raise
            # The stdlib corpus is best effort: an unreadable file (permissions, broken link) is skipped.


def _jsonl_texts(cfg: DataConfig) -> Iterator[Any]:
    with open(cfg.source, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                yield _jsonl_field(cfg, number, line)


def _parquet_texts(cfg: DataConfig) -> Iterator[Any]:
    pq = _pyarrow_parquet()
    for path in _parquet_paths(cfg):
        f = _parquet_file(pq, cfg, path)
        for batch in f.iter_batches(columns=[cfg.text_field], batch_size=1024):
            yield from (v for v in batch.column(0).to_pylist() if v is not None)


def _dataset_texts(cfg: DataConfig) -> Iterator[Any]:
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


_RECORDS = {"jsonl": _jsonl_texts, "parquet": _parquet_texts, "dataset": _dataset_texts}


def documents(cfg: DataConfig) -> Iterator[bytes]:
    """Each document of ``cfg.source`` as UTF-8 bytes, in order (lazily: stop when you have enough).
    ``ValueError`` naming the fix for a missing source, a folder without matching files, a record without
    ``data.text_field`` or a missing package."""
    _check(cfg)
    kind = detect_format(cfg)
    if kind == "text":
        return _text_documents(cfg)
    return (str(text).encode("utf-8") for text in _RECORDS[kind](cfg))


def within_budget(docs: Iterator[bytes], max_bytes: int, separator: bytes = b"") -> list[bytes]:
    """The documents, each followed by ``separator``, up to ``max_bytes`` in all (the last one cut)."""
    out, total = [], 0
    for doc in docs:
        piece = (doc + separator)[: max_bytes - total]
        out.append(piece)
        total += len(piece)
        if total >= max_bytes:
            break
    return out
