"""Element-wise optimizer steps on the plain local chunks of DTensor parameters (no DTensor dispatch).

[Note: why a local step]
Between steps a ShardedModel's parameters, gradients and optimizer state are DTensors, so any code that
reads shapes or norms sees the global tensors. An element-wise optimizer (Adam, SGD, ...) updates each
element from the same element of the gradient and its own state, so stepping the local chunks is the
same computation; through DTensor, every foreach op also pays sharding propagation and unwrapping, about
10% of AdamW's step on the benchmark model on CPU. For the optimizers listed in :data:`ELEMENTWISE` the
step therefore runs on plain views: each group's ``params`` is swapped for plain ``nn.Parameter`` views of
the local chunks (``.grad`` the local gradient), ``optimizer.state`` for a dict of the same state tensors'
local chunks, keyed by those views; after the step new state (the first step's) is wrapped back into
DTensors. Nothing is copied: updates land in the flat shard buffers and in the DTensor state's storage.
Other optimizers (Adafactor, Muon, third-party) step on the DTensors.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from hsdp.engine.runtime.late_grads import raw_grad
from hsdp.engine.runtime.sharded_param import ShardedParam

# torch.optim classes whose update of an element reads only that element (of the parameter, its gradient
# and its per-parameter state) and scalars; subclasses are not included (they may override the rule).
ELEMENTWISE = frozenset({"SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad", "Adadelta", "RMSprop",
                         "Rprop", "ASGD"})


def is_elementwise(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer``'s own step (not a subclass's) is one of torch's element-wise optimizers."""
    base = next((c for c in type(optimizer).__mro__ if c.__module__.startswith("torch.optim")), None)
    return base is not None and base.__name__ in ELEMENTWISE and _step_is_torchs(optimizer, base)


def _step_is_torchs(optimizer: torch.optim.Optimizer, base: type) -> bool:
    """A user subclass that overrides ``step`` may do anything: leave it on the DTensor path."""
    for cls in type(optimizer).__mro__:
        if cls is base:
            return True
        if "step" in cls.__dict__ and not cls.__module__.startswith("hsdp"):
            return False
    return False


class LocalViews:
    """The plain stand-ins of one optimizer's DTensor parameters, built once and reused every step."""

    def __init__(self, by_param: dict[int, ShardedParam]) -> None:
        self._by_param = by_param
        self._views: dict[int, nn.Parameter] = {}

    def view_of(self, param: nn.Parameter) -> nn.Parameter:
        sp = self._by_param[id(param)]
        view = self._views.get(id(param))
        local = sp.opt_local  # the chunk, or this replica's slice of it (see runtime/replica_slice.py)
        if view is None or view.data_ptr() != local.data_ptr() or view.shape != local.shape:
            # Rebuilt when the shard buffer moved (e.g. model.to(...)): the view must alias the live shard.
            view = nn.Parameter(local, requires_grad=param.requires_grad)
            self._views[id(param)] = view
        grad = raw_grad(param)  # as landed so far: the step lands late gradients itself (late_grads.py)
        view.grad = grad._local_tensor if isinstance(grad, DTensor) else grad
        return view


@contextlib.contextmanager
def local_step(optimizer: torch.optim.Optimizer, views: LocalViews) -> Iterator[None]:
    """Inside the block ``optimizer`` sees plain local views of its parameters and state (see the Note)."""
    groups = [g["params"] for g in optimizer.param_groups]
    local_groups = [[views.view_of(p) for p in params] for params in groups]
    pairs = [(p, v) for params, local in zip(groups, local_groups, strict=True)
             for p, v in zip(params, local, strict=True)]
    dtensor_state = optimizer.state
    local_state: defaultdict[Any, dict[str, Any]] = defaultdict(dict)
    for p, v in pairs:
        if p in dtensor_state:
            local_state[v] = {k: _local(x) for k, x in dtensor_state[p].items()}
    for g, local in zip(optimizer.param_groups, local_groups, strict=True):
        g["params"] = local
    optimizer.state = local_state
    try:
        yield
    finally:
        optimizer.state = dtensor_state
        for g, params in zip(optimizer.param_groups, groups, strict=True):
            g["params"] = params
        for p, v in pairs:
            _write_back(dtensor_state, p, local_state.get(v), views)
            v.grad = None


def _local(x: Any) -> Any:
    return x._local_tensor if isinstance(x, DTensor) else x


def _write_back(state: Any, param: nn.Parameter, local: dict[str, Any] | None, views: LocalViews) -> None:
    """Entries the step created or replaced, wrapped as DTensors like the parameter (scalars stay plain)."""
    if not local:
        return
    sp = views._by_param[id(param)]
    entries = state[param]
    for key, value in local.items():
        current = entries.get(key)
        if current is value or (isinstance(current, DTensor) and current._local_tensor is value):
            continue
        is_chunk = isinstance(value, torch.Tensor) and value.dim() > 0 and tuple(value.shape) == sp.opt_shape
        entries[key] = sp.to_opt_dtensor(value) if is_chunk else value
