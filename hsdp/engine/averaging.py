"""Averages in fp16 without overflow or underflow: the division split around the sum (FSDP2's divide factors).

:class:`~hsdp.engine.collectives.Comm` applies it to every fp16 ``AVG``, whoever the caller.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def divide_factors(n: int) -> tuple[float, float]:
    """``(pre, post)`` with ``pre * post == n``: an fp16 average over ``n`` ranks divides each input by
    ``pre``, sums, and divides the sum by ``post``.

    Summing first overflows (fp16 tops out at 65504: four ranks' gradients of 20000 already do) and dividing
    by ``n`` first flushes small gradients to zero (below 2**-24, fp16's smallest subnormal); splitting
    the division about ``sqrt(n)`` halves both exposures. ``pre`` is the smallest power of two at least
    ``sqrt(n)``, so the pre-division is exact outside the subnormal range (it need not divide ``n``) and
    the sum of ``n`` pre-divided inputs stays within ``sqrt(n)`` times the largest one; ``post = n / pre``
    (at most ``sqrt(n)``) is one rounding of the result.
    """
    if n < 1:
        raise ValueError(f"an average needs at least one rank, got {n}")
    pre = 1
    while pre * pre < n:
        pre *= 2
    return float(pre), n / pre


def split_average(tensor: torch.Tensor, op: dist.ReduceOp.RedOpType, n: int) -> tuple[dist.ReduceOp.RedOpType,
                                                                                         float]:
    """The op to issue on ``tensor`` and the divisor to apply to the result. An fp16 ``AVG`` becomes a
    ``SUM`` of ``tensor`` pre-divided *in place* by :func:`divide_factors`' ``pre``, to be post-divided by
    ``post``; every other op and dtype is issued as asked (bf16 and fp32 have fp32's range: the backend's
    own average is safe and saves a kernel)."""
    if op != dist.ReduceOp.AVG or tensor.dtype != torch.float16:
        return op, 1.0
    pre, post = divide_factors(n)
    if pre != 1:
        tensor.div_(pre)
    return dist.ReduceOp.SUM, post
