"""The tensors of a ``.safetensors`` checkpoint (one file or a Hugging Face sharded folder), read by row range.

Only headers are read up front (names, shapes, dtypes: every rank can check a load against its model
without touching data). Tensors are read as row slices, ``safe_open(...).get_slice(name)[start:stop]``,
from files opened for one batch of reads and closed after it: the file is memory-mapped and touched pages
count towards the process's RSS until it is unmapped, so keeping a large checkpoint open across a whole
load would hold about the bytes read so far.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Mapping
from contextlib import ExitStack
from dataclasses import dataclass

import torch
from safetensors import safe_open

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
TIED_KEY = "hsdp.tied"  # hsdp export's metadata: {"alias": "stored name"} (hsdp/checkpoint/export.py)

KeyMap = Callable[[str], "str | None"] | Mapping[str, "str | None"] | None


@dataclass(frozen=True)
class Entry:
    """One stored tensor: where it is and its header."""

    file: str
    key: str  # the name inside the file
    shape: tuple[int, ...]
    dtype: str


class SafetensorsSource:
    """Name -> :class:`Entry` for every tensor of a checkpoint, names already mapped by ``key_map``."""

    def __init__(self, path: str | os.PathLike, key_map: KeyMap = None) -> None:
        self.files = _resolve(os.fspath(path))
        stored = _read_headers(self.files)
        self.entries = _rename(stored, key_map)

    def read_rows(self, requests: Iterable[tuple[str, int, int, torch.Tensor]]) -> None:
        """For each ``(name, start, stop, out)``: copy rows ``[start, stop)`` of ``name`` into ``out``
        (casting). The files involved are opened once for the batch and closed after it."""
        with ExitStack() as stack:
            handles: dict[str, object] = {}
            for name, start, stop, out in requests:
                e = self.entries[name]
                if e.file not in handles:
                    handles[e.file] = stack.enter_context(safe_open(e.file, framework="pt", device="cpu"))
                f = handles[e.file]
                value = f.get_tensor(e.key) if not e.shape else f.get_slice(e.key)[start:stop]
                out.copy_(value.view(out.shape))


def _resolve(path: str) -> list[str]:
    """The checkpoint's files: a ``.safetensors`` file, an index JSON, or a folder holding either."""
    if os.path.isdir(path):
        for name in (INDEX_NAME, SINGLE_NAME):
            if os.path.exists(os.path.join(path, name)):
                return _resolve(os.path.join(path, name))
        raise ValueError(f"{path} holds neither {INDEX_NAME} nor {SINGLE_NAME}: pass a .safetensors file or a "
                         f"Hugging Face model folder")
    if not os.path.exists(path):
        raise ValueError(f"checkpoint {path} does not exist")
    if path.endswith(".json"):
        with open(path) as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{path} has no 'weight_map' (name -> file): not a safetensors index")
        folder = os.path.dirname(path)
        return sorted({os.path.join(folder, file) for file in weight_map.values()})
    if not path.endswith(".safetensors"):
        raise ValueError(f"{path}: expected a .safetensors file, a {INDEX_NAME} or a folder holding one")
    return [path]


def _read_headers(files: list[str]) -> dict[str, Entry]:
    out: dict[str, Entry] = {}
    for file in files:
        if not os.path.exists(file):
            raise ValueError(f"checkpoint file {file} (named by the index) does not exist")
        with safe_open(file, framework="pt", device="cpu") as f:
            for key in f.keys():  # noqa: SIM118 (a safe_open handle is not iterable)
                sl = f.get_slice(key)
                if key in out:
                    raise ValueError(f"tensor {key!r} is stored in both {out[key].file} and {file}")
                out[key] = Entry(file, key, tuple(sl.get_shape()), sl.get_dtype())
            tied = json.loads((f.metadata() or {}).get(TIED_KEY, "{}"))
        # hsdp export stores a tied weight once; its aliases read the stored tensor.
        for alias, name in tied.items():
            if name in out and alias not in out:
                out[alias] = out[name]
    return out


def _rename(stored: dict[str, Entry], key_map: KeyMap) -> dict[str, Entry]:
    """Checkpoint names -> model names. A callable maps a name (``None`` drops it); a mapping rewrites the
    longest matching prefix (``{"model.": ""}`` strips ``model.``; a value ``None`` drops the names under
    it); names no prefix matches are kept."""
    if key_map is None:
        return dict(stored)
    if isinstance(key_map, Mapping):
        rename = _prefix_rewriter(key_map)
    elif callable(key_map):
        rename = key_map
    else:
        raise ValueError(f"key_map must be a callable (checkpoint name -> model name or None) or a dict of "
                         f"prefix rewrites, got {type(key_map).__name__}")
    out: dict[str, Entry] = {}
    origin: dict[str, str] = {}
    for name, entry in stored.items():
        new = rename(name)
        if new is None:
            continue
        if not isinstance(new, str):
            raise ValueError(f"key_map({name!r}) returned {new!r}: return the model's name for it, or None")
        if new in out:
            raise ValueError(f"key_map maps both {origin[new]!r} and {name!r} to {new!r}: map each model name once")
        out[new], origin[new] = entry, name
    return out


def _prefix_rewriter(rules: Mapping[str, str | None]) -> Callable[[str], str | None]:
    ordered = sorted(rules.items(), key=lambda kv: len(kv[0]), reverse=True)

    def rename(name: str) -> str | None:
        for prefix, replacement in ordered:
            if name.startswith(prefix):
                return None if replacement is None else replacement + name[len(prefix):]
        return name

    return rename
