"""A local Hugging Face causal-LM folder as ``hsdp train``'s model (``model.kind = "hf"``, ``model.path = DIR``).

The folder gives everything: ``config.json`` (the architecture, any model type ``AutoModelForCausalLM``
knows), the tokenizer (``AutoTokenizer.from_pretrained(DIR)``, so the vocabulary is the folder's), and the
weights when it holds ``model.safetensors`` or ``model.safetensors.index.json``; without weights the model
starts from its own initialiser (``_init_weights``, as ``from_config`` would, with ``train.seed``).

The model is built with its parameters on the meta device (no memory, no random draws) and its buffers
where its modules compute them (a rotary table built in ``__init__`` is real, as in a plain construction),
then wrapped, then given weights shard by shard: :func:`hsdp.load_pretrained` reads each rank's rows of the
folder's weights, :func:`hsdp.materialize` runs the model's ``_init_weights`` module by module on every rank
with the same seed (the result is a plain CPU construction's initialisation in ``modules()`` order, bitwise,
not ``from_config``'s: that one draws in another order). Parameters are fp32 (mixed precision is
``parallel.mixed_precision``'s), whatever dtype the folder stores.

:func:`folder_problem` checks the folder before any rank starts: it exists, holds ``config.json`` of a causal
LM, a tokenizer that loads and fits the config's vocabulary, and, if any weights, safetensors weights whose
names and shapes (read from the file headers) are the model's. Checkpoint names the model class declares
ignorable (``_keys_to_ignore_on_load_unexpected``, e.g. an old GPT-2's ``attn.bias``) are dropped, as
``from_pretrained`` drops them; other renames of legacy checkpoints are not made. Models that need
``trust_remote_code`` are not supported.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import hsdp

CONFIG_FILE = "config.json"
WEIGHT_FILES = ("model.safetensors.index.json", "model.safetensors")  # what hsdp.load_pretrained reads
_OTHER_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json", "tf_model.h5", "flax_model.msgpack")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                    "spiece.model")
DEFAULT_CONTEXT = 1024  # model.block_size 0: the folder's context, at most this (a 128k context would not fit)
_INSTALL = "pip install 'hsdp[hf]'"


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise ValueError(f"model.kind = 'hf' needs Hugging Face transformers: {_INSTALL}") from None
    return transformers


class HFTokenizer:
    """A Hugging Face tokenizer as ``hsdp train``'s (:class:`hsdp.apps.train.corpus.DocumentTokenizer`):
    ``encode`` adds no special tokens, ``encode_documents`` ends each document with the end-of-text token
    (``eos_token_id``) when the tokenizer has one; ``vocab_size`` counts added tokens (``len(tokenizer)``)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = len(tokenizer)
        self.eos_id = tokenizer.eos_token_id
        self.name = "the model folder's tokenizer"

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])

    def encode_documents(self, texts: list[str]) -> list[int]:
        end = [] if self.eos_id is None else [self.eos_id]
        out: list[int] = []
        # verbose=False: a document longer than the model's context is expected here (windows are cut later).
        for ids in self.tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"] if texts else []:
            out += list(ids) + end
        return out

    def decode(self, ids: Any) -> str:
        values = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        return self.tokenizer.decode(values)


@dataclass(frozen=True)
class HFShape:
    """What the job builds for ``model.kind = "hf"``: the folder, its loaded config, the training context
    and whether the folder holds weights."""

    path: str
    config: Any  # transformers.PretrainedConfig
    block_size: int
    has_weights: bool


def folder_context(config: Any) -> int | None:
    """The longest context the config declares (``max_position_embeddings``, GPT-2's ``n_positions`` through its
    attribute map), ``None`` for models without a limit."""
    value = getattr(config, "max_position_embeddings", None)
    return value if isinstance(value, int) and value > 0 else None


def load_config(path: str) -> Any:
    """The folder's config; ``ValueError`` naming the fix for a missing folder, no ``config.json``, a model
    type transformers does not know, or one without a causal-LM class."""
    where = f"model.path = {path!r}"
    if not os.path.isdir(path):
        raise ValueError(f"{where} is not a folder: name a local Hugging Face model folder (e.g. one written by "
                         f"save_pretrained, or a downloaded snapshot)")
    if not os.path.isfile(os.path.join(path, CONFIG_FILE)):
        raise ValueError(f"{where} holds no {CONFIG_FILE}: save the model's config there "
                         f"(config.save_pretrained(DIR) or model.save_pretrained(DIR))")
    transformers = _transformers()
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        config = transformers.AutoConfig.from_pretrained(path)
    except (ValueError, OSError, KeyError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"{where}: {CONFIG_FILE} does not load ({first}): fix it, or upgrade transformers for a "
                         f"newer model type (models that need trust_remote_code are not supported)") from None
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ValueError(f"{where}: model type {config.model_type!r} ({type(config).__name__}) is not a causal "
                         f"language model (AutoModelForCausalLM has no class for it): name a decoder folder such "
                         f"as llama, mistral, qwen2 or gpt2")
    return config


def load_tokenizer(path: str) -> HFTokenizer:
    """The folder's tokenizer; ``ValueError`` naming the fix when it has none or it does not load."""
    where = f"model.path = {path!r}"
    if not any(os.path.isfile(os.path.join(path, name)) for name in _TOKENIZER_FILES):
        raise ValueError(f"{where} holds no tokenizer (none of {list(_TOKENIZER_FILES)}): save the model's "
                         f"tokenizer there with tokenizer.save_pretrained(DIR)")
    transformers = _transformers()
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    except (ValueError, OSError, KeyError, ImportError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"{where}: the tokenizer does not load ({first}): save a fast tokenizer there "
                         f"(tokenizer.json) with tokenizer.save_pretrained(DIR)") from None
    return HFTokenizer(tokenizer)


def has_weights(path: str) -> bool:
    """Whether the folder holds safetensors weights; ``ValueError`` when it holds only other formats (never a
    silent random start for a folder that has weights)."""
    if any(os.path.isfile(os.path.join(path, name)) for name in WEIGHT_FILES):
        return True
    other = [name for name in _OTHER_WEIGHTS if os.path.isfile(os.path.join(path, name))]
    if other:
        raise ValueError(f"model.path = {path!r} holds {other[0]} but no model.safetensors: hsdp reads safetensors; "
                         f"convert once with AutoModelForCausalLM.from_pretrained(DIR).save_pretrained(DIR)")
    return False


def hf_shape(path: str, block_size: int, vocab_size: int) -> HFShape:
    """The folder's :class:`HFShape` for a context of ``block_size`` (0: the folder's, at most
    :data:`DEFAULT_CONTEXT`) and a tokenizer of ``vocab_size`` tokens; ``ValueError`` naming the fix when the
    context exceeds the folder's or the tokenizer does not fit the embedding."""
    config = load_config(path)
    context = folder_context(config)
    if block_size and context and block_size > context:
        raise ValueError(f"model.block_size = {block_size}: longer than the model's context "
                         f"(max_position_embeddings = {context} in {path}/{CONFIG_FILE}): set at most {context}")
    if vocab_size > config.vocab_size:
        raise ValueError(f"model.path = {path!r}: the tokenizer has {vocab_size} tokens but {CONFIG_FILE} has "
                         f"vocab_size = {config.vocab_size}: set vocab_size to at least {vocab_size} there (a "
                         f"folder with weights needs them resized: model.resize_token_embeddings)")
    block = block_size or min(context or DEFAULT_CONTEXT, DEFAULT_CONTEXT)
    return HFShape(path, config, block, has_weights(path))


def folder_problem(path: str, block_size: int) -> str | None:
    """Why ``path`` cannot be trained as ``model.kind = "hf"`` (``None``: it can), in one line naming the fix;
    checked before any rank starts (loads the config and the tokenizer, builds the model on the meta device and
    reads the weights' headers, not their values)."""
    try:
        load_config(path)
        shape = hf_shape(path, block_size, load_tokenizer(path).vocab_size)
        if shape.has_weights:
            check_weights(shape)
    except ValueError as e:
        return str(e)
    return None


def _ignorable(model: nn.Module) -> Callable[[str], str | None]:
    """A ``key_map`` dropping the checkpoint names that the model lacks and its class declares ignorable."""
    patterns = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []]
    names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    names |= {n for n, _ in model.named_buffers(remove_duplicate=False)}
    return lambda key: None if key not in names and any(p.search(key) for p in patterns) else key


def check_weights(shape: HFShape) -> None:
    """``ValueError`` naming the fix unless the folder's weights hold every parameter (a tied one under any of
    its names) and persistent buffer of the model its config builds, with its shape, and nothing else: what
    :func:`hsdp.load_pretrained` requires, checked from the headers before any rank starts."""
    from hsdp.engine.init.safetensors_source import SafetensorsSource

    model = build_meta(shape)
    try:
        entries = SafetensorsSource(shape.path, _ignorable(model)).entries
    except ValueError:
        raise
    except Exception as e:  # safetensors' own error for a truncated or corrupt header
        raise ValueError(f"model.path = {shape.path!r}: its safetensors weights do not open ({e}): save them "
                         f"again (model.save_pretrained(DIR))") from None
    holders: dict[int, tuple[tuple[int, ...], list[str]]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        holders.setdefault(id(p), (tuple(p.shape), []))[1].append(name)
    params = {n for _, names in holders.values() for n in names}
    wanted = [(tuple(t.shape), [n]) for n, t in model.state_dict().items() if n not in params]  # persistent buffers
    missing, wrong, used = [], [], set()
    for size, names in [*holders.values(), *wanted]:
        hits = [n for n in names if n in entries]
        used.update(hits)
        if not hits:
            missing.append(names[0])
        elif entries[hits[0]].shape != size:
            wrong.append(f"{hits[0]} {entries[hits[0]].shape} vs {size}")
    unexpected = sorted(set(entries) - used)
    parts = [f"{title} ({len(items)}): {', '.join(items[:3])}{' ...' if len(items) > 3 else ''}"
             for title, items in (("missing", missing), ("unexpected", unexpected), ("shape mismatches", wrong))
             if items]
    if parts:
        raise ValueError(f"model.path = {shape.path!r}: its weights do not fit its {CONFIG_FILE} (" + "; ".join(parts)
                         + "): save the weights and the config together (model.save_pretrained(DIR))")


def build_meta(shape: HFShape) -> nn.Module:
    """``AutoModelForCausalLM`` of the folder's config: parameters on the meta device (fp32), buffers on the
    CPU as its modules compute them, tied weights tied (``tie_weights``). No weights yet: see
    :func:`initialize`."""
    transformers = _transformers()
    try:
        from accelerate import init_empty_weights
    except ImportError:
        raise ValueError(f"model.kind = 'hf' needs accelerate to build the model without memory: {_INSTALL}"
                         ) from None
    try:
        with init_empty_weights(include_buffers=False):
            model = transformers.AutoModelForCausalLM.from_config(shape.config)
    except (ValueError, TypeError, AttributeError, KeyError) as e:  # a config the model class cannot build
        raise ValueError(f"model.path = {shape.path!r}: {CONFIG_FILE} does not build a model ({e}): fix it") from None
    model.tie_weights()
    return model.float()  # fp32 master weights whatever the folder stores; on meta nothing is allocated


def initialize(model: hsdp.ShardedModel, shape: HFShape) -> None:
    """Give the wrapped meta-built model its weights: the folder's (each rank of replica 0 reads its rows) or,
    without any, the model's own ``_init_weights`` module by module (every rank with the same seed)."""
    if shape.has_weights:
        hsdp.load_pretrained(model, shape.path, key_map=_ignorable(model))
    else:
        hsdp.materialize(model, init=model._init_weights)
