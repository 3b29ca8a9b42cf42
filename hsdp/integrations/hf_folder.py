"""Save a ShardedModel as a Hugging Face model folder, every rank taking part.

``PreTrainedModel.save_pretrained`` on a ShardedModel goes wrong in three ways: called on rank 0 alone (as
``Trainer.save_model`` and ``Accelerator.save_model`` do) it all-gathers the DTensor parameters on one rank
and hangs; given a full state dict it still names the architecture after the class hsdp swapped in
(``"ShardedLlamaForCausalLM"``, which ``from_pretrained`` and the Auto classes do not know); and a tied
weight gathered on a GPU arrives as two separate tensors, so both copies would be written.
:func:`save_pretrained` does it in three steps:

1. every rank calls ``hsdp.full_state_dict`` (the collective; the ranks of replica 0 gather, rank 0 keeps the
   full tensors on the CPU);
2. rank 0 gives every tied alias the very tensor of the name it is tied to, so Hugging Face's own tied-weight
   handling stores each tied matrix once, under the name ``from_pretrained`` expects (HF's convention:
   ``lm_head.weight`` left out when ``tie_word_embeddings``), then runs the model's own ``save_pretrained``
   with that state dict and rewrites ``config.json`` with the original class name;
3. every rank returns once rank 0 is done (an agreement: an error on rank 0 raises on every rank), so any rank
   may read the folder right after.

A wrapped model's own ``model.save_pretrained(dir)`` is :func:`save_pretrained` (:class:`PreTrainedSave`, mixed in
at wrap time), so the save a hand-written loop ends with works as written, on every rank.

Memory: rank 0 holds the whole model in host memory while it writes (the price of a consolidated folder).
For training checkpoints use ``hsdp.save_checkpoint`` (sharded, each rank writes its own part).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from transformers import PreTrainedModel

from hsdp.engine.agreement import on_rank0
from hsdp.engine.class_swap import original_class
from hsdp.engine.collectives import Comm
from hsdp.engine.model import ShardedModel
from hsdp.engine.state_dict import full_state_dict


def save_pretrained(model: ShardedModel, save_directory: str | os.PathLike, **kwargs: Any) -> str:
    """Write ``model`` (a ShardedModel of a ``transformers.PreTrainedModel``) to ``save_directory`` as a folder
    ``from_pretrained`` loads: ``config.json`` naming the original architecture, safetensors weights (tied
    weights once, as Hugging Face stores them), ``generation_config.json`` where the model has one. ``kwargs``
    go to ``PreTrainedModel.save_pretrained`` (``max_shard_size``, ``variant``, ...). Returns the directory.

    A collective: call it on every rank (with the same directory). Only rank 0 writes; the others return once
    it has finished. ``ValueError`` (on every rank, before any collective) for a model that is not a
    ShardedModel of a ``PreTrainedModel``: use ``hsdp.full_state_dict`` and safetensors for other modules.
    """
    _check(model, save_directory, kwargs)
    directory = os.fspath(save_directory)
    weights = full_state_dict(model)  # {} except on rank 0
    comm = Comm(model.mesh)  # its own accounting: the save stays out of model.comm_stats()
    with comm.helper("hsdp.integrations.save_pretrained"):
        on_rank0(comm, f"save_pretrained({directory})", lambda: _write(model, weights, directory, kwargs))
    return directory


class PreTrainedSave:
    """Mixed into every wrapped ``transformers.PreTrainedModel`` between ``ShardedModel`` and the model's class (see
    [Note: class extensions] in hsdp/engine/class_swap.py)."""

    def save_pretrained(self, save_directory: str | os.PathLike, is_main_process: bool = True,
                        state_dict: dict[str, Any] | None = None, **kwargs: Any) -> None:
        """Hugging Face's ``save_pretrained`` on a sharded model. Without ``state_dict``: :func:`save_pretrained`, a
        collective (call it on every rank; rank 0 writes, so ``is_main_process`` changes nothing). With a
        consolidated ``state_dict`` (``hsdp.full_state_dict(model)``, called on every rank, full on rank 0): no
        collective, rank 0 writes it when ``is_main_process``, as Hugging Face does."""
        model: ShardedModel = self  # type: ignore[assignment]  # only ever mixed into a ShardedModel
        if state_dict is None:
            save_pretrained(model, save_directory, **kwargs)
            return
        _check(model, save_directory, kwargs)
        check_consolidated(state_dict, "model.save_pretrained(directory)")
        if is_main_process and model.mesh.rank == 0:
            # A copy of the dict (not the tensors): Hugging Face pops the entries it writes.
            _write(model, dict(state_dict), os.fspath(save_directory), kwargs)


def check_consolidated(state_dict: dict[str, Any], call: str) -> None:
    """``ValueError`` for a ``state_dict`` of shards (``model.state_dict()`` of a ShardedModel holds DTensors)."""
    if any(isinstance(v, DTensor) for v in state_dict.values()):
        raise ValueError(f"state_dict holds sharded DTensor parameters (a ShardedModel's state_dict()): pass "
                         f"hsdp.full_state_dict(model) (called on every rank), or leave state_dict out and call "
                         f"{call} on every rank")


def architecture_name(model: ShardedModel) -> str:
    """The class name ``config.json`` must carry: the model's class before hsdp swapped it."""
    return original_class(model, ShardedModel).__name__


def _check(model: Any, save_directory: Any, kwargs: dict[str, Any]) -> None:
    if not isinstance(model, ShardedModel):
        raise ValueError(f"save_pretrained expects a ShardedModel, got {type(model).__name__}: for a plain "
                         f"PreTrainedModel call model.save_pretrained(directory) itself")
    if not isinstance(model, PreTrainedModel):
        raise ValueError(f"{architecture_name(model)} is not a transformers PreTrainedModel: write "
                         f"hsdp.full_state_dict(model) with safetensors instead")
    if not save_directory or not isinstance(save_directory, (str, os.PathLike)):
        raise ValueError(f"save_pretrained needs a directory path, got {save_directory!r}")
    refused = {"state_dict", "is_main_process", "push_to_hub", "distributed_checkpoint"} & kwargs.keys()
    if refused:
        raise ValueError(f"save_pretrained sets {sorted(refused)} itself (rank 0 writes the gathered weights; "
                         f"push the folder afterwards with huggingface_hub): leave them out")


def _write(model: ShardedModel, weights: dict[str, torch.Tensor], directory: str, kwargs: dict[str, Any]) -> None:
    tie_aliases(model, weights)
    # The model class's own method: the wrapped model's is PreTrainedSave's, which would gather again.
    original_class(model, ShardedModel).save_pretrained(model, directory, state_dict=weights, is_main_process=True,
                                                        **kwargs)
    # save_pretrained names the architecture after type(model): hsdp's generated subclass. Write the original.
    model.config.architectures = [architecture_name(model)]
    model.config.save_pretrained(directory)


def tie_aliases(model: ShardedModel, weights: dict[str, torch.Tensor]) -> None:
    """Make every tied alias in ``weights`` (a full state dict) the same tensor object as the first name of its
    parameter. ``full_state_dict`` copies each name to the CPU on its own when the model lives on a GPU, and
    Hugging Face recognises a tie only by shared storage."""
    for p in model.sharded_params():
        first = p.slots[0].fqn
        for slot in p.slots[1:]:
            if slot.fqn in weights and first in weights:
                weights[slot.fqn] = weights[first]
