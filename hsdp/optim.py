"""``ShardedOptimizer``: a torch optimizer over a ShardedModel's shards, with a reshardable state dict."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from hsdp.model import ShardedModel
from hsdp.runtime.dtensor import is_hsdp_layout, local_chunk
from hsdp.runtime.sharded_param import ShardedParam

_CLASS_CACHE: dict[type, type] = {}
# Optimizers that couple elements across a tensor (or need all of it) cannot run on dim-0 shards.
_NOT_ELEMENTWISE = ("LBFGS", "SparseAdam")


class ShardedOptimizer(torch.optim.Optimizer):
    """Make ``optimizer`` (built on ``model.parameters()``) a sharded optimizer; returns the same object.

    Each rank's optimizer steps only its own shards, so optimizer state is sharded like the parameters.
    This is exact for element-wise optimizers (SGD, Adam, AdamW, ...). ``check_replicas_every=N`` runs
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
        optimizer._patch_step_function()  # step hooks, as torch.optim.Optimizer.__init__ would install
        return optimizer  # type: ignore[return-value]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass  # built in __new__ from an existing optimizer

    def step(self, closure: Any = None) -> Any:
        # Stale unsharded copies must not outlive an update of the shards.
        self._hsdp_model.reshard()
        result = super().step(closure)
        self._hsdp_steps += 1
        if self._hsdp_check_every and self._hsdp_steps % self._hsdp_check_every == 0:
            self._hsdp_model.check_replicas()
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
            state[index[name]] = {k: _as_state_of(v, sp) for k, v in entries.items()}
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
    return DTensor.from_local(value.unsqueeze(0), device_mesh, [Shard(0), Shard(1)], run_check=False, shape=shape,
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
    if type(optimizer).__name__ in _NOT_ELEMENTWISE:
        raise ValueError(
            f"{type(optimizer).__name__} is not element-wise and cannot step dim-0 shards: use SGD, Adam, "
            f"AdamW or another element-wise optimizer"
        )


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


def _as_state_of(value: Any, sp: ShardedParam) -> Any:
    """Per-parameter state (full, or DTensor in any layout) as a DTensor chunk that owns its memory (a view
    would keep the whole loaded tensor alive); scalars and other shapes unchanged."""
    if isinstance(value, DTensor) and is_hsdp_layout(value, sp.layout):
        return value
    local = local_chunk(value, sp.layout) if isinstance(value, torch.Tensor) and value.dim() > 0 else value
    if local is value or not isinstance(local, torch.Tensor):
        return value
    return sp.to_dtensor(local.clone())
