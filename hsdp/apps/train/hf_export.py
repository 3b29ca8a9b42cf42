"""``hsdp export RUN --to hf DIR``: an ``hf-gpt2`` or ``hf`` run's weights as a Hugging Face model folder.

The folder is what ``from_pretrained(DIR)`` reads: ``config.json``, the weights in safetensors shards and
``model.safetensors.index.json`` (see :func:`hsdp.checkpoint.export.write_hf_folder`; tied weights once, under
their first name, as Hugging Face stores them). For ``hf-gpt2`` the configuration is rebuilt from the run's
saved ``config.toml`` (kind, preset, context, dropout) and the vocabulary size the checkpoint was trained
with, by the same adapter that built the model for training, so the two cannot drift apart. For ``hf`` (a
model folder, ``model.path``) it is that folder's ``config.json`` as written (the original architecture),
with its dtype set to the exported weights' (fp32: the master weights, as trained), and the folder's other
files (tokenizer, generation config, license, ...) are copied beside it; the folder must still exist.
Either way the checkpoint's tensor names and shapes must be those of the model the configuration builds.
hsdp's own ``gpt`` exports to one ``.safetensors`` file.
"""

from __future__ import annotations

import json
import os
import shutil

import torch

from hsdp.apps.train.config import RunConfig
from hsdp.apps.train.config_io import CONFIG_NAME, build_config, read_toml
from hsdp.apps.train.lm import LANGUAGE_MODELS
from hsdp.checkpoint.export import (
    DEFAULT_SHARD_BYTES,
    Weights,
    check_hf_out_dir,
    prepare_out_dir,
    read_weights,
    write_hf_folder,
)

HF_KIND = "hf-gpt2"
FOLDER_KIND = "hf"  # a model folder (model.path): its config.json and tokenizer go with the export
_VOCAB_KEY = "transformer.wte.weight"  # GPT2LMHeadModel's token embedding: (vocab, n_embd)
# Not copied from the model folder: its weights (the export writes the trained ones) and config.json (rewritten).
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".onnx")
_NOT_COPIED = ("config.json", "model.safetensors.index.json", "pytorch_model.bin.index.json")


def export_hf(ckpt: str | os.PathLike, out_dir: str | os.PathLike, *,
              max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> list[str]:
    """Write the newest valid checkpoint of the ``hf-gpt2`` run ``ckpt`` (its run directory, its
    ``checkpoints`` directory or one ``step_*`` directory) to the Hugging Face folder ``out_dir`` (created
    if missing); returns the files written. ``ValueError`` naming the fix for another kind, a directory
    without the run's ``config.toml``, or weights that do not match it."""
    cfg = run_config(ckpt)
    if cfg.model.kind not in (HF_KIND, FOLDER_KIND):
        raise ValueError(f"--to hf writes a Hugging Face folder for model.kind = {HF_KIND!r} or {FOLDER_KIND!r} "
                         f"runs; this run is model.kind = {cfg.model.kind!r}: export it with --to model.safetensors")
    out_dir = os.fspath(out_dir)
    prepare_out_dir(out_dir)  # fail on a bad --to before reading the checkpoint
    check_hf_out_dir(out_dir)
    if cfg.model.kind == FOLDER_KIND:
        return _export_folder_run(cfg, ckpt, out_dir, max_shard_bytes)
    weights = read_weights(ckpt)
    return write_hf_folder(weights, out_dir, gpt2_config(cfg, weights), max_shard_bytes=max_shard_bytes)


def _export_folder_run(cfg: RunConfig, ckpt: str | os.PathLike, out_dir: str, max_shard_bytes: int) -> list[str]:
    source = cfg.model.path
    if not os.path.isfile(os.path.join(source, "config.json")):
        raise ValueError(f"the run's model folder {source} (model.path) has no config.json any more: the export "
                         f"takes config.json and the tokenizer from it; restore it there")
    weights = read_weights(ckpt)
    config = folder_config(cfg, weights)
    copied = _copy_folder_files(source, out_dir)
    return [*write_hf_folder(weights, out_dir, config, max_shard_bytes=max_shard_bytes), *copied]


def folder_config(cfg: RunConfig, weights: Weights) -> dict:
    """The model folder's ``config.json`` as written, its dtype the checkpoint's and its architecture named;
    ``ValueError`` when the checkpoint's tensors are not those of the model the folder's config builds."""
    from hsdp.apps.train import hf_folder  # transformers, only for this kind

    path = cfg.model.path
    model = hf_folder.build_meta(hf_folder.HFShape(path, hf_folder.load_config(path), 1, has_weights=False))
    _check_tensors(model, weights)
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    dtypes = {str(t.dtype).removeprefix("torch.") for t in weights.tensors.values() if t.is_floating_point()}
    if len(dtypes) == 1:  # transformers 5 writes dtype, 4 torch_dtype: update whichever is there
        for key in ("dtype", "torch_dtype"):
            if key in config:
                config[key] = next(iter(dtypes))
    if not config.get("architectures"):  # a bare config.save_pretrained: name the class that was trained
        config["architectures"] = [type(model).__name__]
    return config


def _copy_folder_files(source: str, out_dir: str) -> list[str]:
    """The model folder's own files but weights and config.json (tokenizer, generation config, ...)."""
    copied = []
    for name in sorted(os.listdir(source)):
        src, dst = os.path.join(source, name), os.path.join(out_dir, name)
        if not os.path.isfile(src) or name in _NOT_COPIED or name.endswith(_WEIGHT_SUFFIXES):
            continue
        if os.path.exists(dst) and os.path.samefile(src, dst):
            continue  # exporting into the model folder itself: the file is there already
        shutil.copyfile(src, dst)
        copied.append(dst)
    return copied


def _check_tensors(model: torch.nn.Module, weights: Weights) -> None:
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    found = {name: tuple(t.shape) for name, t in weights.tensors.items()}
    if expected != found:
        differ = sorted(n for n in expected.keys() | found.keys() if expected.get(n) != found.get(n))
        raise ValueError(f"checkpoint {weights.source} does not match its run's model ({len(differ)} "
                         f"tensors differ, e.g. {differ[0]}: checkpoint {found.get(differ[0])}, model "
                         f"{expected.get(differ[0])})")


def run_config(ckpt: str | os.PathLike) -> RunConfig:
    """The saved configuration of the ``hsdp train`` run ``ckpt`` belongs to: ``config.toml`` in ``ckpt``
    or the nearest of its two parents (``runs/train/checkpoints/step_000100`` -> ``runs/train``)."""
    path = os.path.abspath(os.fspath(ckpt))
    for candidate in (path, os.path.dirname(path), os.path.dirname(os.path.dirname(path))):
        saved = os.path.join(candidate, CONFIG_NAME)
        if os.path.isfile(saved):
            return build_config(read_toml(saved), saved)
    if not os.path.exists(path):
        raise ValueError(f"checkpoint path {path} does not exist: check the path")
    raise ValueError(f"{path} is not inside an hsdp train run (no {CONFIG_NAME} there or above): --to hf needs "
                     f"the run's configuration; pass the run directory, or use --to model.safetensors")


def gpt2_config(cfg: RunConfig, weights: Weights) -> dict:
    """``config.json`` of the run's ``GPT2LMHeadModel``: built (on the meta device, no memory) by the adapter
    that built it for training, with the checkpoint's vocabulary; ``ValueError`` when any weight's name or
    shape differs from that model's (the checkpoint is not this configuration's)."""
    if _VOCAB_KEY not in weights.tensors:
        raise ValueError(f"checkpoint {weights.source} has no {_VOCAB_KEY}: not a GPT2LMHeadModel checkpoint")
    shape = cfg.model.shape(vocab_size=weights.tensors[_VOCAB_KEY].shape[0])
    with torch.device("meta"):
        model = LANGUAGE_MODELS[HF_KIND].build(shape)
    _check_tensors(model, weights)
    config = model.config
    config.architectures = [type(model).__name__]
    return json.loads(config.to_json_string(use_diff=False))
