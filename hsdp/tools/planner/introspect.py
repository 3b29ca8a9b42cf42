"""A :class:`~hsdp.tools.planner.model.ModelSpec` read off a live module: the exact units and parameter shapes.

For an unwrapped ``nn.Module`` the units come from hsdp's own wrap policy (``hsdp.engine.wrap``), so the spec is
what ``ShardedModel(module)`` would build, without any process group; for a ``ShardedModel`` they are read
from its units. FLOPs per token count two per weight of every multi-dimensional parameter used as a
matrix (an embedding table that is not also an ``nn.Linear`` weight costs nothing); attention FLOPs are
not visible here, so a measured :class:`~hsdp.tools.planner.model.ComputeProfile` should supply compute time.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from torch import nn

from hsdp.engine.wrap import WrapPolicy, assign_params, select_unit_modules
from hsdp.tools.planner.model import ModelSpec, Shape, UnitSpec


def _shape(shape: Iterable[int]) -> Shape:
    dims = tuple(shape)
    return (dims[0], math.prod(dims[1:]))


def _flops_per_token(shape: tuple[int, ...], modules: list[nn.Module]) -> float:
    if len(shape) < 2:
        return 0.0
    lookup_only = all(isinstance(m, nn.Embedding) for m in modules)
    return 0.0 if lookup_only else 2.0 * math.prod(shape)


def _unit(name: str, params: list[tuple[tuple[int, ...], list[nn.Module], bool]]) -> UnitSpec:
    return UnitSpec(name, tuple(_shape(s) for s, _, trainable in params if trainable),
                    sum(_flops_per_token(s, ms) for s, ms, _ in params),
                    tuple(_shape(s) for s, _, trainable in params if not trainable))


def _class_name(module: nn.Module) -> str:
    from hsdp.engine.model import ShardedModel

    # A ShardedModel's class is a generated subclass (ShardedGPT): name the user's class.
    bases = [b for b in type(module).__mro__ if not issubclass(b, ShardedModel)]
    return bases[0].__name__ if isinstance(module, ShardedModel) and bases else type(module).__name__


def spec_from_module(module: nn.Module, seq_len: int = 1, micro_batch: int = 1, wrap: WrapPolicy = None,
                     name: str | None = None) -> ModelSpec:
    """The spec of ``module`` as hsdp would shard it (``wrap`` as for ``ShardedModel``); frozen parameters
    (``requires_grad=False``) are stored and gathered but carry no gradient or optimizer state."""
    from hsdp.engine.model import ShardedModel

    label = name or _class_name(module)
    if isinstance(module, ShardedModel):
        units = [_unit(u.name, [(p.layout.global_shape, [s.module for s in p.slots], p.requires_grad)
                                for p in u.params]) for u in module.units]
        return ModelSpec(label, tuple(units), seq_len, micro_batch)
    unit_modules = select_unit_modules(module, wrap)
    by_owner: dict[int, list[tuple[tuple[int, ...], list[nn.Module], bool]]] = {id(m): [] for m in unit_modules}
    for a in assign_params(module, unit_modules):
        by_owner[id(a.owner)].append((tuple(a.param.shape), [s.module for s in a.slots], a.param.requires_grad))
    units = [_unit("root" if m is module else type(m).__name__, by_owner[id(m)]) for m in unit_modules]
    # The engine drops parameter-less non-root units; the root unit always exists.
    units = [units[0], *[u for u in units[1:] if u.numel]]
    return ModelSpec(label, tuple(units), seq_len, micro_batch)
