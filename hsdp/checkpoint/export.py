"""A checkpoint's model weights, consolidated, as one ``.safetensors`` file or a Hugging Face model folder.

Runs in one process, no process group needed (``hsdp export RUN --to model.safetensors``). It reads only
the model's tensors (not the optimizer state), full size, so the whole model must fit in host memory.
``RUN`` is anything :func:`hsdp.checkpoint.resolve.candidates` accepts: an ``hsdp train`` run directory,
its ``checkpoints`` directory, or one ``step_*`` directory.

Tied weights, one file (:func:`export_safetensors`): every name of a tied parameter is written, the
aliases as copies, so the plain ``model.load_state_dict(safetensors.torch.load_file(path))`` is strict
and complete (loading the same values into both names keeps the model's tie). safetensors refuses tensors
that share memory, so a copy is the price: the tied matrix is stored twice. The aliases are also recorded
in the file's metadata (``"hsdp.tied"``: ``{"head.weight": "embed.weight"}``), which
:func:`load_safetensors` uses to hand back one shared tensor. ``safetensors.torch.load_model`` needs
``strict=False`` on such a file (it counts the second copy as unexpected, then loads correctly).

Tied weights, Hugging Face folder (:func:`write_hf_folder`): Hugging Face's convention, each tied
parameter stored once under its first name; ``from_pretrained`` re-ties the aliases from the config
(``tie_word_embeddings``). A DCP checkpoint written by another tool carries no tie information: its tied
weights are exported as separate tensors in both formats.
"""

from __future__ import annotations

import json
import os
import re
import uuid
import warnings
from dataclasses import dataclass

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
HF_INDEX = "model.safetensors.index.json"
HF_CONFIG = "config.json"
HF_SINGLE = "model.safetensors"  # from_pretrained reads it before an index: it would shadow an export
DEFAULT_SHARD_BYTES = 5 * 10**9  # Hugging Face's customary 5GB: every shard stays under the Hub's file limit
_HF_SHARD = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")


@dataclass(frozen=True)
class Weights:
    """A checkpoint's model tensors, full size on the CPU. ``tensors`` holds every name, tied aliases as
    separate tensors; ``tied`` maps each alias to the name stored first (empty for foreign DCP)."""

    source: str  # the checkpoint directory they were read from
    tensors: dict[str, torch.Tensor]
    tied: dict[str, str]


def export_safetensors(ckpt: str | os.PathLike, out: str | os.PathLike, *,
                       options: CheckpointOptions | None = None) -> dict[str, str]:
    """Write the model weights of ``ckpt`` (a run or checkpoint directory) to ``out``, every tied alias as a
    copy; returns those aliases (alias -> stored name). Missing parent directories are created; the file
    appears atomically (temporary name, rename)."""
    out = os.fspath(out) if out else ""
    if not out.endswith(".safetensors"):
        raise ValueError(f"output path {out!r}: pass a file name ending in .safetensors (or hf DIR for a "
                         f"Hugging Face folder)")
    _writable_parent(out)
    weights = read_weights(ckpt, options=options)
    _save_atomically(weights.tensors, out, {"format": "pt", TIED_KEY: json.dumps(weights.tied)})
    return weights.tied


def read_weights(ckpt: str | os.PathLike, *, options: CheckpointOptions | None = None) -> Weights:
    """The model tensors of the newest valid checkpoint ``ckpt`` resolves to (checksums verified unless
    ``options.verify`` says otherwise). ``ValueError`` naming the problem."""
    cand = _verified(ckpt, options or CheckpointOptions())
    metadata, _ = read_metadata_file(os.path.join(cand.path, METADATA))
    if cand.manifest is not None:
        check_storage(metadata, {n: e.size for n, e in cand.manifest.files.items()}, cand.path)
    model_entries = [e for e in entries(metadata).values() if e.path[0] == MODEL and len(e.path) == 2]
    skipped = sorted(str(e.path[1]) for e in model_entries if not e.is_tensor)
    if skipped:
        warnings.warn(f"not exported (not tensors): {', '.join(skipped)}", stacklevel=3)
    tensors = {e.key: torch.empty(e.shape, dtype=dtype_of(e.dtype)) for e in model_entries if e.is_tensor}
    if not tensors:
        raise ValueError(f"checkpoint {cand.path} holds no model tensors ('model.*'): nothing to export")
    load_locally(tensors, CheckpointReader(cand.path))
    named = {key.removeprefix(f"{MODEL}."): t for key, t in tensors.items()}
    tied = {} if cand.manifest is None else dict(cand.manifest.tied)
    tied = {alias: name for alias, name in tied.items() if name in named}
    for alias, name in tied.items():
        if alias not in named:  # stored once in the checkpoint: the export still carries every name
            named[alias] = named[name].clone()
    return Weights(cand.path, named, tied)


def write_hf_folder(weights: Weights, out_dir: str | os.PathLike, config: dict, *,
                    max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> list[str]:
    """Write ``weights`` as a Hugging Face model folder: ``config.json`` (``config``, as given),
    ``model-0000i-of-0000n.safetensors`` shards of at most ``max_shard_bytes`` each (a larger tensor gets
    a shard of its own) and ``model.safetensors.index.json``; returns the files written. Tied aliases are
    left out (``from_pretrained`` re-ties them). ``out_dir`` and its parents are created; a previous
    export's shards there are replaced; a ``model.safetensors`` there is refused (see :func:`check_hf_out_dir`).
    Each file appears atomically, the index last."""
    out_dir = os.fspath(out_dir)
    prepare_out_dir(out_dir)
    check_hf_out_dir(out_dir)
    stored = {name: t for name, t in weights.tensors.items() if name not in weights.tied}
    shards = _shards(stored, max_shard_bytes)
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for name, shard in zip(names, shards, strict=True):
        _save_atomically(shard, os.path.join(out_dir, name), {"format": "pt"})
    total = sum(t.numel() * t.element_size() for t in stored.values())
    index = {"metadata": {"total_size": total},
             "weight_map": {key: name for name, shard in zip(names, shards, strict=True) for key in sorted(shard)}}
    _write_text(os.path.join(out_dir, HF_CONFIG), json.dumps(config, indent=2, sort_keys=True) + "\n")
    _write_text(os.path.join(out_dir, HF_INDEX), json.dumps(index, indent=2, sort_keys=True) + "\n")
    for stale in sorted(set(os.listdir(out_dir)) - set(names)):
        if _HF_SHARD.match(stale):  # a previous export's shard that the new index no longer names
            os.unlink(os.path.join(out_dir, stale))
    return [os.path.join(out_dir, n) for n in (HF_CONFIG, *names, HF_INDEX)]


def _shards(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    """Consecutive groups (in name order, so a layer's tensors stay together) of at most ``max_bytes``."""
    if max_bytes <= 0:
        raise ValueError(f"max shard size {max_bytes} bytes: pass a positive size")
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += nbytes
    return shards


def _writable_parent(path: str) -> None:
    """Create the directory ``path`` will be written into; ``ValueError`` with the reason when it cannot be."""
    prepare_out_dir(os.path.dirname(os.path.abspath(path)))
    if os.path.isdir(path):
        raise ValueError(f"output path {path} is a directory: pass a file name ending in .safetensors")


def prepare_out_dir(path: str) -> None:
    """Create the output directory ``path`` and its parents (as ``save_pretrained`` does); ``ValueError``
    with the reason, in one line, when it is a file or cannot be created or written."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"output directory {path} is a file: pass a directory (it is created if missing)")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:  # a parent is a file, or no permission: say which, before reading the checkpoint
        raise ValueError(f"cannot create output directory {path}: {e.strerror or e}") from None
    if not os.access(path, os.W_OK):
        raise ValueError(f"output directory {path} is not writable: pick another --to")


def check_hf_out_dir(path: str) -> None:
    """``ValueError`` when the folder ``path`` holds a ``model.safetensors``: ``from_pretrained`` would load it
    instead of the sharded export beside it (e.g. exporting into a copy of the original model folder)."""
    if os.path.isfile(os.path.join(path, HF_SINGLE)):
        raise ValueError(f"output directory {path} holds {HF_SINGLE}, which from_pretrained would load instead of "
                         f"this export: remove it, or pick another --to")


def _save_atomically(tensors: dict[str, torch.Tensor], path: str, metadata: dict[str, str]) -> None:
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:12]}"
    save_file(tensors, tmp, metadata=metadata)
    os.replace(tmp, path)


def _write_text(path: str, text: str) -> None:
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:12]}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


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
    """An exported file as a state dict whose tied aliases share one tensor, as in the model (the plain
    ``load_file`` gives each alias its own copy). A strict ``model.load_state_dict`` accepts it; so it does
    an older export that stored each tied weight once."""
    weights = load_file(os.fspath(path), device=device)
    with safe_open(os.fspath(path), framework="pt") as f:
        tied = json.loads((f.metadata() or {}).get(TIED_KEY, "{}"))
    for alias, name in tied.items():
        if name in weights:
            weights[alias] = weights[name]
    return weights
