"""``torch.optim.Adafactor`` on a ShardedModel: torch's update, with its whole-tensor reductions summed over
the shard group.

[Note: Adafactor on dim-0 shards]
Adafactor is element-wise but for a few reductions over whole tensors: the RMS of each parameter (the step
size), the RMS of each update (clipping) and, for a matrix (rows, cols), the column means of g^2 and the
mean of the row factor, both over the rows that dim-0 shards split. On plain chunks these are silently
wrong (an empty chunk divides by zero); through DTensor dispatch, torch's
``torch.norm(grad, dim=-2).square_()`` fails: the norm over the sharded dim is a pending
``_NormPartial`` that an in-place op cannot keep, and the ``.item()`` calls would reduce with collectives
hsdp does not see, some over the replicate mesh dim. Here every such reduction is a local fp32 sum of
squares and one all-reduce (SUM) in the shard group: two per parameter group and step, a few floats per
parameter plus ``cols`` per matrix. Nothing crosses replicas: they hold identical gradient shards.

State keeps torch's names and shapes, as DTensors on the model's mesh: ``row_var`` (``(*shape[:-1], 1)``)
and ``variance`` (1-D) split by dim 0 like the parameter; ``col_var`` (``(*shape[:-2], 1, cols)``)
replicated for a matrix, split by dim 0 for higher ranks (whose dim -2 is not the sharded dim).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from hsdp.engine.collectives import Comm
from hsdp.engine.runtime.dtensor import local_of, replicated_dtensor, to_sharded_dtensor
from hsdp.engine.runtime.layout import ShardLayout
from hsdp.engine.runtime.sharded_param import ShardedParam

if TYPE_CHECKING:
    from hsdp.engine.model import ShardedModel


def state_is_replicated(key: str, param_ndim: int) -> bool:
    """Whether per-parameter state ``key`` is the same full tensor on every rank (a matrix's ``col_var``)."""
    return key == "col_var" and param_ndim == 2


def adafactor_step(optimizer: torch.optim.Adafactor, model: ShardedModel) -> None:
    """One ``torch.optim.Adafactor`` step over ``model``'s shards, equal to Adafactor on the unsharded model.

    A collective in the shard group (two small all-reduces per parameter group): every rank must call it.
    """
    comm = model.comm
    by_param = {id(sp.sharded): sp for sp in model.sharded_params()}
    with torch.no_grad():
        for group in optimizer.param_groups:
            items = [_prepare(optimizer.state[p], by_param[id(p)], group) for p in group["params"]
                     if p.grad is not None]
            if items:
                _group_step(comm, group, items)


@dataclass
class _Item:
    """One parameter in a step: its local chunks and state (``grad`` with ``maximize`` applied)."""

    sp: ShardedParam
    param: torch.Tensor
    grad: torch.Tensor
    state: dict
    step: float


def _prepare(state: dict, sp: ShardedParam, group: dict) -> _Item:
    if torch.is_complex(sp.sharded):
        raise RuntimeError("Adafactor does not support complex parameters")
    if not state:
        _init_state(state, sp)
    state["step"] += 1
    grad = sp.grad_local
    return _Item(sp, sp.sharded_local, -grad if group["maximize"] else grad, state, state["step"].item())


def _init_state(state: dict, sp: ShardedParam) -> None:
    """Torch's initial state (zeros; ``step`` a CPU scalar), in this module's layouts."""
    shape, mesh = sp.layout.global_shape, sp.device_mesh
    state["step"] = torch.tensor(0.0, dtype=torch.get_default_dtype())
    if len(shape) > 1:
        state["row_var"] = _sharded_zeros((*shape[:-1], 1), sp, mesh)
        col_shape = (*shape[:-2], 1, shape[-1])
        state["col_var"] = (_replicated_zeros(col_shape, sp, mesh) if state_is_replicated("col_var", len(shape))
                            else _sharded_zeros(col_shape, sp, mesh))
    else:
        state["variance"] = _sharded_zeros(shape, sp, mesh)


def _sharded_zeros(shape: tuple[int, ...], sp: ShardedParam, mesh: DeviceMesh) -> DTensor:
    layout = ShardLayout(shape, sp.layout.sharding_degree, sp.layout.shard_rank)
    local = torch.zeros(layout.local_shape, dtype=sp.dtype, device=sp.device)
    return to_sharded_dtensor(local, mesh, shape, layout.placements)


def _replicated_zeros(shape: tuple[int, ...], sp: ShardedParam, mesh: DeviceMesh) -> DTensor:
    return replicated_dtensor(torch.zeros(shape, dtype=sp.dtype, device=sp.device), mesh)


def _group_step(comm: Comm, group: dict, items: list[_Item]) -> None:
    lr, d, wd, beta2_decay = float(group["lr"]), group["d"], group["weight_decay"], group["beta2_decay"]
    eps1, eps2 = group["eps"]
    if eps1 is None:
        eps1 = torch.finfo(items[0].param.dtype).eps  # torch takes the first parameter's dtype too
    # Phase 1: row factors (local rows), then one all-reduce of the parameters' sums of squares and, per
    # matrix, the column sums of g^2 and the sum of the row factor.
    parts: list[torch.Tensor] = []
    for it in items:
        parts.append(_counted_once(it, it.param.float().square().sum().reshape(1)))
        if it.grad.dim() > 1:
            row_mean = torch.norm(it.grad, dim=-1, keepdim=True).square_().div_(it.grad.size(-1))
            local_of(it.state["row_var"]).lerp_(row_mean, it.step ** beta2_decay)
            if it.grad.dim() == 2:
                parts.append(it.grad.float().square().sum(dim=0))
                parts.append(local_of(it.state["row_var"]).float().sum().reshape(1))
    sums = _Sums(comm, parts)
    # Phase 2: the updates; one more all-reduce for their sums of squares (the clipping RMS). Torch's
    # per-parameter scalars (step size, clipping denominator) stay on the device as 0-d fp32 tensors: no
    # host read per parameter (a device sync each on CUDA).
    alphas, updates, update_sq = [], [], []
    for it in items:
        numel = math.prod(it.sp.layout.global_shape)
        rho = min(lr, 1 / (it.step ** 0.5))
        alphas.append(sums.scalar().sqrt().div_(numel ** 0.5).clamp_(min=eps2).mul_(rho))
        if wd != 0:
            it.param.mul_(1 - lr * wd)
        var_estimate = _variance_estimate(it, sums, beta2_decay, eps1)
        update = var_estimate.clamp_(min=eps1 * eps1).rsqrt_().mul_(it.grad)
        updates.append(update)
        update_sq.append(_counted_once(it, update.float().square().sum().reshape(1)))
    totals = _Sums(comm, update_sq)
    for it, alpha, update in zip(items, alphas, updates, strict=True):
        numel = math.prod(it.sp.layout.global_shape)
        denom = totals.scalar().sqrt().div_(numel ** 0.5 * d).clamp_(min=1.0)
        # In fp32 as torch's Python-float alpha is (not rounded to a low-precision parameter's dtype).
        it.param.sub_(update.float().mul_(alpha / denom))


def _counted_once(it: _Item, local_sum: torch.Tensor) -> torch.Tensor:
    """A replicated (0-d) parameter is whole on every shard rank: only shard rank 0 adds it to a sum."""
    replicated = it.sp.layout.replicated and it.sp.layout.shard_rank != 0
    return torch.zeros_like(local_sum) if replicated else local_sum


def _variance_estimate(it: _Item, sums: _Sums, beta2_decay: float, eps1: float) -> torch.Tensor:
    """Torch's second-moment estimate for this chunk; ``sums`` yields the matrix's reduced column and row
    factor sums (consumed here, in phase 1's order)."""
    grad, state, beta = it.grad, it.state, it.step ** beta2_decay
    if grad.dim() <= 1:
        variance = local_of(state["variance"])
        variance.lerp_(grad * grad, beta)
        return variance.clone()
    row_var, col_var = local_of(state["row_var"]), local_of(state["col_var"])
    if grad.dim() == 2:
        rows = it.sp.layout.rows
        col_var.lerp_(sums.tensor(grad.size(-1)).to(grad.dtype).div(rows).view(1, -1), beta)
        row_mean = sums.scalar().div(rows).to(grad.dtype)
    else:  # dim -2 is not the sharded dim: torch's own local reductions
        col_var.lerp_(torch.norm(grad, dim=-2, keepdim=True).square_().div_(grad.size(-2)), beta)
        row_mean = row_var.mean(dim=-2, keepdim=True)
    return (row_var @ col_var).div_(row_mean.clamp(min=eps1))


class _Sums:
    """The concatenated fp32 ``parts`` summed over the shard group, read back in order as device views (0-d
    scalars, 1-D vectors): no host copy, so no device sync."""

    def __init__(self, comm: Comm, parts: list[torch.Tensor]) -> None:
        self._flat = torch.cat(parts)
        comm.all_reduce(self._flat, "shard", op=dist.ReduceOp.SUM, label="adafactor")
        self._at = 0

    def scalar(self) -> torch.Tensor:
        self._at += 1
        return self._flat[self._at - 1]

    def tensor(self, n: int) -> torch.Tensor:
        self._at += n
        return self._flat[self._at - n: self._at]
