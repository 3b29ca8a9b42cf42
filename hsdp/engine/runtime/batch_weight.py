"""Weighted gradient averages (``ShardedModel.set_batch_weight``): a rank's backward counts as ``w`` samples.

The reduced gradient is ``sum_i w_i g_i / sum_i w_i`` over the data-parallel ranks and the micro-batches of an
accumulation window, where ``g_i`` is the gradient of the rank's own mean loss: exactly the gradient of one
process's mean loss over the concatenated uneven batches (``w`` = samples), or, with ``w`` = tokens and a
per-token mean loss, of the mean over every token (the accumulation pitfall Hugging Face's
``num_items_in_batch`` fixes).

The weights travel inside the reductions: each unit's reduce-scatter input ends with the "has gradient" flags
and then :data:`SLOTS` values: the rank's weight, a 1 if it set a (valid) weight, and a 1. Both averaging hops
(and micro-batch partial sums) treat them like the gradients, which were multiplied by ``w`` first; dividing the
gradient part by the averaged weight gives ``(sum w g / N) / (sum w / N)``. No host sync, no collective of its
own, any hop (bf16, int8 with error feedback, the replica-sharded optimizer); the averaged weight travels in the
hop's wire dtype, so a bf16 hop rounds it as it rounds every gradient.

A rank that set no weight sends ``w = 1`` and scales nothing: with no weights anywhere the result is the plain
average, bit for bit. The last two slots tell every rank whether all, none or only some ranks weighted their
batch (or one's tensor weight was zero, negative or non-finite, which counts as not set): that check rides on
the step's host read (``step_read.py``), so a mix raises ``ValueError`` before ``optimizer.step()``
applies the gradient, on every rank that weighted (and on the others where the step reads anyway).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

SLOTS = 3  # after the flags: the weight, "weighted", one
Weight = float | torch.Tensor  # a Python number, or a 1-element tensor (e.g. a token count on the device)


def checked(weight: float | int | torch.Tensor | None, device: torch.device) -> Weight | None:
    """``weight`` as the runtime keeps it for a mesh on ``device``: a Python number that is not finite and
    positive is refused now; a tensor on the mesh's device stays there (checked with the step's read), one on
    the host of a GPU mesh is read now (no device sync) and checked as a number."""
    if isinstance(weight, torch.Tensor):
        if weight.numel() != 1:
            raise ValueError(f"set_batch_weight takes one number per rank, got a tensor of shape "
                             f"{tuple(weight.shape)}: pass the rank's sample or token count")
        if weight.device == device or device.type == weight.device.type == "cpu":
            return weight.detach().reshape(()).to(torch.float64 if weight.dtype == torch.float64 else torch.float32)
        weight = weight.item() if weight.device.type == "cpu" else weight.to(device).reshape(())
        if isinstance(weight, torch.Tensor):
            return weight.float()
    if weight is None:
        return None
    if isinstance(weight, bool) or not isinstance(weight, int | float):
        raise ValueError(f"set_batch_weight takes a number or a 1-element tensor, got {type(weight).__name__}")
    if not math.isfinite(weight) or weight <= 0:
        raise ValueError(f"batch weight {weight!r}: a weight is the rank's count of samples or tokens in this "
                         f"backward and must be finite and positive (skip the backward of an empty batch instead)")
    return float(weight)


def extras(flags: torch.Tensor, weight: Weight | None, window: Weight | None) -> torch.Tensor:
    """The values after the gradients: ``flags``, then the weight (plus ``window``, what unreduced micro-batches
    of this window weighed), "weighted" and one, in ``flags``' dtype and device. No host sync."""
    ones = flags.new_ones(SLOTS)
    if weight is None:
        ones[1].zero_()
        return torch.cat([flags, ones])
    total = weight if window is None else window + weight
    if isinstance(total, torch.Tensor):
        ones[0].copy_(total)
    else:
        ones[0].fill_(total)
    if isinstance(weight, torch.Tensor):
        ones[1].copy_(torch.isfinite(weight) & (weight > 0))  # a bad weight counts as not set: the check fails
    return torch.cat([flags, ones])


def add(window: Weight | None, weight: Weight | None) -> Weight | None:
    """What an accumulation window weighs after one more micro-batch kept unreduced (``None``: unweighted)."""
    if weight is None:
        return window
    return weight if window is None else window + weight


def normalize_(output: torch.Tensor, n_extra: int) -> None:
    """Divide the reduced gradient part of ``output`` (before its ``n_extra`` trailing values) by its averaged
    weight: the weighted average."""
    output[:-n_extra].div_(output[-SLOTS])


def agreement(output: torch.Tensor) -> torch.Tensor:
    """The fraction of ranks (and micro-batches) that set a valid weight, on the device: 0, 1, or a mix."""
    return output[-2].float() / output[-1].float()


def check_agreement(weighted: bool) -> Callable[[float], None]:
    """The deferred check of :func:`agreement`'s value on a rank that did (``weighted``) or did not weight."""

    def check(fraction: float) -> None:
        if (weighted and fraction != 1.0) or (not weighted and 0.0 < fraction < 1.0):
            raise ValueError(
                "model.set_batch_weight was called on some ranks only, or some rank's weight tensor was zero, "
                "negative or non-finite: every rank must set a positive weight before each backward (or none "
                f"may); {fraction:.0%} of the ranks' backwards were weighted")
    return check
