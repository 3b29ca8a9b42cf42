"""``hsdp train``'s checks of ``parallel.replica_sync`` and the ``diloco_*`` fields, when the configuration is
read (``config.py`` calls :func:`check_parallel`; what the options do: ``replica_sync.py``).

Typed by :class:`SyncFields`, the parallel section's fields read here, so this module needs nothing of
``config.py``, which imports it."""

from __future__ import annotations

from dataclasses import fields
from typing import Any, Protocol

from hsdp.apps.train.config_rules import fail


class SyncFields(Protocol):
    """The fields of ``[parallel]`` (``config.ParallelConfig``, a dataclass) the checks read."""

    replica_sync: str
    diloco_every: int
    diloco_outer_lr: float
    diloco_outer_momentum: float
    diloco_wire_dtype: str
    diloco_fragments: int
    diloco_delay: int
    diloco_mix: float
    replica_hop: str
    shard_optimizer_across_replicas: bool
    elastic: bool
    batch_weights: Any

    @property
    def degree_list(self) -> tuple[int, ...] | None: ...


REPLICA_SYNCS = ("every_step", "diloco")
DILOCO_WIRE_DTYPES = ("fp32", "bf16", "int8")
DILOCO_FIELDS = ("diloco_every", "diloco_outer_lr", "diloco_outer_momentum", "diloco_wire_dtype", "diloco_fragments",
                 "diloco_delay", "diloco_mix")
WIRE_BYTES = {"fp32": 4, "bf16": 2, "int8": 1 + 4 / 256}  # int8: one byte per element, an fp32 scale per 256

Problem = tuple[str, Any, str]  # (field, value, why and the fix) in the parallel section


def is_diloco(par: SyncFields) -> bool:
    return par.replica_sync == "diloco"


def sync_floor(wire_dtype: str, replicas: int, n_params: int) -> float:
    """Inter-node bytes a node sends per sync of the whole model: an all-reduce in the wire dtype,
    ``2(R-1)/R x P x b``; the int8 wire all-gathers every replica's blocks and scales, ``(R-1) x P x (1 + 4/256)``."""
    if wire_dtype == "int8":
        return (replicas - 1) * n_params * WIRE_BYTES[wire_dtype]
    return 2 * (replicas - 1) / replicas * n_params * WIRE_BYTES[wire_dtype]


def _defaults(par: SyncFields) -> dict[str, Any]:
    return {f.name: f.default for f in fields(par) if f.name in DILOCO_FIELDS}  # type: ignore[arg-type]


def check_parallel(par: SyncFields) -> None:
    """``ValueError`` naming the field and the fix when the parallel section's replica sync is wrong."""
    problem = _parallel_problem(par)
    if problem:
        fail("parallel", *problem)


def _parallel_problem(par: SyncFields) -> Problem | None:
    if par.replica_sync not in REPLICA_SYNCS:
        return "replica_sync", par.replica_sync, f"choose one of {list(REPLICA_SYNCS)}"
    if not is_diloco(par):
        changed = [name for name, default in _defaults(par).items() if getattr(par, name) != default]
        if changed:
            return changed[0], getattr(par, changed[0]), ("is read only with parallel.replica_sync = 'diloco': set "
                                                          "that, or drop it")
        return None
    return _option_problem(par) or _combination_problem(par)


def _option_problem(par: SyncFields) -> Problem | None:
    if isinstance(par.diloco_every, bool) or par.diloco_every < 1:
        return "diloco_every", par.diloco_every, ("the inner steps between syncs must be at least 1 (1 syncs every "
                                                  "step; the DiLoCo paper uses 500, torchft 40)")
    if not par.diloco_outer_lr > 0:
        return "diloco_outer_lr", par.diloco_outer_lr, "must be positive (the paper: 0.7)"
    if not 0 <= par.diloco_outer_momentum < 1:
        return "diloco_outer_momentum", par.diloco_outer_momentum, "must lie in [0, 1) (the paper: 0.9)"
    if par.diloco_wire_dtype not in DILOCO_WIRE_DTYPES:
        return "diloco_wire_dtype", par.diloco_wire_dtype, f"choose one of {list(DILOCO_WIRE_DTYPES)}"
    return _streaming_problem(par)


def _streaming_problem(par: SyncFields) -> Problem | None:
    every = par.diloco_every
    if not 1 <= par.diloco_fragments <= every:
        return "diloco_fragments", par.diloco_fragments, (f"each fragment syncs at its own step of the "
                                                          f"parallel.diloco_every = {every}: use 1 to {every}")
    if not 0 <= par.diloco_delay < every:
        return "diloco_delay", par.diloco_delay, (f"a fragment's update must land before its next sync: use 0 to "
                                                  f"{every - 1} (parallel.diloco_every - 1)")
    if not 0 <= par.diloco_mix < 1:
        return "diloco_mix", par.diloco_mix, "must lie in [0, 1) (0: the global copy replaces the local weights)"
    return None


def _combination_problem(par: SyncFields) -> Problem | None:
    """DiLoCo next to a per-step hop setting: two choices of one thing (the pairs that do not combine are the
    one table's: ``ParallelConfig._check_combinations``)."""
    if par.elastic and par.diloco_delay * par.diloco_fragments > par.diloco_every:
        # The library's check (replica_sync.check_replica_sync): one fragment's sync in flight at a time.
        return "diloco_delay", par.diloco_delay, (
            f"Streaming DiLoCo with parallel.elastic = true keeps one fragment's sync in flight at a time, so a "
            f"fragment's update must land before the next fragment starts: use parallel.diloco_delay <= "
            f"parallel.diloco_every // parallel.diloco_fragments ({par.diloco_every // par.diloco_fragments})")
    if par.replica_hop != "fp32":
        return "replica_hop", par.replica_hop, (
            "does not combine with parallel.replica_sync = 'diloco': DiLoCo sends no per-step inter-node hop to "
            "compress: set parallel.replica_hop = 'fp32' (parallel.diloco_wire_dtype = 'bf16' halves the sync's "
            "bytes, 'int8' quarters them), or parallel.replica_sync = 'every_step'")
    return None
