"""DiLoCo's outer state (``outer_step.OuterState``) as per-parameter tensors a checkpoint can hold, and back.

``OuterState`` keeps one fp32 flat per unit, laid out like the unit's flat shard (this rank's padded chunk of
every parameter, in order). A checkpoint must reshard to any shard degree, so every flat is cut into the
parameters' chunks and each chunk is handed out as a ``DTensor`` placed like the parameter (``ShardedParam
.to_dtensor``: ``Shard(0)`` on the replica's mesh, the parameter's global shape), exactly as the parameters
and the inner optimizer's state are. The padding rows are not saved: they are zero (see ``outer_step.py``).

:func:`outer_state_dict` gives ``{"global": {fqn: fp32 DTensor}, "outer": {fqn: {name: DTensor}},
"outer_scalars": {fqn: {name: scalar}}, "phase": int64 scalar}``: the global copy, the outer optimizer's
per-element state (the momentum) in the same layout, its scalars (a step count, repeated under every parameter of
the unit: units are an implementation detail, parameter names are not), and the phase (inner steps since the
last sync). :func:`load_outer_state_dict` takes that dict back (any layout DCP resharded it to). The outer
optimizer's hyper-parameters are not saved: they are the ``DiLoCo`` policy's, as built.

[Note: syncs in flight] Under Streaming DiLoCo (``delay > 0``) a fragment's pseudo-gradient all-reduce may be in
flight when the checkpoint is taken: its outer update is still to apply, so it is part of the outer state. The
save waits for it (every rank started the same all-reduces, so every rank can) and keeps the fp32 mean under
each of the fragment's parameters as ``outer[fqn]["pending_pseudo_gradient"]`` (sharded like the parameter)
with ``outer_scalars[fqn]["pending_steps_left"]`` (the inner steps before it lands); the load puts the syncs back
as already reduced, so each lands at the same step with the same values: the resume is bitwise. A load without
the phase (another replica count: every replica restarts from the global copy) drops them with the inner steps
since the last sync. The fragments must be split as saved (the same units and ``fragments``). On an elastic mesh a
sync whose all-reduce failed on this rank (a member died; the survivors redo it where it lands) is not kept: a
resume from that checkpoint lands nothing for it.

Under ``DiLoCo(wire_dtype=torch.int8)`` each rank's residuals (``outer_wire.py``) are state of its replica, not
shared: :func:`residual_state_dict` gives them by parameter name (sharded like the parameter), the checkpoint
layer files them under the replica's own keys, and :func:`load_outer_state_dict` takes them back under
``sd["residual"]``; a load without them (another replica count, a checkpoint of another wire) starts them from
zero.

``OuterState.restart`` is what loading state without DiLoCo's part means: the global copy becomes the model's
current weights, the phase 0 and the outer optimizer's state (its momentum) starts fresh, as at the optimizer's
construction. ``ShardedOptimizer.load_state_dict`` calls it after loading the inner state, and the next inner
step calls it after any load of the model alone (``outer_step.py``, [Note: loads after the optimizer]).

The inner state of every replica (its weights and inner optimizer state, which differ between replicas
mid-phase and, for the optimizer, always) is the checkpoint layer's business: ``hsdp/checkpoint/diloco.py``.
"""

from __future__ import annotations

from typing import Any

import torch

from hsdp.engine.optim.outer_pending import PendingSync
from hsdp.engine.optim.outer_step import OuterState, chunks
from hsdp.engine.optim.outer_wire import residual_flat, set_residual_flat
from hsdp.engine.runtime.origin import stamp

PENDING, LEFT = "pending_pseudo_gradient", "pending_steps_left"  # see [Note: syncs in flight]
RESIDUAL = "residual"  # the int8 wire's residuals: per replica, under its own keys (``outer_wire.py``)


def global_weights(outer: OuterState) -> dict[str, torch.Tensor]:
    """The global copy in each parameter's dtype, by parameter name: what a model without DiLoCo loads."""
    out = {}
    for i, flat in enumerate(outer.global_copy):
        for p, chunk in chunks(outer, i, flat):
            out[p.fqn] = stamp(p.to_dtensor(chunk.to(p.dtype)))
    return out


def check_savable(outer: OuterState) -> None:
    """``ValueError`` naming the fix for a state :func:`outer_state_dict` cannot hold (call it before the first
    collective of a save: every rank holds the same outer state, so every rank raises)."""
    for flat in outer.global_copy:
        for name, value in outer.outer.state.get(flat, {}).items():
            _kind(name, value, flat)


def _kind(name: str, value: Any, flat: torch.Tensor) -> str | None:
    """How outer state ``value`` is saved: ``"outer"`` (per element, flat-shaped), ``"outer_scalars"``, or
    ``None`` (unset: torch's optimizers create it at their next step)."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor) and value.shape == flat.shape:
        return "outer"
    if isinstance(value, torch.Tensor) and value.dim() == 0:
        return "outer_scalars"
    shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
    raise ValueError(f"outer optimizer state {name!r} is {shape}, neither the global copy's shape "
                     f"{tuple(flat.shape)} nor a scalar: a checkpoint cannot hold it; use an element-wise outer "
                     f"optimizer (torch's SGD, Adam, AdamW, ...)")


def outer_state_dict(outer: OuterState) -> dict[str, Any]:
    """The global copy, the outer optimizer's state, the syncs in flight and the phase (module docstring; waits
    for the all-reduces in flight, see [Note: syncs in flight]); views, no copy."""
    check_savable(outer)
    outer.settle()
    out: dict[str, Any] = {"global": {}, "outer": {}, "outer_scalars": {},
                           "phase": torch.tensor(outer.inner_steps, dtype=torch.int64)}
    for i, flat in enumerate(outer.global_copy):
        for p, chunk in chunks(outer, i, flat):
            out["global"][p.fqn] = stamp(p.to_dtensor(chunk))
        for name, value in outer.outer.state.get(flat, {}).items():
            kind = _kind(name, value, flat)
            if kind == "outer":
                for p, chunk in chunks(outer, i, value):
                    out[kind].setdefault(p.fqn, {})[name] = stamp(p.to_dtensor(chunk))
            elif kind == "outer_scalars":
                for p in outer.units[i].params:
                    out[kind].setdefault(p.fqn, {})[name] = value
    for sync in (s for s in outer.pending if not s.failed):  # (a failed one is redone where it lands)
        left = torch.tensor(sync.left, dtype=torch.int64)
        for i, mean in zip(outer.fragments[sync.fragment], sync.settle(), strict=True):
            for p, chunk in chunks(outer, i, mean):
                out["outer"].setdefault(p.fqn, {})[PENDING] = stamp(p.to_dtensor(chunk))
                out["outer_scalars"].setdefault(p.fqn, {})[LEFT] = left
    return out


@torch.no_grad()
def load_outer_state_dict(outer: OuterState, sd: dict[str, Any]) -> None:
    """Set the global copy, the outer optimizer's state and the phase from :func:`outer_state_dict`'s layout
    (values: DTensors placed like the parameters, or this rank's chunks). Missing ``"outer"`` parts leave the
    outer optimizer fresh, a missing ``"phase"`` starts the phase at 0 with no sync in flight."""
    outer.drop_pending()
    for i, flat in enumerate(outer.global_copy):
        flat.zero_()  # padding rows are zero
        for p, chunk in chunks(outer, i, flat):
            chunk.copy_(_local(sd["global"][p.fqn]))
    index = {id(t): n for n, t in enumerate(t for g in outer.outer.param_groups for t in g["params"])}
    state, in_flight = {}, {}
    for i, flat in enumerate(outer.global_copy):
        entries = {**_unit_flats(outer, i, sd.get("outer", {})), **_unit_scalars(outer, i, sd.get("outer_scalars", {}))}
        mean, left = entries.pop(PENDING, None), entries.pop(LEFT, None)
        if mean is not None and left is not None:
            in_flight[i] = (int(left), mean)
        if entries:
            state[index[id(flat)]] = entries
    outer.outer.state.clear()
    # torch's own load: it casts and places every value as the outer optimizer keeps it (a step on the CPU).
    outer.outer.load_state_dict({"state": state, "param_groups": outer.outer.state_dict()["param_groups"]})
    phase = sd.get("phase")
    outer.inner_steps = 0 if phase is None else int(phase)
    outer.pending = [] if phase is None else _pending(outer, in_flight)
    _load_residuals(outer, sd.get(RESIDUAL, {}))
    outer.mark_written()  # the model's weights were loaded with this state: no restart at the next step


def residual_state_dict(outer: OuterState) -> dict[str, torch.Tensor]:
    """This rank's int8-wire residuals by parameter name, each a DTensor placed like the parameter (``{}`` for a
    float wire, and for units before their first sync): its replica's own state, not the shared outer state."""
    out: dict[str, torch.Tensor] = {}
    if outer.wire is None:
        return out
    for i, unit in enumerate(outer.units):
        flat = residual_flat(outer.wire, unit, outer.residual_plan(unit))
        if flat is not None:
            for p, chunk in chunks(outer, i, flat):
                out[p.fqn] = stamp(p.to_dtensor(chunk))
    return out


def _load_residuals(outer: OuterState, saved: dict[str, Any]) -> None:
    """The int8 wire's residuals from :func:`residual_state_dict`'s layout (this rank's replica's); zero where
    none is saved. Ignored under a float wire."""
    if outer.wire is None:
        return
    outer.wire.residuals = {}
    for i, unit in enumerate(outer.units):
        if not any(p.fqn in saved for p in unit.params):
            continue
        flat = torch.zeros_like(outer.global_copy[i])  # padding rows: zero, as every pseudo-gradient's
        for p, chunk in chunks(outer, i, flat):
            if p.fqn in saved:
                chunk.copy_(_local(saved[p.fqn]))
        set_residual_flat(outer.wire, unit, outer.residual_plan(unit), flat)


def _pending(outer: OuterState, in_flight: dict[int, tuple[int, torch.Tensor]]) -> list[PendingSync]:
    """The saved syncs in flight (unit index -> (steps left, fp32 mean)) as reduced ``PendingSync``s, in the
    order started (the fewest steps left first)."""
    out = []
    for fragment, indices in enumerate(outer.fragments):
        saved = [in_flight.get(i) for i in indices]
        if all(s is None for s in saved):
            continue
        lefts = {s[0] for s in saved if s is not None}
        if any(s is None for s in saved) or len(lefts) != 1:
            raise ValueError(f"the checkpoint's DiLoCo syncs in flight do not cover fragment {fragment} "
                             f"({[outer.units[i].name for i in indices]}) as one: it was saved with other "
                             f"fragments; resume with the DiLoCo(fragments=...) and units it was saved with")
        out.append(PendingSync(fragment, lefts.pop(), [], [], reduced=[s[1] for s in saved if s is not None]))
    return sorted(out, key=lambda sync: sync.left)


def _saved(outer: OuterState, i: int, saved: dict[str, dict[str, Any]]) -> dict[str, list[Any]]:
    """Every state name saved for unit ``i``'s parameters -> its value under each parameter, in order."""
    params = outer.units[i].params
    names = sorted({name for p in params for name in saved.get(p.fqn, {})})
    out = {name: [saved.get(p.fqn, {}).get(name) for p in params] for name in names}
    for name, values in out.items():
        if any(v is None for v in values):
            raise ValueError(f"outer optimizer state {name!r} is saved for some parameters of unit "
                             f"{outer.units[i].name} only: the checkpoint is of another model")
    return out


def _unit_flats(outer: OuterState, i: int, saved: dict[str, dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Unit ``i``'s per-element outer state, its parameters' chunks laid out as a flat again."""
    out = {}
    for name, values in _saved(outer, i, saved).items():
        flat = torch.zeros_like(outer.global_copy[i], dtype=_local(values[0]).dtype)
        for (_, chunk), value in zip(chunks(outer, i, flat), values, strict=True):
            chunk.copy_(_local(value))
        out[name] = flat
    return out


def _unit_scalars(outer: OuterState, i: int, saved: dict[str, dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Unit ``i``'s outer scalars (the same under each of its parameters: the first one's)."""
    return {name: _local(values[0]).clone() for name, values in _saved(outer, i, saved).items()}


def _local(value: Any) -> torch.Tensor:
    return value.to_local() if hasattr(value, "to_local") else value
