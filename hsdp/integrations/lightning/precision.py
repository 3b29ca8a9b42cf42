"""Lightning's ``precision=`` flag as hsdp's mixed precision policy, instead of autocast.

``"bf16-mixed"`` becomes ``hsdp.MixedPrecision(param_dtype=bfloat16, reduce_dtype=float32,
output_dtype=float32)``: the all-gathers and the forward/backward run in bf16 on bf16 copies of the fp32
master shards (which the optimizer steps, with fp32 state), gradients are reduced in fp32, and the model's
outputs come back as fp32 (so the loss is computed in fp32, as under Lightning's autocast). No autocast
runs: hsdp casts the parameters and the root's floating inputs. ``"32-true"`` (the default) changes nothing.

Every other flag is refused with a ``ValueError`` naming the fix, when the ``Trainer``/``Fabric`` is built:
fp16 needs a loss scaler over the whole mesh (``hsdp.ShardedGradScaler``, in a loop of your own), and the
``-true`` half precisions would make the master shards half precision too.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.fabric.plugins.precision import MixedPrecision as FabricMixedPrecision
from lightning.fabric.plugins.precision import Precision as FabricPrecision
from lightning.pytorch.plugins.precision import MixedPrecision as TrainerMixedPrecision
from lightning.pytorch.plugins.precision import Precision as TrainerPrecision
from torch.optim import Optimizer

from hsdp.engine.clip import clip_grad_norm_
from hsdp.engine.model import ShardedModel
from hsdp.engine.policy import MixedPrecision

SUPPORTED = ("32-true", "bf16-mixed")
BF16_MIXED = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32)


class HSDPPrecisionBase:
    """What both frameworks' HSDP precision plugins share: the flag, its policy, the model to clip."""

    precision: str

    def __init__(self, precision: str = "32-true") -> None:
        if precision not in SUPPORTED:
            raise ValueError(refusal(precision))
        self.precision = precision
        self._model: ShardedModel | None = None

    @property
    def policy(self) -> MixedPrecision | None:
        """The ``hsdp.MixedPrecision`` this flag stands for (``None``: full precision)."""
        return BF16_MIXED if self.precision == "bf16-mixed" else None

    def attach(self, model: ShardedModel) -> None:
        """The model whose gradients are clipped by norm (the strategy calls it after wrapping)."""
        self._model = model


class HSDPPrecision(HSDPPrecisionBase, TrainerPrecision):
    """The Trainer's precision plugin under ``HSDPStrategy``: no autocast (hsdp casts, see the module doc);
    ``gradient_clip_val`` by norm clips through ``hsdp.clip_grad_norm_`` (the norm of the whole gradient, reduced
    in the node only, counted in ``model.comm_stats()``)."""

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: float) -> None:
        if self._model is None:  # not attached (used outside the strategy): torch's, which takes DTensors too
            super().clip_grad_by_norm(optimizer, clip_val)
            return
        clip_grad_norm_(self._model, clip_val)


class HSDPFabricPrecision(HSDPPrecisionBase, FabricPrecision):
    """Fabric's precision plugin under ``HSDPFabricStrategy``: no autocast, inputs and outputs unchanged (hsdp
    casts them); ``fabric.clip_gradients`` goes through the strategy (``hsdp.clip_grad_norm_``)."""


def as_hsdp_precision(plugin: Any, kind: type[HSDPPrecisionBase]) -> Any:
    """The ``kind`` plugin for the one Lightning's connector chose from ``precision=``; ``ValueError`` for
    others (raised while the Trainer or Fabric is built, before any process group exists)."""
    if plugin is None or isinstance(plugin, kind):
        return plugin
    if type(plugin) in (FabricPrecision, TrainerPrecision):
        return kind("32-true")
    mixed = isinstance(plugin, (FabricMixedPrecision, TrainerMixedPrecision))
    if mixed and plugin.precision == "bf16-mixed":
        return kind("bf16-mixed")
    raise ValueError(refusal(getattr(plugin, "precision", type(plugin).__name__)))


def refusal(flag: object) -> str:
    return (f"HSDPStrategy does not run precision={flag!r}: use precision='32-true' (the default) or "
            f"'bf16-mixed' (hsdp.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32): bf16 "
            f"compute on fp32 master shards, no autocast); for other dtypes keep precision='32-true' and pass "
            f"HSDPStrategy(mixed_precision=hsdp.MixedPrecision(...)); fp16 needs hsdp.ShardedGradScaler in a loop of "
            f"your own")
