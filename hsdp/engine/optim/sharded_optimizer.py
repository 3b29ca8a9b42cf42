"""``ShardedOptimizer``: a torch optimizer over a ShardedModel's shards, with a reshardable state dict."""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from hsdp.engine.class_swap import original_class, swap_class
from hsdp.engine.model import ShardedModel
from hsdp.engine.optim.adafactor import adafactor_step, state_is_replicated
from hsdp.engine.optim.dcp_state_dict import install_named_state_dict, is_state_warmup, warn_dropped_hop_state
from hsdp.engine.optim.elastic_heal import attach_heal, finish_step
from hsdp.engine.optim.local_step import LocalViews, is_elementwise, local_step
from hsdp.engine.optim.muon import muon_step
from hsdp.engine.optim.outer_heal import join_open_sync
from hsdp.engine.optim.outer_step import OuterState, SyncStep
from hsdp.engine.optim.piece_slice_state import is_piece_sliced, piece_slice_state, piece_sliced_tensor
from hsdp.engine.optim.unit_steps import step_as_grads_land, step_slices_unit_by_unit
from hsdp.engine.runtime.dtensor import as_sharded_state, as_slice_state
from hsdp.engine.runtime.hop_state import hop_state_dict, load_hop_state_dict
from hsdp.engine.runtime.late_grads import LateGrads
from hsdp.engine.runtime.origin import check_origin, stamp
from hsdp.engine.runtime.piece_slice import PieceSliceLayout
from hsdp.engine.runtime.sharded_param import ShardedParam
from hsdp.engine.runtime.step_guard import refusal

# Not element-wise, but hsdp replaces their step by an exact sharded one (adafactor.py, muon.py).
# (The element-wise torch.optim optimizers are listed in local_step.py.)
_SHARDED_STEPS: dict[type, Callable[[Any, ShardedModel], None]] = {
    torch.optim.Adafactor: adafactor_step,
    torch.optim.Muon: muon_step,
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
    ``DTensor`` (``Shard(0)`` on the replica's mesh), the format ``torch.distributed.checkpoint`` reshards;
    torch's ``get_state_dict(model, optimizer)`` / ``set_state_dict`` (the FSDP2 recipe) give and take the same
    (see ``dcp_state_dict.py``; they leave out the int8 hop's residuals, with a warning). Under DiLoCo
    (``replica_sync=``) both refuse with a ``ValueError``: the replicas' states differ and a DCP save of them
    would keep one; ``hsdp.save_checkpoint`` keeps them all (``hsdp/checkpoint/diloco.py``). After each step,
    ``last_sync`` says which DiLoCo fragments' syncs started and landed (``None`` without DiLoCo).
    """

    _hsdp_model: ShardedModel

    def __new__(cls, model: ShardedModel, optimizer: torch.optim.Optimizer, *,
                check_replicas_every: int | None = None) -> ShardedOptimizer:
        _validate(model, optimizer)
        sliced = model.shards_optimizer_across_replicas
        if sliced and not is_elementwise(optimizer):
            raise ValueError(
                f"{type(optimizer).__name__}: shard_optimizer_across_replicas steps each replica's slice of the "
                f"shards on its own, which is exact only for torch's element-wise optimizers (SGD, Adam, AdamW, "
                f"...); wrap the model without shard_optimizer_across_replicas for this optimizer")
        if check_replicas_every is not None and check_replicas_every < 1:
            raise ValueError(f"check_replicas_every must be a positive step count or None, got {check_replicas_every}")
        _repoint_params(model, optimizer)
        swap_class(optimizer, ShardedOptimizer)
        object.__setattr__(optimizer, "_hsdp_model", model)
        object.__setattr__(optimizer, "_hsdp_check_every", check_replicas_every)
        object.__setattr__(optimizer, "_hsdp_steps", 0)
        object.__setattr__(optimizer, "_hsdp_sliced", sliced)
        views = LocalViews(_sharded_by_param(model)) if is_elementwise(optimizer) else None
        object.__setattr__(optimizer, "_hsdp_local_views", views)
        object.__setattr__(optimizer, "_hsdp_sharded_step", _sharded_step(optimizer))
        object.__setattr__(optimizer, "_hsdp_unverified", views is None and _sharded_step(optimizer) is None)
        optimizer._patch_step_function()  # step hooks, as torch.optim.Optimizer.__init__ would install
        install_named_state_dict(optimizer, ShardedOptimizer.named_state_dict)  # see dcp_state_dict.py
        sync = model._hsdp_state.replica_sync
        outer = None if sync is None else OuterState(model, sync, lambda: optimizer._hsdp_steps)
        object.__setattr__(optimizer, "_hsdp_outer", outer)
        attach_heal(model, optimizer)  # elastic: a joining replica is healed here, before its first forward
        if outer is not None:
            join_open_sync(outer)  # elastic: healed at the members' sync boundary, it takes part in that sync
        return optimizer  # type: ignore[return-value]

    @property
    def last_sync(self) -> SyncStep | None:
        """Under DiLoCo, what the last ``step()`` did across replicas (``SyncStep``: the fragments whose
        pseudo-gradient all-reduce started, and those whose outer update landed); ``None`` without DiLoCo or
        before the first step."""
        return None if self._hsdp_outer is None else self._hsdp_outer.last

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass  # built in __new__ from an existing optimizer

    def step(self, closure: Any = None) -> Any:
        # The last backward's hops, if still in flight: landed here unit by unit (late_grads.py).
        late = self._hsdp_model._hsdp_state.step.take_late() if self._steps_as_grads_land(closure) else None
        try:
            return self._step(closure, late)
        finally:
            if late is not None:
                late.land_all()  # the step raised before landing them all

    def _step(self, closure: Any, late: LateGrads | None) -> Any:
        # Stale unsharded copies must not outlive an update of the shards.
        self._hsdp_model.reshard()
        self._hsdp_model._hsdp_state.step_read.before_step()  # as torch's step pre-hook, which these may skip
        outer = self._hsdp_outer
        if outer is not None:
            outer.follow_loads()  # weights loaded since the last step: the global copy follows them
        if is_state_warmup(self):  # torch's state dict helpers creating the state: not a training step
            result = self._inner_step(closure)
            if outer is not None:
                outer.mark_written()
            return result
        # Under DiLoCo an inner step crosses no replicas: no transaction (the sync is one, outer_transaction.py).
        if outer is None and not finish_step(self._hsdp_model):
            return None  # discarded on every member (elastic_heal.py): nothing is applied anywhere
        if late is not None:
            step_as_grads_land(self, self._hsdp_local_views, late, self._hsdp_model._hsdp_state.step_read,
                               self._base_step)
            result = None
        else:
            result = self._inner_step(closure)
        self._hsdp_steps += 1
        if self._hsdp_outer is not None:
            self._hsdp_outer.after_inner_step()  # DiLoCo: every H-th step syncs the replicas' weights
        if self._hsdp_check_every and self._hsdp_steps % self._hsdp_check_every == 0:
            self._hsdp_model.check_replicas()
        return result

    def sync_replicas(self) -> None:
        """Under DiLoCo, make every replica's weights the global copy now: the syncs in flight land, then every
        fragment's pseudo-gradient is all-reduced and stepped by the outer optimizer at once (``last_sync`` says
        so), and DiLoCo's phase restarts at 0. Call it on every rank at the end of training, before evaluating or
        exporting, so the last H - 1 steps' progress is not left in the replicas apart. Without DiLoCo the
        replicas are always in sync: nothing to do."""
        if self._hsdp_outer is not None:
            self._hsdp_model.reshard()
            self._hsdp_outer.sync_now()

    def _inner_step(self, closure: Any) -> Any:
        """The wrapped optimizer's step on this rank's shards."""
        if self._hsdp_sharded_step is not None:  # Adafactor, Muon: see adafactor.py, muon.py
            result = _evaluate(closure)
            self._hsdp_sharded_step(self, self._hsdp_model)
        elif self._hsdp_sliced:
            # With a closure the loss is evaluated first (these optimizers evaluate it once); the step itself
            # must be local: only a replica slice is stepped (DTensor cannot step it).
            result = _evaluate(closure)
            _slice_chunk_grads(self._hsdp_model)
            step_slices_unit_by_unit(self, self._hsdp_model, self._hsdp_local_views, self._base_step)
        elif self._hsdp_local_views is not None and closure is None:
            with local_step(self, self._hsdp_local_views):  # see [Note: why a local step]
                result = self._base_step()
        elif self._hsdp_unverified and closure is None:
            result = self._verified_step()
        else:
            result = self._base_step(closure)
        return result

    def _base_step(self, closure: Any = None) -> Any:
        """The wrapped class's own step, without torch's step hooks: ``step`` (this class's) ran them once, and
        a step in parts (unit by unit) must not run them once per part."""
        step = original_class(self, ShardedOptimizer).step
        return getattr(step, "__wrapped__", step)(self, closure) if getattr(step, "hooked", False) \
            else step(self, closure)

    def _steps_as_grads_land(self, closure: Any) -> bool:
        """Whether this step can land late gradients itself: torch's element-wise step on the shards, no closure
        (it would read every gradient first), neither DiLoCo nor the replica-sharded optimizer."""
        return closure is None and self._hsdp_local_views is not None and not self._hsdp_sliced \
            and self._hsdp_outer is None and not is_state_warmup(self)

    def _verified_step(self) -> Any:
        """The first step of an optimizer hsdp does not know: warn if DTensor had to communicate."""
        # Imported here, not at the top: it pulls in torch._dynamo and torch._inductor (about a second of every
        # rank's start-up on a CPU), and only an optimizer hsdp does not know needs it.
        from torch.distributed.tensor.debug import CommDebugMode

        with CommDebugMode() as mode:
            result = self._base_step()
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
        """torch.optim's own layout, keyed by parameter index: what ``torch.distributed.checkpoint.state_dict``'s
        helpers read (and rename to parameter names themselves). ``optimizer.state_dict()`` on the instance is
        the name-keyed layout (:meth:`named_state_dict`); see [Note: two layouts of one optimizer state] in
        ``dcp_state_dict.py``."""
        _refuse_diloco(self)
        warn_dropped_hop_state(any(unit.hop.state_dict() for unit in self._hsdp_model.units))
        return self._index_state_dict()

    def _index_state_dict(self) -> dict[str, Any]:
        raw = super().state_dict()
        # Per-parameter state is already DTensor (built like the DTensor parameters): stamp each chunk with its
        # rank's coordinates (see [Note: pickled chunks] in runtime/origin.py). A slice of pieces (replicas of
        # different degrees) becomes a ShardedTensor of every rank's runs (piece_slice_state.py).
        by_param = _sharded_by_param(self._hsdp_model)
        params = self._index_params()
        state = {idx: {k: self._exported(by_param[id(params[idx])], v) for k, v in entries.items()}
                 for idx, entries in raw["state"].items()}
        return {"state": state, "param_groups": raw["param_groups"]}

    def _exported(self, sp: ShardedParam, value: Any) -> Any:
        if is_piece_sliced(sp) and isinstance(value, DTensor) and value.dim() > 0:
            mesh = self._hsdp_model.mesh
            return piece_sliced_tensor(value.to_local(), sp, mesh.replicas.degrees, mesh.rank)
        return stamp(value)

    def named_state_dict(self) -> dict[str, Any]:
        """``{"state": {fqn: {name: value}}, "param_groups": [{..., "params": [fqn, ...]}]}`` (plus
        ``"hop_residuals"`` with a stateful inter-node hop): what ``optimizer.state_dict()`` returns, and what
        ``get_optimizer_state_dict(model, optimizer)`` returns but for the hop residuals. Refused under DiLoCo
        (``_refuse_diloco``): ``hsdp.save_checkpoint`` saves such a model."""
        _refuse_diloco(self)
        return self._named_state_dict()

    def _named_state_dict(self) -> dict[str, Any]:
        """:meth:`named_state_dict` of this replica's inner optimizer, DiLoCo or not (``hsdp/checkpoint/diloco.py``
        stores each replica's under its own keys)."""
        raw = self._index_state_dict()
        by_param = _sharded_by_param(self._hsdp_model)
        fqn = [by_param[id(p)].fqn for p in self._index_params()]
        state = {fqn[idx]: entries for idx, entries in raw["state"].items()}
        groups = [{**g, "params": [fqn[i] for i in g["params"]]} for g in raw["param_groups"]]
        out = {"state": state, "param_groups": groups}
        hop_state = hop_state_dict(self._hsdp_model.units, self._hsdp_model.mesh)
        if hop_state:
            out["hop_residuals"] = hop_state
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load the FQN-keyed form (``DTensor`` or full tensors); other forms go to the wrapped class.

        Under DiLoCo this is the inner optimizer's state alone: afterwards the global copy is the model's
        current weights, the phase 0 and the outer momentum fresh (``OuterState.restart``), so load the
        model first; ``hsdp.load_checkpoint`` then sets the global copy, outer state and phase it saved."""
        self._load_inner_state_dict(state_dict)
        if self._hsdp_outer is not None:
            self._hsdp_outer.restart()

    def _load_inner_state_dict(self, state_dict: dict[str, Any]) -> None:
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
            state[index[name]] = {k: _as_state(self, sp, k, v) for k, v in entries.items()}
        raw_groups = [{**g, "params": [index[k] for k in g["params"]]} for g in groups]
        super().load_state_dict({"state": state, "param_groups": raw_groups})
        load_hop_state_dict(self._hsdp_model.units, self._hsdp_model.mesh, state_dict.get("hop_residuals", {}))


def _refuse_diloco(optimizer: ShardedOptimizer) -> None:
    """Under DiLoCo the replicas' inner states differ (mid-phase their weights too) and the global copy, outer
    momentum and phase exist besides: a state dict of this rank's, saved with DCP (which keeps one copy of
    identically named shards), would silently keep one replica's. ``hsdp.save_checkpoint`` keeps them all."""
    if optimizer._hsdp_outer is not None:
        raise ValueError("optimizer.state_dict() (and torch's get_state_dict / get_optimizer_state_dict) of a model "
                         "with replica_sync=DiLoCo would keep one replica's inner optimizer state and lose the global "
                         "copy, outer momentum and phase: save with hsdp.save_checkpoint(path, model, optimizer) and "
                         "load with hsdp.load_checkpoint, which keep every replica's state")


def _evaluate(closure: Any) -> Any:
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def _slice_chunk_grads(model: ShardedModel) -> None:
    """Replica-sharded optimizer: a gradient placed like its parameter (this rank's whole chunk, e.g.
    ``torch.zeros_like(p)``, which torch's state dict helpers assign to create the state of a fresh optimizer)
    becomes this replica's slice of it, the gradient layout the sliced step reads (hsdp's own reductions produce
    slices directly)."""
    for sp in model.sharded_params():
        grad = sp.sharded.grad
        if sp.slice is None or not isinstance(grad, DTensor):
            continue
        if isinstance(sp.slice, PieceSliceLayout):
            # Its slices are DTensors placed like the chunk (sharded_param.to_opt_dtensor): tell by the shape.
            chunk_shaped = tuple(grad.to_local().shape) == sp.layout.local_shape != sp.slice.local_shape
        else:
            chunk_shaped = grad.device_mesh == sp.device_mesh and tuple(grad.placements) == sp.layout.placements
        if chunk_shaped:
            sp.sharded.grad = sp.to_opt_dtensor(sp.slice.of_chunk(grad.to_local()))


def _as_state(optimizer: ShardedOptimizer, sp: ShardedParam, key: str, value: Any) -> Any:
    """One loaded state entry in the layout this optimizer keeps (the chunk, or the replica slice)."""
    if isinstance(sp.slice, PieceSliceLayout):
        return piece_slice_state(value, sp)
    if sp.slice is not None:
        check_origin(value, sp.slice_mesh, f"optimizer state {key!r} of {sp.fqn!r}")
        return as_slice_state(value, sp.layout, sp.slice, sp.slice_mesh)
    check_origin(value, sp.device_mesh, f"optimizer state {key!r} of {sp.fqn!r}")
    replicated = state_is_replicated(key, len(sp.layout.global_shape)) and isinstance(optimizer, torch.optim.Adafactor)
    return as_sharded_state(value, sp.layout, sp.device_mesh, replicated)


def _validate(model: Any, optimizer: Any) -> None:
    if not isinstance(model, ShardedModel):
        raise ValueError("ShardedOptimizer needs the ShardedModel: wrap the model with ShardedModel first")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if isinstance(optimizer, ShardedOptimizer):
        raise ValueError("this optimizer is already a ShardedOptimizer: wrap it once")
    why = refusal(optimizer)
    if why is not None:
        raise ValueError(f"{type(optimizer).__name__} is not element-wise and cannot step dim-0 shards: {why}")
    if model.mesh.tp_degree > 1 and _sharded_step(optimizer) is not None:
        # Their sharded steps reduce over the shard group only; a tensor-parallel matrix is split over the tp
        # group too, so row/column statistics (Adafactor) or the orthogonalization (Muon) would be of a piece.
        raise ValueError(f"{type(optimizer).__name__} is not supported with tensor parallelism yet: use an "
                         f"element-wise optimizer (AdamW, SGD, ...), or tensor_parallel_degree=1")


def _base_name(optimizer: ShardedOptimizer) -> str:
    return original_class(optimizer, ShardedOptimizer).__name__


def _own_step(optimizer: torch.optim.Optimizer, cls: type) -> bool:
    """Whether ``optimizer`` steps with ``cls.step`` (not a subclass's override). Compared unwrapped: torch
    wraps ``step`` in place for its hooks."""
    own = original_class(optimizer, ShardedOptimizer)
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
