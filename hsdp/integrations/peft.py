"""A wrapped PEFT model's ``save_pretrained``: the adapter alone, every rank taking part.

LoRA (any PEFT tuner) trains on hsdp as written::

    model = hsdp.ShardedModel(get_peft_model(base, LoraConfig(r=8, target_modules=["q_proj", "v_proj"])), mesh=mesh)
    optimizer = hsdp.ShardedOptimizer(model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad]))
    ...                                                 # the loop; the frozen base weights never change
    model.save_pretrained("adapter")                    # every rank; rank 0 writes adapter_model.safetensors

PEFT's own ``PeftModel.save_pretrained`` reads ``model.state_dict()`` on the calling process and asks each tensor
for its storage, which a DTensor parameter has none of ("invalid python storage"). :class:`PeftSave`, mixed in at
wrap time (see [Note: class extensions] in hsdp/engine/class_swap.py), makes ``model.save_pretrained(dir)``:

1. every rank gathers the adapter's tensors (``hsdp.full_state_dict`` with PEFT's own choice of keys; the ranks of
   replica 0 gather, rank 0 keeps them on the CPU; the frozen base is not kept);
2. rank 0 runs PEFT's ``save_pretrained`` with them: ``adapter_model.safetensors`` and ``adapter_config.json``, as
   for a plain model, so ``PeftModel.from_pretrained(base, dir)`` on a plain base model gives the trained adapter;
3. every rank returns once rank 0 is done (an error on rank 0 raises on every rank).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from peft import PeftModel
from peft.utils import get_peft_model_state_dict

from hsdp.engine.agreement import on_rank0
from hsdp.engine.class_swap import original_class
from hsdp.engine.collectives import Comm
from hsdp.engine.model import ShardedModel
from hsdp.engine.state_dict import full_state_dict
from hsdp.integrations.hf_folder import check_consolidated

__all__ = ["PeftSave", "save_adapter"]


class PeftSave:
    """Mixed into every wrapped ``peft.PeftModel`` between ``ShardedModel`` and the model's class."""

    def save_pretrained(self, save_directory: str | os.PathLike, *, is_main_process: bool = True,
                        **kwargs: Any) -> None:
        """PEFT's ``save_pretrained`` on a sharded model. Without ``state_dict``: :func:`save_adapter`, a
        collective (call it on every rank; rank 0 writes, so ``is_main_process`` changes nothing). With a
        consolidated ``state_dict=`` (``hsdp.full_state_dict(model)``, called on every rank, full on rank 0): no
        collective, rank 0 writes when ``is_main_process``, as PEFT does."""
        model: ShardedModel = self  # type: ignore[assignment]  # only ever mixed into a ShardedModel
        if kwargs.get("state_dict") is None:
            kwargs.pop("state_dict", None)
            save_adapter(model, save_directory, **kwargs)
            return
        _check(model, save_directory, kwargs)
        check_consolidated(kwargs["state_dict"], "model.save_pretrained(directory)")
        if is_main_process and model.mesh.rank == 0:
            _peft_save(model, os.fspath(save_directory), {**kwargs, "state_dict": dict(kwargs["state_dict"])})


def save_adapter(model: ShardedModel, save_directory: str | os.PathLike, **kwargs: Any) -> str:
    """Write the adapter(s) of ``model`` (a ShardedModel of a ``peft.PeftModel``) to ``save_directory`` with PEFT's
    own ``save_pretrained`` (``kwargs`` go to it: ``selected_adapters``, ``safe_serialization``, ...); returns the
    directory. A collective: call it on every rank with the same directory; rank 0 writes, the others return once
    it has finished. ``ValueError`` (on every rank, before any collective) for another model or argument."""
    _check(model, save_directory, kwargs)
    directory = os.fspath(save_directory)
    weights = full_state_dict(model, keep=adapter_keys(model))  # {} except on rank 0
    comm = Comm(model.mesh)  # its own accounting: the save stays out of model.comm_stats()
    with comm.helper("hsdp.integrations.peft.save_adapter"):
        on_rank0(comm, f"save_pretrained({directory})",
                 lambda: _peft_save(model, directory, {**kwargs, "state_dict": weights}))
    return directory


def adapter_keys(model: ShardedModel) -> set[str]:
    """The ``state_dict`` keys PEFT saves for the adapters of ``model``: PEFT's own selection
    (``get_peft_model_state_dict``, every adapter) run on stand-ins of the sharded state dict's values, mapped back
    to their keys by identity (PEFT renames the keys it keeps, not the values). The stand-ins are empty tensors of
    each value's full shape and dtype on the meta device: given the DTensors themselves, PEFT 0.22 and later gathers
    the ones it selects into new CPU tensors (a collective per tensor, and no identity left to map back)."""
    stand_ins = {key: _stand_in(value) for key, value in model.state_dict(keep_vars=True).items()}
    kept: set[int] = set()
    for name in model.peft_config:
        chosen = get_peft_model_state_dict(model, state_dict=stand_ins, adapter_name=name)
        kept |= {id(v) for v in chosen.values()}
    return {key for key, value in stand_ins.items() if id(value) in kept}


def _stand_in(value: Any) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    return torch.empty(value.shape, dtype=value.dtype, device="meta")


def _check(model: Any, save_directory: Any, kwargs: dict[str, Any]) -> None:
    if not isinstance(model, ShardedModel) or not isinstance(model, PeftModel):
        raise ValueError(f"save_adapter expects a ShardedModel of a peft.PeftModel, got {type(model).__name__}: for "
                         f"a plain PeftModel call model.save_pretrained(directory) itself")
    if not save_directory or not isinstance(save_directory, (str, os.PathLike)):
        raise ValueError(f"save_pretrained needs a directory path, got {save_directory!r}")
    if os.path.isfile(save_directory):
        raise ValueError(f"save_pretrained({save_directory}): the path is a file; pass a directory")
    if kwargs.get("push_to_hub"):
        raise ValueError("push_to_hub: rank 0 writes the adapter; push the folder afterwards with huggingface_hub")


def _peft_save(model: ShardedModel, directory: str, kwargs: dict[str, Any]) -> None:
    # The model class's own method: the wrapped model's is PeftSave's, which would gather again.
    original_class(model, ShardedModel).save_pretrained(model, directory, is_main_process=True, **kwargs)
