"""Small frozen policies: precision per hop."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_map


@dataclass(frozen=True)
class MixedPrecision:
    """Dtypes per role. ``None`` means "the parameter's own dtype" (or the previous hop's, for reductions).

    Master shards and optimizer state keep the parameters' dtype (normally fp32). ``param_dtype`` is the
    dtype of the all-gather and of compute; ``reduce_dtype`` is the intra-node reduce-scatter's, and the
    inter-node hop receives that dtype. What crosses nodes is the hop's choice, the one setting for it
    (``replica_hop=AllReduceHop(torch.bfloat16)`` halves the slow links' bytes while the fast hop stays fp32).
    Partial sums kept across micro-batches are always fp32. ``output_dtype`` casts the root's floating outputs;
    ``buffer_dtype`` casts floating buffers once at wrap time (buffers are not sharded).
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    buffer_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "output_dtype", "buffer_dtype"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, torch.dtype) or not value.is_floating_point):
                raise ValueError(f"MixedPrecision.{name} must be a floating torch.dtype or None, got {value!r}")

    def compute(self, orig: torch.dtype) -> torch.dtype:
        """The all-gather and compute dtype of a parameter whose own dtype is ``orig``."""
        return self.param_dtype or orig

    def reduce(self, orig: torch.dtype) -> torch.dtype:
        """The intra-node reduce-scatter's dtype for a parameter whose own dtype is ``orig``."""
        return self.reduce_dtype or self.compute(orig)

    def cast_inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """A unit's forward inputs with floating tensors in ``param_dtype`` (unless ``cast_forward_inputs``
        is off)."""
        if self.param_dtype is None or not self.cast_forward_inputs:
            return args, kwargs
        cast = functools.partial(_cast_floating, dtype=self.param_dtype)
        return tree_map(cast, args), tree_map(cast, kwargs)

    def cast_outputs(self, output: Any) -> Any:
        """The root's outputs with floating tensors in ``output_dtype``."""
        dtype = self.output_dtype
        return output if dtype is None else tree_map(functools.partial(_cast_floating, dtype=dtype), output)


FULL_PRECISION = MixedPrecision()


_HOPS_BY_NAME = {"bf16": "hsdp.AllReduceHop(torch.bfloat16)", "bfloat16": "hsdp.AllReduceHop(torch.bfloat16)",
                 "int8": "hsdp.Int8ErrorFeedbackHop()", "fp32": "hsdp.AllReduceHop()",
                 "allreduce": "hsdp.AllReduceHop()"}


def check_policies(mixed_precision: Any, replica_hop: Any, where: str = "ShardedModel") -> None:
    """``ValueError`` naming the object to pass for policy arguments of the wrong kind (a string hop would fail
    only in the first backward, inside a hook); ``where`` names the call in the message (a framework's strategy
    checks in its constructor, before any rank communicates)."""
    if mixed_precision is not None and not isinstance(mixed_precision, MixedPrecision):
        raise ValueError(f"{where}(mixed_precision=...) takes hsdp.MixedPrecision(param_dtype=..., reduce_dtype=...), "
                         f"got {mixed_precision!r}: e.g. hsdp.MixedPrecision(param_dtype=torch.bfloat16)")
    if replica_hop is not None and not callable(getattr(replica_hop, "start", None)):
        hint = _HOPS_BY_NAME.get(str(replica_hop).lower(), "hsdp.AllReduceHop(), hsdp.AllReduceHop(torch.bfloat16) "
                                 "or hsdp.Int8ErrorFeedbackHop()")
        raise ValueError(f"{where}(replica_hop=...) takes a hop object, got {replica_hop!r}: pass replica_hop={hint}")


def _cast_floating(x: Any, dtype: torch.dtype) -> Any:
    if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
        return x.to(dtype)
    return x
