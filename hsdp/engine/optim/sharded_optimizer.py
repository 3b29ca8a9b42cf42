"""``ShardedOptimizer``: a torch optimizer over a ShardedModel's shards, with a reshardable state dict."""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode
from torch.optim.optimizer import register_optimizer_step_pre_hook

from hsdp.engine.model import ShardedModel
from hsdp.engine.optim.adafactor import adafactor_step, state_is_replicated
from hsdp.engine.optim.local_step import LocalViews, is_elementwise, local_step
from hsdp.engine.optim.muon import muon_step
from hsdp.engine.runtime.dtensor import PLACEMENTS, is_hsdp_layout, to_sharded_dtensor
from hsdp.engine.runtime.sharded_param import ShardedParam, ShardLayout

_CLASS_CACHE: dict[type, type] = {}
# Not element-wise, but hsdp replaces their step by an exact sharded one (adafactor.py, muon.py).
# (The element-wise torch.optim optimizers are listed in local_step.py.)
_SHARDED_STEPS: dict[type, Callable[[Any, ShardedModel], None]] = {
    torch.optim.Adafactor: adafactor_step,
    torch.optim.Muon: muon_step,
}
# Not element-wise and not handled: the reason and the fix, for the ValueError.
_NOT_ELEMENTWISE = {
    "LBFGS": "it builds one flat vector of all gradients and line-searches on it; use Adam, AdamW or SGD",
    "SparseAdam": "it needs sparse gradients and hsdp's are dense; use Adam or AdamW",
}


class ShardedOptimizer(torch.optim.Optimizer):
    """Make ``optimizer`` (built on ``model.parameters()``) a sharded optimizer; returns the same object.

    Each rank's optimizer steps only its own shards, so optimizer state is sharded like the parameters.
    This is exact for element-wise optimizers: every torch.optim optimizer but LBFGS and SparseAdam
    (rejected with a ``ValueError``). ``torch.optim.Adafactor`` and ``torch.optim.Muon`` are not
    element-wise; their step is replaced by an exact sharded one (``hsdp/engine/optim/adafactor.py``: a few small
    all-reduces in the shard group; ``hsdp/engine/optim/muon.py``: each matrix orthogonalised whole on one rank of the
    shard group). Other optimizers (third-party, or torch's with ``step`` overridden) must be element-wise:
    their first step runs under DTensor's ``CommDebugMode`` and warns if it communicated, a sign that the
    optimizer reduces across elements (then DTensor, not hsdp, moves the data: not in ``comm_stats``,
    possibly across nodes). ``check_replicas_every=N`` runs
    ``model.check_replicas()`` after every N-th step. The class is swapped to a subclass
    of both ``ShardedOptimizer`` and the original class, so LR schedulers and hooks work unchanged.

    An optimizer built on the unwrapped model's parameters (before wrapping, not yet stepped) is
    re-pointed at the shards. ``state_dict()`` is keyed by parameter name (FQN) with per-element state as
    ``DTensor`` (``Replicate(), Shard(0)``), the format ``torch.distributed.checkpoint`` reshards.
    """

    _hsdp_model: ShardedModel

    def __new__(cls, model: ShardedModel, optimizer: torch.optim.Optimizer, *,
                check_replicas_every: int | None = None) -> ShardedOptimizer:
        _validate(model, optimizer)
        if check_replicas_every is not None and check_replicas_every < 1:
            raise ValueError(f"check_replicas_every must be a positive step count or None, got {check_replicas_every}")
        _repoint_params(model, optimizer)
        optimizer.__class__ = _sharded_class(type(optimizer))
        object.__setattr__(optimizer, "_hsdp_model", model)
        object.__setattr__(optimizer, "_hsdp_check_every", check_replicas_every)
        object.__setattr__(optimizer, "_hsdp_steps", 0)
        views = LocalViews(_sharded_by_param(model)) if is_elementwise(optimizer) else None
        object.__setattr__(optimizer, "_hsdp_local_views", views)
        object.__setattr__(optimizer, "_hsdp_sharded_step", _sharded_step(optimizer))
        object.__setattr__(optimizer, "_hsdp_unverified", views is None and _sharded_step(optimizer) is None)
        optimizer._patch_step_function()  # step hooks, as torch.optim.Optimizer.__init__ would install
        return optimizer  # type: ignore[return-value]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass  # built in __new__ from an existing optimizer

    def step(self, closure: Any = None) -> Any:
        # Stale unsharded copies must not outlive an update of the shards.
        self._hsdp_model.reshard()
        if self._hsdp_sharded_step is not None:  # Adafactor, Muon: see adafactor.py, muon.py
            result = None
            if closure is not None:
                with torch.enable_grad():
                    result = closure()
            self._hsdp_sharded_step(self, self._hsdp_model)
        elif self._hsdp_local_views is not None and closure is None:
            with local_step(self, self._hsdp_local_views):  # see [Note: why a local step]
                result = super().step()
        elif self._hsdp_unverified and closure is None:
            result = self._verified_step()
        else:
            result = super().step(closure)
        self._hsdp_steps += 1
        if self._hsdp_check_every and self._hsdp_steps % self._hsdp_check_every == 0:
            self._hsdp_model.check_replicas()
        return result

    def _verified_step(self) -> Any:
        """The first step of an optimizer hsdp does not know: warn if DTensor had to communicate."""
        with CommDebugMode() as mode:
            result = super().step()
        self._hsdp_unverified = False
        if mode.get_total_counts():
            warnings.warn(
                f"{_base_name(self)}.step issued {mode.get_total_counts()} collective(s) through "
                f"DTensor on sharded parameters: it is not element-wise. Its results are whatever DTensor "
                f"computes (bf16 partial sums differ from one process), the bytes are not in comm_stats and "
                f"may cross nodes; use an element-wise optimizer or one hsdp handles (torch.optim.Muon, "
                f"torch.optim.Adafactor)", RuntimeWarning, stacklevel=3)
        return result

    # -- state dict ----------------------------------------------------------------------------------
    def _index_params(self) -> list[nn.Parameter]:
        return [p for g in self.param_groups for p in g["params"]]

    def state_dict(self) -> dict[str, Any]:
        """``{"state": {fqn: {name: value}}, "param_groups": [{..., "params": [fqn, ...]}]}``."""
        raw = super().state_dict()
        by_param = _sharded_by_param(self._hsdp_model)
        params = self._index_params()
        dm = self._hsdp_model.mesh.device_mesh
        fqn = [by_param[id(p)].fqn for p in params]
        # Per-parameter state is already DTensor (built like the DTensor parameters): only rename.
        state = {fqn[idx]: dict(entries) for idx, entries in raw["state"].items()}
        groups = [{**g, "params": [fqn[i] for i in g["params"]]} for g in raw["param_groups"]]
        out = {"state": state, "param_groups": groups}
        hop_state = {name: _residual_dtensor(v, sp, dm) for name, (sp, v) in _hop_residuals(self._hsdp_model).items()}
        if hop_state:
            out["hop_residuals"] = hop_state
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load the FQN-keyed form (``DTensor`` or full tensors); other forms go to the wrapped class."""
        groups = state_dict.get("param_groups", [])
        if not groups or not groups[0]["params"] or not isinstance(groups[0]["params"][0], str):
            return super().load_state_dict(state_dict)
        by_param = _sharded_by_param(self._hsdp_model)
        params = self._index_params()
        index = {by_param[id(p)].fqn: i for i, p in enumerate(params)}
        unknown = [k for g in groups for k in g["params"] if k not in index]
        unknown += [k for k in state_dict["state"] if k not in index]
        if unknown:
            raise ValueError(f"optimizer state names parameters this model does not have: {unknown[:5]}")
        state = {}
        for name, entries in state_dict["state"].items():
            sp = by_param[id(params[index[name]])]
            state[index[name]] = {k: _as_state_of(v, sp, state_is_replicated(k, len(sp.layout.global_shape))
                                                  and isinstance(self, torch.optim.Adafactor))
                                  for k, v in entries.items()}
        raw_groups = [{**g, "params": [index[k] for k in g["params"]]} for g in groups]
        super().load_state_dict({"state": state, "param_groups": raw_groups})
        _load_hop_residuals(self._hsdp_model, state_dict.get("hop_residuals", {}))


def _residual_layout(unit: Any) -> list[tuple[ShardedParam, int]]:
    """(param, offset) in a unit's reduce slot: trainable parameters, padded chunks back to back."""
    out, offset = [], 0
    for p in unit.params:
        if p.requires_grad:
            out.append((p, offset))
            offset += p.layout.padded_numel
    return out


def _hop_residuals(model: ShardedModel) -> dict[str, tuple[ShardedParam, torch.Tensor]]:
    """Error-feedback residuals of the inter-node hop, split per parameter (so they reshard)."""
    out = {}
    for unit in model.units:
        flat = getattr(unit.hop, "residuals", {}).get(unit.key)
        if flat is None:
            continue
        for p, off in _residual_layout(unit):
            out[p.fqn] = (p, flat[off: off + p.layout.local_numel].view(p.layout.local_shape))
    return out


def _residual_dtensor(value: torch.Tensor, sp: ShardedParam, device_mesh: Any) -> DTensor:
    """Residuals differ per replica (each keeps its own rounding error): a leading replica dim, sharded
    over the replicate mesh dim, so every replica's residual is saved, not one copy of one of them."""
    shape = torch.Size((device_mesh.size(0), *sp.layout.global_shape))
    inner = Replicate() if sp.layout.replicated else Shard(1)  # a 0-d parameter is whole on every shard rank
    return DTensor.from_local(value.unsqueeze(0), device_mesh, [Shard(0), inner], run_check=False, shape=shape,
                              stride=torch.empty(shape, device="meta").stride())


def _local_residual(value: Any, sp: ShardedParam, replicate_rank: int, replicas: int) -> torch.Tensor | None:
    if isinstance(value, DTensor):
        if value.shape[0] != replicas:
            return None  # another replica count: the residuals do not map; start from zero
        if value.placements == (Shard(0), Shard(1)) and tuple(value.to_local().shape[1:]) == sp.layout.local_shape:
            return value.to_local()[0]
        value = value.full_tensor()
    if isinstance(value, torch.Tensor) and tuple(value.shape) == (replicas, *sp.layout.global_shape):
        return sp.layout.chunk(value[replicate_rank])
    return None


def _load_hop_residuals(model: ShardedModel, saved: dict[str, Any]) -> None:
    mesh = model.mesh
    for unit in model.units:
        residuals = getattr(unit.hop, "residuals", None)
        layout = _residual_layout(unit)
        if residuals is None or not layout or not any(p.fqn in saved for p, _ in layout):
            continue
        p_last, off_last = layout[-1]
        flat = torch.zeros(off_last + p_last.layout.padded_numel, device=unit.sharded_flat.device)
        for p, off in layout:
            local = _local_residual(saved.get(p.fqn), p, mesh.replicate_rank, mesh.replicate_degree)
            if local is None:
                warnings.warn(f"no usable inter-node hop residual for {p.fqn} (saved on another replica count?): "
                              f"starting it from zero", stacklevel=3)
                continue
            flat[off: off + p.layout.local_numel] = local.reshape(-1)
        residuals[unit.key] = flat


def _sharded_class(orig: type) -> type:
    if orig not in _CLASS_CACHE:
        _CLASS_CACHE[orig] = type(f"Sharded{orig.__name__}", (ShardedOptimizer, orig), {})
    return _CLASS_CACHE[orig]


def _validate(model: Any, optimizer: Any) -> None:
    if not isinstance(model, ShardedModel):
        raise ValueError("ShardedOptimizer needs the ShardedModel: wrap the model with ShardedModel first")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if isinstance(optimizer, ShardedOptimizer):
        raise ValueError("this optimizer is already a ShardedOptimizer: wrap it once")
    for cls in type(optimizer).__mro__:
        if cls.__module__.startswith("torch.optim") and cls.__name__ in _NOT_ELEMENTWISE:
            raise ValueError(f"{type(optimizer).__name__} is not element-wise and cannot step dim-0 shards: "
                             f"{_NOT_ELEMENTWISE[cls.__name__]}")


def install_unwrapped_step_guard() -> None:
    """Refuse, at their first step, torch optimizers that would silently mis-step hsdp's parameters because
    they were not wrapped in ``ShardedOptimizer``: Muon (whole-matrix updates; through DTensor it is off
    by 1e-3 and also all-reduces across nodes) and the rejected ones. Element-wise optimizers are exact
    unwrapped (through DTensor dispatch) and pass; Adafactor unwrapped would crash inside torch, so it is
    refused here with the fix instead. One global optimizer pre-step hook, installed once."""
    global _GUARD_INSTALLED
    if not _GUARD_INSTALLED:
        register_optimizer_step_pre_hook(_refuse_unwrapped)
        _GUARD_INSTALLED = True


_GUARD_INSTALLED = False


def _refuse_unwrapped(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if isinstance(optimizer, ShardedOptimizer) or is_elementwise(optimizer):
        return
    known = [c.__name__ for c in type(optimizer).__mro__
             if c in _SHARDED_STEPS or (c.__module__.startswith("torch.optim") and c.__name__ in _NOT_ELEMENTWISE)]
    if not known or not any(getattr(p, "_hsdp_sharded", False) for g in optimizer.param_groups for p in g["params"]):
        return
    raise ValueError(f"{type(optimizer).__name__} steps hsdp's sharded parameters directly, which gives wrong "
                     f"updates ({known[0]} is not element-wise): wrap it, "
                     f"optimizer = hsdp.ShardedOptimizer(model, optimizer)")


def _base_name(optimizer: ShardedOptimizer) -> str:
    return next(c for c in type(optimizer).__mro__ if not issubclass(c, ShardedOptimizer)).__name__


def _own_step(optimizer: torch.optim.Optimizer, cls: type) -> bool:
    """Whether ``optimizer`` steps with ``cls.step`` (not a subclass's override). Compared unwrapped: torch
    wraps ``step`` in place for its hooks."""
    own = next(c for c in type(optimizer).__mro__ if not issubclass(c, ShardedOptimizer))
    return issubclass(own, cls) and inspect.unwrap(own.step) is inspect.unwrap(cls.step)


def _sharded_step(optimizer: torch.optim.Optimizer) -> Callable[[Any, ShardedModel], None] | None:
    return next((fn for cls, fn in _SHARDED_STEPS.items() if _own_step(optimizer, cls)), None)


def _sharded_by_param(model: ShardedModel) -> dict[int, ShardedParam]:
    return {id(sp.sharded): sp for sp in model.sharded_params()}


def _repoint_params(model: ShardedModel, optimizer: torch.optim.Optimizer) -> None:
    sharded = _sharded_by_param(model)
    originals = {id(sp.original_ref()): sp for sp in model.sharded_params() if sp.original_ref() is not None}
    for group in optimizer.param_groups:
        new = []
        for p in group["params"]:
            if id(p) in sharded:
                new.append(p)
                continue
            sp = originals.get(id(p))
            if sp is None or sp.original_ref() is not p:
                raise ValueError(
                    "the optimizer holds a tensor that is not a parameter of this ShardedModel: build it "
                    "on model.parameters() after wrapping"
                )
            if optimizer.state.get(p):
                raise ValueError(
                    "the optimizer was stepped before wrapping: build it on model.parameters() after "
                    "wrapping, or load its state with load_state_dict afterwards"
                )
            new.append(sp.sharded)
        group["params"] = new


def _as_state_of(value: Any, sp: ShardedParam, replicated: bool = False) -> Any:
    """Per-parameter state as hsdp keeps it, owning its memory (a view would keep a whole loaded tensor
    alive): a DTensor ``(Replicate(), Shard(0))`` chunk of the state's own global shape when that shape has
    the parameter's rank and rows (moments, Adafactor's row factors), a fully replicated DTensor when
    ``replicated`` (Adafactor's column factor of a matrix); scalars and other shapes unchanged."""
    if isinstance(value, DTensor):
        # A replicated entry may have been loaded as a chunked DTensor when its shape equals the parameter's
        # (a one-row matrix's col_var): ``replicated`` decides, not the shape.
        if not replicated and (is_hsdp_layout(value, sp.layout) or _chunked_as_hsdp(value, sp)):
            return value
        # A replicated value (any mesh) is its own full tensor: no collective.
        value = value.to_local() if all(p == Replicate() for p in value.placements) else value.full_tensor()
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return value
    shape = tuple(value.shape)
    if replicated:
        return DTensor.from_local(value.clone(), sp.device_mesh, (Replicate(), Replicate()), run_check=False)
    if len(shape) != len(sp.layout.global_shape) or shape[0] != sp.layout.rows:
        return value
    layout = ShardLayout(shape, sp.layout.sharding_degree, sp.layout.shard_rank)
    return to_sharded_dtensor(layout.chunk(value).clone(), sp.device_mesh, shape)


def _chunked_as_hsdp(value: DTensor, sp: ShardedParam) -> bool:
    """Whether a DTensor already is this rank's chunk of its own global shape on ``sp``'s mesh (its local
    tensor can be kept as is)."""
    if tuple(value.placements) != PLACEMENTS or value.dim() == 0 or value.device_mesh != sp.device_mesh:
        return False
    layout = ShardLayout(tuple(value.shape), sp.layout.sharding_degree, sp.layout.shard_rank)
    return tuple(value.to_local().shape) == layout.local_shape
