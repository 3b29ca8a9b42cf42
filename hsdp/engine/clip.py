"""Gradient clipping over a sharded model: the norm of the whole gradient, not of this rank's shards."""

from __future__ import annotations

import math
import warnings
from typing import Literal

import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard

from hsdp.engine.model import ShardedModel
from hsdp.engine.runtime.layout import ShardLayout

NonFinite = Literal["warn", "skip", "error"]


def clip_grad_norm_(model: ShardedModel, max_norm: float, norm_type: float = 2.0, *,
                    on_nonfinite: NonFinite = "warn") -> torch.Tensor:
    """Scale every gradient so the total ``norm_type`` norm is at most ``max_norm``; return the total norm.

    Equal to ``torch.nn.utils.clip_grad_norm_`` on the unsharded model (tied parameters count once). A
    collective in the shard group only: after the backward, replicas hold identical gradient shards, so
    no inter-node bytes are spent; with ``shard_optimizer_across_replicas`` each rank holds a 1/(R x S)
    slice instead and the norm is reduced over the whole mesh (a few bytes across nodes); on replicas of
    different shard degrees one scalar more crosses nodes, so that every replica clips by the same norm to
    the bit (their sums round differently). Under ``replica_sync=hsdp.DiLoCo`` each replica clips its inner
    gradient by its own norm (DiLoCo's workers are independent between syncs): the shard group only. The norm
    is returned on every rank.

    Non-finite norm: ``"warn"`` clips nothing and warns; ``"skip"`` also drops every gradient (sets it to
    ``None``) so the next ``optimizer.step()`` changes nothing; ``"error"`` raises ``FloatingPointError``.

    Host reads: with ``"warn"`` none. The scale is chosen on the device (1 for a non-finite norm) and the
    warning is raised at hsdp's next host read (the end of a backward that reads the "has gradient" flags,
    else just before the optimizer step: at most one per step), costing no device sync now.
    ``"skip"`` and ``"error"`` must know now and read the norm (one device sync per call on CUDA).
    """
    if not isinstance(model, ShardedModel):
        raise ValueError("hsdp.clip_grad_norm_ expects a ShardedModel; use torch.nn.utils.clip_grad_norm_ otherwise")
    if on_nonfinite not in ("warn", "skip", "error"):
        raise ValueError(f"on_nonfinite must be 'warn', 'skip' or 'error', got {on_nonfinite!r}")
    sliced = model.shards_optimizer_across_replicas
    # A replicated (0-d) parameter's gradient is whole on every shard rank (and every replica, when the rest
    # is sliced across replicas): count it once.
    first = model.mesh.shard_rank == 0 and (not sliced or model.mesh.replicate_rank == 0)
    counted = [p for p in model.sharded_params() if not p.layout.replicated or first]
    # Tensor parallelism: a TP-split gradient's parts are summed over the tp group too; a TP-replicated one
    # is whole on every tp rank and counted once.
    split = [g for g in (p.grad_local for p in counted if _tp_split(p.layout)) if g is not None]
    grads = [g for g in (p.grad_local for p in counted if not _tp_split(p.layout)) if g is not None]
    with model.comm.phase("hsdp.clip_grad_norm_"):
        total = _total_norm(model, grads, split, float(norm_type), _norm_groups(model, sliced))
        # Under DiLoCo the replicas' inner gradients differ by design: each clips by its own norm, as DiLoCo's
        # workers do (and nothing crosses nodes between syncs).
        if not model.mesh.replicas.regular and not sliced and model._hsdp_state.replica_sync is None:
            total = _agree(model, total)
    if on_nonfinite == "warn":
        model._hsdp_state.step_read.defer(total, _warn_if_nonfinite)
    elif not torch.isfinite(total):
        _handle_nonfinite(model, total, on_nonfinite)
        return total
    # Non-finite (only reachable with "warn"): scale by 1, i.e. clip nothing, without asking the host.
    coef = torch.where(torch.isfinite(total), torch.clamp(max_norm / (total + 1e-6), max=1.0), 1.0)
    every = [g for g in (p.grad_local for p in model.sharded_params()) if g is not None]
    if every:
        torch._foreach_mul_(every, coef.to(every[0].device))
    return total


def _warn_if_nonfinite(value: float) -> None:
    if not math.isfinite(value):
        warnings.warn(f"the total gradient norm of the last hsdp.clip_grad_norm_ was {value}: nothing was "
                      "clipped, the optimizer stepped on it; lower the LR or check the data", RuntimeWarning,
                      stacklevel=2)


def _tp_split(layout: ShardLayout) -> bool:
    return layout.tp is not None and isinstance(layout.tp.placement, Shard)


def _norm_groups(model: ShardedModel, sliced: bool) -> tuple[str, ...]:
    """Where the gradient's parts lie apart, the tp group aside: the shard group, and with the optimizer sharded
    across replicas the replicas too (the world without tensor parallelism, one collective; with it the shard
    and the replicate groups, so that the tp ranks' copies of a TP-replicated part count once)."""
    if not sliced:
        return ("shard",)
    return ("world",) if model.comm.size("tp") == 1 else ("shard", "replicate")


def _total_norm(model: ShardedModel, grads: list[torch.Tensor], split: list[torch.Tensor], p: float,
                groups: tuple[str, ...]) -> torch.Tensor:
    """The norm over ``groups`` of ``grads`` and over ``groups`` and the tp group of ``split`` (TP-split)."""
    device = model.mesh.device
    comm = model.comm
    if math.isinf(p):
        every = grads + split
        local = torch.stack([g.detach().abs().max() for g in every if g.numel()] or [torch.zeros((), device=device)])
        total = local.max().float().reshape(1)
        for group in (*groups, "tp"):
            comm.all_reduce(total, group, op=dist.ReduceOp.MAX, label="grad norm")
        return total[0]
    sums = torch.zeros(2, device=device, dtype=torch.float32)  # [TP-replicated or no TP, TP-split]
    for i, part in enumerate((grads, split)):
        for g in part:
            sums[i] += torch.linalg.vector_norm(g.detach(), p, dtype=torch.float32) ** p
    for group in groups:
        comm.all_reduce(sums, group, op=dist.ReduceOp.SUM, label="grad norm")
    if split or comm.size("tp") > 1:  # every tp rank takes part, with or without split gradients of its own
        tp_part = sums[1:].clone()
        comm.all_reduce(tp_part, "tp", op=dist.ReduceOp.SUM, label="grad norm")
        return (sums[0] + tp_part[0]) ** (1.0 / p)
    return (sums[0] + sums[1]) ** (1.0 / p)


def _agree(model: ShardedModel, total: torch.Tensor) -> torch.Tensor:
    """Replicas of different shard degrees sum the same squares in different orders, so their norms may differ
    in the last bit, and so would their clipped gradients: the replicas would drift apart a rounding at a time
    (``check_replicas`` reports it). One scalar's all-reduce (the largest) gives every replica the same norm."""
    agreed = total.reshape(1).clone()
    model.comm.all_reduce(agreed, "world", op=dist.ReduceOp.MAX, label="grad norm")
    layer = model.mesh.replicas
    if layer.outside_world:  # the world was this replica's job (elastic): across replicas over the position groups
        try:
            for group in layer.own_position_groups():
                model.comm.replica_view(group).all_reduce(agreed, "replicate", op=dist.ReduceOp.MAX,
                                                          label="grad norm")
        except RuntimeError as e:  # a member died since the step's hop: the step is discarded, as a failed hop's
            if not layer.step_failed(f"grad norm agreement: {type(e).__name__}: {e}"):
                raise
    return agreed[0]


def _handle_nonfinite(model: ShardedModel, total: torch.Tensor, on_nonfinite: NonFinite) -> None:
    message = f"total gradient norm is {total.item()}"
    if on_nonfinite == "error":
        raise FloatingPointError(message + ": the loss or a gradient overflowed; lower the LR or check the data")
    if on_nonfinite == "skip":
        for p in model.sharded_params():
            p.sharded.grad = None
        message += "; gradients dropped, the next optimizer step is skipped"
    warnings.warn(message, RuntimeWarning, stacklevel=3)
