"""``ShardedGradScaler``: fp16 loss scaling whose "found inf" every rank agrees on.

``torch.amp.GradScaler`` checks the gradients a rank holds. On a ShardedModel each rank holds only its chunk
(or its replica slice), so an overflow in one rank's chunk would make that rank skip the step while the others
step: the replicas diverge, silently. This subclass checks the local chunks (DTensor dispatch is not needed
for an element-wise check) and takes the maximum of the found-inf flags over the whole mesh (one scalar
all-reduce per step), so every rank skips the same steps and lowers its scale alike. fp16 gradients (a
model converted with ``.half()``) are unscaled in place, as FSDP's scaler does; with
``MixedPrecision(param_dtype=torch.float16)`` they are fp32. Everything else, including ``scale``, ``step``,
``update`` and the state dict, is torch's.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist

from hsdp.engine.model import ShardedModel
from hsdp.engine.runtime.dtensor import local_of


class ShardedGradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` for a :class:`~hsdp.ShardedModel` (use it exactly like torch's)."""

    def __init__(self, model: ShardedModel, **kwargs: object) -> None:
        if not isinstance(model, ShardedModel):
            raise ValueError("ShardedGradScaler needs the ShardedModel: ShardedGradScaler(model, init_scale=...)")
        kwargs.setdefault("device", model.mesh.device.type)
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self._hsdp_model = model

    def _unscale_grads_(self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor,
                        allow_fp16: bool) -> dict[torch.device, torch.Tensor]:
        grads: dict[torch.dtype, list[torch.Tensor]] = defaultdict(list)
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                # fp16 gradients are allowed (torch refuses them unless the parameters are fp32): a model
                # converted with .half() has fp16 shards, and FSDP's scaler allows them too.
                grads[param.grad.dtype].append(local_of(param.grad))
        device = found_inf.device
        with torch.no_grad():
            for same in grads.values():
                torch._amp_foreach_non_finite_check_and_unscale_(same, found_inf, inv_scale)
            # Every rank skips the step if any rank's chunk overflowed.
            self._hsdp_model.comm.all_reduce(found_inf, "world", op=dist.ReduceOp.MAX, label="found inf")
        return {device: found_inf}
