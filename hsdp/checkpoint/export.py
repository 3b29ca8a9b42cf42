"""``export_safetensors``: a checkpoint's model weights as one consolidated ``.safetensors`` file.

Runs in one process, no process group needed (``hsdp export CKPT --to model.safetensors``). It reads only
the model's tensors (not the optimizer state), full size, so the whole model must fit in host memory.

Tied weights: safetensors refuses tensors that share memory, and storing a tied weight twice would
double its bytes. The export stores each tied parameter once, under its first name, and records the
aliases in the file's metadata (``"hsdp.tied"``: ``{"head.weight": "embed.weight"}``). Load it with
``safetensors.torch.load_model(model, path)`` (which restores shared tensors itself), with
``hsdp.checkpoint.load_safetensors(path)`` (a state dict with the aliases put back, for a strict
``model.load_state_dict``), or ``model.load_state_dict(load_file(path), strict=False)`` whose only
missing keys are the aliases. A DCP checkpoint written by another tool carries no tie information: its
tied weights are exported twice, as separate tensors.
"""

from __future__ import annotations

import json
import os
import uuid
import warnings

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from hsdp.checkpoint.dcp_io import (
    METADATA,
    CheckpointReader,
    check_storage,
    dtype_of,
    entries,
    load_locally,
    read_metadata_file,
)
from hsdp.checkpoint.manifest import InvalidCheckpoint, verify_checksums
from hsdp.checkpoint.names import MODEL
from hsdp.checkpoint.options import CheckpointOptions
from hsdp.checkpoint.resolve import Candidate, candidates

TIED_KEY = "hsdp.tied"


def export_safetensors(ckpt: str | os.PathLike, out: str | os.PathLike, *,
                       options: CheckpointOptions | None = None) -> dict[str, str]:
    """Write the model weights of ``ckpt`` (a run or checkpoint directory) to ``out``; returns the tied aliases
    that were stored once (alias -> stored name). The file appears atomically (temporary name, rename)."""
    options = options or CheckpointOptions()
    if not out or not str(out).endswith(".safetensors"):
        raise ValueError(f"output path {out!r}: pass a file name ending in .safetensors")
    cand = _verified(ckpt, options)
    metadata, _ = read_metadata_file(os.path.join(cand.path, METADATA))
    if cand.manifest is not None:
        check_storage(metadata, {n: e.size for n, e in cand.manifest.files.items()}, cand.path)
    model_entries = [e for e in entries(metadata).values() if e.path[0] == MODEL and len(e.path) == 2]
    skipped = sorted(str(e.path[1]) for e in model_entries if not e.is_tensor)
    if skipped:
        warnings.warn(f"not exported (not tensors): {', '.join(skipped)}", stacklevel=2)
    tensors = {e.key: torch.empty(e.shape, dtype=dtype_of(e.dtype)) for e in model_entries if e.is_tensor}
    if not tensors:
        raise ValueError(f"checkpoint {cand.path} holds no model tensors ('model.*'): nothing to export")
    load_locally(tensors, CheckpointReader(cand.path))
    weights = {key.removeprefix(f"{MODEL}."): t for key, t in tensors.items()}
    tied = {} if cand.manifest is None else dict(cand.manifest.tied)
    tied = {alias: name for alias, name in tied.items() if alias in weights and name in weights}
    for alias in tied:
        del weights[alias]
    out = os.fspath(out)
    tmp = f"{out}.tmp-{uuid.uuid4().hex[:12]}"
    save_file(weights, tmp, metadata={"format": "pt", TIED_KEY: json.dumps(tied)})
    os.replace(tmp, out)
    return tied


def _verified(ckpt: str | os.PathLike, options: CheckpointOptions) -> Candidate:
    for cand in candidates(ckpt):
        if cand.manifest is None or options.verify != "checksum":
            return cand
        try:
            verify_checksums(cand.path, cand.manifest, sorted(cand.manifest.files))
        except InvalidCheckpoint as e:
            if cand.explicit:
                raise
            warnings.warn(f"ignoring invalid checkpoint: {e}", stacklevel=3)
            continue
        return cand
    raise ValueError(f"checkpoint {ckpt}: no checkpoint passed verification (see the warnings above)")


def load_safetensors(path: str | os.PathLike, device: str = "cpu") -> dict[str, torch.Tensor]:
    """An exported file as a state dict with tied aliases put back (sharing the stored tensor), so a strict
    ``model.load_state_dict`` accepts it."""
    weights = load_file(os.fspath(path), device=device)
    with safe_open(os.fspath(path), framework="pt") as f:
        tied = json.loads((f.metadata() or {}).get(TIED_KEY, "{}"))
    for alias, name in tied.items():
        weights[alias] = weights[name]
    return weights
