"""``hsdp export RUN --to hf DIR``: an ``hf-gpt2`` run's weights as a Hugging Face model folder.

The folder is what ``transformers.GPT2LMHeadModel.from_pretrained(DIR)`` reads: ``config.json``, the
weights in safetensors shards and ``model.safetensors.index.json`` (see
:func:`hsdp.checkpoint.export.write_hf_folder`). The configuration is rebuilt from the run's saved
``config.toml`` (kind, preset, context, dropout) and the vocabulary size the checkpoint was trained with,
by the same adapter that built the model for training, so the two cannot drift apart. Only
``model.kind = "hf-gpt2"`` runs have a Hugging Face architecture; hsdp's own ``gpt`` exports to one
``.safetensors`` file.
"""

from __future__ import annotations

import json
import os

import torch

from hsdp.apps.train.config import RunConfig
from hsdp.apps.train.config_io import CONFIG_NAME, build_config, read_toml
from hsdp.apps.train.lm import LANGUAGE_MODELS
from hsdp.checkpoint.export import DEFAULT_SHARD_BYTES, Weights, prepare_out_dir, read_weights, write_hf_folder

HF_KIND = "hf-gpt2"
_VOCAB_KEY = "transformer.wte.weight"  # GPT2LMHeadModel's token embedding: (vocab, n_embd)


def export_hf(ckpt: str | os.PathLike, out_dir: str | os.PathLike, *,
              max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> list[str]:
    """Write the newest valid checkpoint of the ``hf-gpt2`` run ``ckpt`` (its run directory, its
    ``checkpoints`` directory or one ``step_*`` directory) to the Hugging Face folder ``out_dir`` (created
    if missing); returns the files written. ``ValueError`` naming the fix for another kind, a directory
    without the run's ``config.toml``, or weights that do not match it."""
    cfg = run_config(ckpt)
    if cfg.model.kind != HF_KIND:
        raise ValueError(f"--to hf writes a Hugging Face folder for model.kind = {HF_KIND!r} runs; this run is "
                         f"model.kind = {cfg.model.kind!r}: export it with --to model.safetensors")
    prepare_out_dir(os.fspath(out_dir))  # fail on a bad --to before reading the checkpoint
    weights = read_weights(ckpt)
    return write_hf_folder(weights, out_dir, gpt2_config(cfg, weights), max_shard_bytes=max_shard_bytes)


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
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    found = {name: tuple(t.shape) for name, t in weights.tensors.items()}
    if expected != found:
        differ = sorted(n for n in expected.keys() | found.keys() if expected.get(n) != found.get(n))
        raise ValueError(f"checkpoint {weights.source} does not match its run's config.toml ({len(differ)} "
                         f"tensors differ, e.g. {differ[0]}: checkpoint {found.get(differ[0])}, config "
                         f"{expected.get(differ[0])})")
    config = model.config
    config.architectures = [type(model).__name__]
    return json.loads(config.to_json_string(use_diff=False))
