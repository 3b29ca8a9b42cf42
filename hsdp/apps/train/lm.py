"""The language models ``hsdp train`` builds, one adapter per ``model.kind``: check, tokenizer, shape, build,
initialise, wrap, logits, loss.

``gpt``: :class:`hsdp.models.GPT` (``forward(idx, targets) -> (logits, loss)``). ``hf-gpt2``: a Hugging
Face ``GPT2LMHeadModel`` of the same shape with random weights (built from a config, nothing is
downloaded; its tied ``wte``/``lm_head`` matrix stays one parameter under hsdp). ``hf``: any local Hugging
Face causal-LM folder (``model.path``) with its own tokenizer and, when it has them, its weights
(:mod:`hsdp.apps.train.hf_folder`): built on the meta device and given its weights after wrapping. All see
the same ``(x, y)`` batches, ``y`` being ``x`` shifted by one token, and the same loss: mean cross entropy.
The kind is looked up once in :data:`LANGUAGE_MODELS`; nothing else in the job dispatches on it, including
whether it can be tensor-parallel (``parallel.tensor_parallel``): ``gpt`` has :func:`hsdp.tp_plans.gpt_plan`,
``hf-gpt2`` and ``hf`` have no plan here and are refused before any rank starts.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn import functional as F

from hsdp.apps.train import hf_folder
from hsdp.engine.wrap import WrapPolicy
from hsdp.models import GPT, GPTConfig, generate
from hsdp.models.tp_plans import check_gpt_divisible, gpt_plan

if TYPE_CHECKING:
    from hsdp.apps.train.tokenizing import DocumentTokenizer
    from hsdp.engine.model import ShardedModel


class ModelSection(Protocol):
    """What an adapter reads of the model section (``config.ModelConfig``): a protocol, so this module does not
    import the configuration, which looks the kinds up here."""

    kind: str
    path: str
    block_size: int

    def shape(self, vocab_size: int) -> GPTConfig: ...


class LanguageModel(Protocol):
    """How the job builds, wraps and runs one kind of model. A kind turns the model section (and the
    tokenizer's vocabulary) into a shape that has a ``block_size`` (the built-in kinds: the preset's GPT
    shape), builds it, initialises it after wrapping, and maps token ids to logits and a next-token loss."""

    # ShardedModel's units; None: the engine's default, one unit per block of the repeated stack.
    wrap: WrapPolicy

    def problem(self, model: ModelSection) -> str | None:
        """Why ``model`` cannot be built here (a missing package, a bad folder), naming the fix; ``None`` when
        it can. Checked before any rank starts; no process group."""
        ...

    def tokenizer(self, model: ModelSection) -> DocumentTokenizer | None:
        """The model's own tokenizer, or ``None`` to use ``data.tokenizer``'s."""
        ...

    def shape(self, model: ModelSection, vocab_size: int) -> Any:
        """What :meth:`build` builds, with a ``block_size`` (the context) and the vocabulary ``vocab_size``."""
        ...

    def build(self, shape: Any) -> nn.Module:
        """A model of ``shape``: freshly initialised (from torch's global generator), or with its parameters
        on the meta device, which :meth:`initialize` fills."""
        ...

    def initialize(self, model: ShardedModel, shape: Any) -> None:
        """Give the wrapped model its weights when :meth:`build` left them on the meta device; every rank calls
        it, with the same generator state."""
        ...

    def logits(self, model: nn.Module, idx: torch.Tensor) -> torch.Tensor:
        """``(B, T, vocab)`` logits of token ids ``idx`` ``(B, T)``."""
        ...

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross entropy of predicting ``y`` from ``x``."""
        ...

    def tp_problem(self, shape: GPTConfig, tp: int) -> str | None:
        """Why a model of ``shape`` cannot be split over ``tp`` tensor-parallel ranks (no plan for this kind,
        or a width not divisible by ``tp``), naming the fix; ``None`` when it can. Pure: no process group."""
        ...

    def parallelize(self, model: nn.Module, tp_mesh: DeviceMesh) -> nn.Module:
        """Tensor-parallelize ``model`` in place over the 1-D ``tp_mesh`` (sequence parallel: every batch's
        length must be divisible by its size); only when :meth:`tp_problem` is ``None``."""
        ...


class _PresetShaped:
    """The built-in kinds: the preset's GPT shape, data.tokenizer's tokens, weights drawn by :meth:`build`."""

    def problem(self, model: ModelSection) -> str | None:
        return None

    def tokenizer(self, model: ModelSection) -> DocumentTokenizer | None:
        return None

    def shape(self, model: ModelSection, vocab_size: int) -> GPTConfig:
        return model.shape(vocab_size)

    def initialize(self, model: ShardedModel, shape: Any) -> None:
        return None  # built with its weights (rank 0's are broadcast by ShardedModel)


class HsdpGPT(_PresetShaped):
    """``model.kind = "gpt"``: hsdp's own GPT, whose forward computes the loss itself."""

    wrap: WrapPolicy = None

    def build(self, shape: GPTConfig) -> nn.Module:
        return GPT(shape)

    def logits(self, model: nn.Module, idx: torch.Tensor) -> torch.Tensor:
        return model(idx)[0]

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return model(x, y)[1]

    def tp_problem(self, shape: GPTConfig, tp: int) -> str | None:
        try:
            check_gpt_divisible(shape, tp)
        except ValueError as e:
            return str(e)
        return None

    def parallelize(self, model: nn.Module, tp_mesh: DeviceMesh) -> nn.Module:
        assert isinstance(model, GPT)
        return gpt_plan(model, tp_mesh, sequence_parallel=True)


_NO_GPT2_PLAN = ("Hugging Face GPT-2 has no tensor-parallel plan (hsdp.tp_plans has hsdp's GPT and Hugging Face "
                 "Llama): set model.kind = 'gpt', or parallel.tensor_parallel = 1")


def _causal_lm_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    # Not the model's own loss (labels=): that would shift by one token again, and ours are shifted already.
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1))


class HuggingFaceGPT2(_PresetShaped):
    """``model.kind = "hf-gpt2"``: ``GPT2LMHeadModel`` (needs the ``hf`` extra)."""

    wrap: WrapPolicy = None

    def problem(self, model: ModelSection) -> str | None:
        if importlib.util.find_spec("transformers") is None:
            return "model.kind = 'hf-gpt2' needs Hugging Face transformers: pip install 'hsdp[hf]'"
        return None

    def build(self, shape: GPTConfig) -> nn.Module:
        try:
            from transformers import GPT2Config, GPT2LMHeadModel
        except ImportError:
            raise ValueError("model.kind = 'hf-gpt2' needs Hugging Face transformers: pip install 'hsdp[hf]'"
                             ) from None
        # bos/eos default to GPT-2's 50256, outside a byte or character vocabulary: transformers warns.
        config = GPT2Config(vocab_size=shape.vocab_size, n_positions=shape.block_size, n_embd=shape.n_embd,
                            n_layer=shape.n_layer, n_head=shape.n_head, resid_pdrop=shape.dropout,
                            embd_pdrop=shape.dropout, attn_pdrop=shape.dropout, bos_token_id=0, eos_token_id=0,
                            tie_word_embeddings=shape.tie_embeddings)
        return GPT2LMHeadModel(config)

    def logits(self, model: nn.Module, idx: torch.Tensor) -> torch.Tensor:
        return model(input_ids=idx).logits

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return _causal_lm_loss(self.logits(model, x), y)

    def tp_problem(self, shape: GPTConfig, tp: int) -> str | None:
        return _NO_GPT2_PLAN

    def parallelize(self, model: nn.Module, tp_mesh: DeviceMesh) -> nn.Module:
        raise ValueError(_NO_GPT2_PLAN)


_NO_FOLDER_PLAN = ("model.kind = 'hf' has no tensor-parallel plan in hsdp train (from Python, hsdp.tp_plans.llama_plan "
                   "splits Llama-style models): set parallel.tensor_parallel = 1")


class HuggingFaceFolder:
    """``model.kind = "hf"``: the causal LM of the folder ``model.path``, with its tokenizer; its weights or its
    own initialisation, given after wrapping (see :mod:`hsdp.apps.train.hf_folder`)."""

    wrap: WrapPolicy = None

    def problem(self, model: ModelSection) -> str | None:
        return hf_folder.folder_problem(model.path, model.block_size)

    def tokenizer(self, model: ModelSection) -> DocumentTokenizer | None:
        hf_folder.load_config(model.path)  # a missing folder or config.json is named before the tokenizer
        return hf_folder.load_tokenizer(model.path)

    def shape(self, model: ModelSection, vocab_size: int) -> hf_folder.HFShape:
        return hf_folder.hf_shape(model.path, model.block_size, vocab_size)

    def build(self, shape: hf_folder.HFShape) -> nn.Module:
        return hf_folder.build_meta(shape)

    def initialize(self, model: ShardedModel, shape: hf_folder.HFShape) -> None:
        hf_folder.initialize(model, shape)

    def logits(self, model: nn.Module, idx: torch.Tensor) -> torch.Tensor:
        return model(input_ids=idx, use_cache=False).logits  # no key/value cache: training, full sequences

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return _causal_lm_loss(self.logits(model, x), y)

    def tp_problem(self, shape: Any, tp: int) -> str | None:
        return _NO_FOLDER_PLAN

    def parallelize(self, model: nn.Module, tp_mesh: DeviceMesh) -> nn.Module:
        raise ValueError(_NO_FOLDER_PLAN)


LANGUAGE_MODELS: dict[str, LanguageModel] = {"gpt": HsdpGPT(), "hf-gpt2": HuggingFaceGPT2(),
                                             "hf": HuggingFaceFolder()}


def parameter_count(model: nn.Module) -> int:
    """Distinct parameters: ``parameters()`` yields a tied matrix once."""
    return sum(p.numel() for p in model.parameters())


def describe(model: nn.Module, block_size: int) -> str:
    """``"GPT, 215,232 parameters, context 64"``: the class (call it before wrapping renames the class),
    the distinct parameters and the context length."""
    return f"{type(model).__name__}, {parameter_count(model):,} parameters, context {block_size}"


def pad_sequence_to(logits_fn: Callable[[torch.Tensor], torch.Tensor], multiple: int,
                    ) -> Callable[[torch.Tensor], torch.Tensor]:
    """``logits_fn`` for ids of any length under sequence parallel, which needs a multiple of the TP degree:
    the ids are padded on the right (with their last id) and the padding's logits dropped. Exact for a
    causal model: position ``i``'s logits never see positions after ``i``. The padded length stays within
    the context when the context is a multiple of ``multiple`` (validated with ``parallel.tensor_parallel``)."""
    if multiple == 1:
        return logits_fn

    def padded(idx: torch.Tensor) -> torch.Tensor:
        t = idx.size(1)
        extra = -t % multiple
        if not extra:
            return logits_fn(idx)
        return logits_fn(torch.cat([idx, idx[:, -1:].expand(-1, extra)], dim=1))[:, :t]

    return padded


def sample(logits_fn: Callable[[torch.Tensor], torch.Tensor], prompt: list[int], tokens: int, block_size: int,
           *, seed: int = 0, temperature: float = 0.8, top_k: int = 20) -> list[int]:
    """``prompt`` followed by ``tokens`` sampled ids (:func:`hsdp.models.generate`). Exactly one forward
    per new token: under a ShardedModel every rank must call it with the same ``tokens``."""
    g = torch.Generator().manual_seed(seed)
    # On the CPU: the generator is a CPU one, whatever device the model runs on.
    idx = generate(lambda ids: logits_fn(ids).float().cpu(), torch.tensor([prompt], dtype=torch.long), tokens,
                   block_size, temperature=temperature, top_k=top_k, generator=g)
    return idx[0].tolist()
