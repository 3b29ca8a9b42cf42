"""How ``hsdp train`` keeps its replicas in sync: ``parallel.replica_sync``.

``"every_step"`` (the default): every step's gradients cross nodes through the inter-node hop
(``parallel.replica_hop``) and every replica applies the same update: DDP's math.

``"diloco"``: ``hsdp.DiLoCo`` (:mod:`hsdp.engine.replica_sync`). Nothing crosses nodes for H - 1 steps
(H = ``parallel.diloco_every``): each replica trains on its own batches with its own AdamW state. Every H-th step
each rank all-reduces its shards' pseudo-gradient (the global copy minus its weights) over the replicas in
``parallel.diloco_wire_dtype`` (``bf16`` halves the bytes), and an outer SGD (``diloco_outer_lr``, Nesterov
momentum ``diloco_outer_momentum``; the paper's 0.7 and 0.9) steps the global copy, which becomes every replica's
weights. This is not DDP's math: the replicas drift apart between syncs, and the update is the outer optimizer's;
tune H and the outer learning rate against a plain run's held-out loss. Each step's record in ``metrics.jsonl``
says whether it synced (``"synced"``: an outer update landed after its inner AdamW step), and its
``replicate_bytes`` show the spike: one all-reduce of the rank's flat shards on a sync step, 0 on the others. The
step's ``grad_norm`` and ``loss`` are the replica's own; the held-out loss and the sample are the replicas' weights
as they stand (the same on all of them right after a sync step, each its own in between).

Streaming DiLoCo: ``diloco_fragments`` F splits the model's units into F fragments, each synced once every H steps
at its own staggered step (the link carries 1/F of the model at a time); ``diloco_delay`` tau lets a fragment's
all-reduce run behind tau more inner steps before its update lands; ``diloco_mix`` alpha is the share of its own
weights a replica keeps then (0: the global copy replaces them). The records then also say which fragments started
their all-reduce after the step (``"sync_started"``: the step's ``replicate_bytes`` are theirs) and which landed
(``"sync_landed"``), in ``metrics.jsonl`` (the CSV keeps ``synced``). A sync started in the last tau steps of a
run never lands (a checkpoint keeps it for the resumed session). F must not exceed the model's units with
parameters (refused by the optimizer at start-up).

What DiLoCo does not combine with is refused when the configuration is read, before any rank starts: a
``parallel.replica_hop`` other than ``fp32`` (there is no per-step hop to compress; the wire dtype is
``diloco_wire_dtype``), ``shard_optimizer_across_replicas`` (each replica steps its own whole optimizer state),
``elastic``, a list of sharding degrees (replicas of different degrees lay their shards out differently) and
batch weights other than ``"even"`` (a weighted rank's gradient counts its share of the global batch, but DiLoCo
averages inside a replica). Checkpoints (``hsdp.save_checkpoint``: every replica's weights and AdamW state, the
global copy, the outer momentum, the phase and, with ``diloco_delay`` > 0, the fragments' all-reduces in flight)
resume a DiLoCo run bit for bit, mid-phase too; a resume on another number of replicas starts every replica from
the global copy at phase 0 (a warning says so). The ``diloco_*`` fields are read only with ``replica_sync =
"diloco"``; setting one without it is refused, as a forgotten switch would otherwise train plain HSDP.
"""

from __future__ import annotations

import functools
from dataclasses import fields
from typing import TYPE_CHECKING, Any

from hsdp.apps.train.config_rules import fail

if TYPE_CHECKING:
    import hsdp
    from hsdp.apps.train.config import ParallelConfig, RunConfig
    from hsdp.apps.train.trainer import Trainer
    from hsdp.engine.replica_sync import DiLoCo

REPLICA_SYNCS = ("every_step", "diloco")
DILOCO_WIRE_DTYPES = ("fp32", "bf16")
DILOCO_FIELDS = ("diloco_every", "diloco_outer_lr", "diloco_outer_momentum", "diloco_wire_dtype", "diloco_fragments",
                 "diloco_delay", "diloco_mix")
WIRE_BYTES = {"fp32": 4, "bf16": 2}

Problem = tuple[str, Any, str]  # (field, value, why and the fix) in the parallel section


def is_diloco(par: ParallelConfig) -> bool:
    return par.replica_sync == "diloco"


def _defaults(par: ParallelConfig) -> dict[str, Any]:
    return {f.name: f.default for f in fields(par) if f.name in DILOCO_FIELDS}


def check_parallel(par: ParallelConfig) -> None:
    """``ValueError`` naming the field and the fix when the parallel section's replica sync is wrong."""
    problem = _parallel_problem(par)
    if problem:
        fail("parallel", *problem)


def _parallel_problem(par: ParallelConfig) -> Problem | None:
    if par.replica_sync not in REPLICA_SYNCS:
        return "replica_sync", par.replica_sync, f"choose one of {list(REPLICA_SYNCS)}"
    if not is_diloco(par):
        changed = [name for name, default in _defaults(par).items() if getattr(par, name) != default]
        if changed:
            return changed[0], getattr(par, changed[0]), ("is read only with parallel.replica_sync = 'diloco': set "
                                                          "that, or drop it")
        return None
    return _option_problem(par) or _combination_problem(par)


def _option_problem(par: ParallelConfig) -> Problem | None:
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


def _streaming_problem(par: ParallelConfig) -> Problem | None:
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


def _combination_problem(par: ParallelConfig) -> Problem | None:
    """What DiLoCo does not combine with (ShardedModel refuses the first three alike, on every rank)."""
    refused: tuple[tuple[str, Any, bool, str], ...] = (
        ("replica_hop", par.replica_hop, par.replica_hop != "fp32",
         "DiLoCo sends no per-step inter-node hop to compress: set parallel.replica_hop = 'fp32' "
         "(parallel.diloco_wire_dtype = 'bf16' halves the sync's bytes)"),
        ("shard_optimizer_across_replicas", True, par.shard_optimizer_across_replicas,
         "DiLoCo keeps a whole optimizer state per replica: set parallel.shard_optimizer_across_replicas = false"),
        ("elastic", True, par.elastic, "DiLoCo on an elastic job is not supported yet: set parallel.elastic = false"),
        ("sharding_degree", list(par.degree_list or ()), par.degree_list is not None,
         "DiLoCo all-reduces each rank's shards with the same shard of every replica, which replicas of different "
         "degrees do not have: give one integer"),
        ("batch_weights", par.batch_weights, par.batch_weights != "even",
         "a weighted rank's gradient counts its share of the global batch, but DiLoCo averages inside each "
         "replica: set parallel.batch_weights = 'even'"))
    for name, value, bad, why in refused:
        if bad:
            return name, list(value) if isinstance(value, tuple) else value, \
                f"does not combine with parallel.replica_sync = 'diloco': {why}, or parallel.replica_sync = " \
                f"'every_step'"
    return None


def wrap_options(par: ParallelConfig) -> dict[str, Any]:
    """``ShardedModel``'s ``replica_hop`` and ``replica_sync`` arguments for the parallel section."""
    from hsdp.engine.hops import named_hop  # deferred: configurations load without torch

    if not is_diloco(par):
        return {"replica_hop": named_hop(par.replica_hop), "replica_sync": None}
    return {"replica_hop": None, "replica_sync": policy(par)}


@functools.cache
def policy(par: ParallelConfig) -> DiLoCo:
    """The ``hsdp.DiLoCo`` of a ``replica_sync = "diloco"`` section."""
    import torch  # deferred: configurations load without torch

    from hsdp.engine.replica_sync import DiLoCo

    wire = None if par.diloco_wire_dtype == "fp32" else torch.bfloat16
    return DiLoCo(every=par.diloco_every, outer_lr=par.diloco_outer_lr, outer_momentum=par.diloco_outer_momentum,
                  wire_dtype=wire, fragments=par.diloco_fragments, delay=par.diloco_delay, mix=par.diloco_mix)


def step_fields(trainer: Trainer) -> dict[str, Any]:
    """What a step's record adds under DiLoCo (``{}`` otherwise), from the optimizer's ``last_sync``: ``synced``,
    whether an outer update landed after the step (with one fragment and no delay: every H-th step); with
    fragments or a delay also ``sync_started`` and ``sync_landed``, the fragments whose all-reduce started and
    whose update landed (a checkpoint keeps the syncs in flight, so a resumed run lands those started before it)."""
    par = trainer.cfg.parallel
    record = trainer.optimizer.last_sync if is_diloco(par) else None
    if record is None:
        return {}
    if par.diloco_fragments == 1 and par.diloco_delay == 0:
        return {"synced": bool(record.landed)}
    return {"synced": bool(record.landed), "sync_started": list(record.started), "sync_landed": list(record.landed)}


def summary_fields(cfg: RunConfig, records: list[dict[str, Any]], n_params: int,
                   mesh: hsdp.HSDPMesh) -> dict[str, Any]:
    """``summary.json``'s ``"replica_sync"`` entry under DiLoCo (``{}`` otherwise): the options, the steps after
    which an update landed and the inter-node floor per node of one sync of the whole model (every fragment once,
    each H steps), ``2(R-1)/R x P x b``."""
    par = cfg.parallel
    if not is_diloco(par):
        return {}
    replicas = mesh.replicate_degree
    per_sync = 2 * (replicas - 1) / replicas * n_params * WIRE_BYTES[par.diloco_wire_dtype]
    return {"replica_sync": {"mode": "diloco", "every": par.diloco_every, "outer_lr": par.diloco_outer_lr,
                             "outer_momentum": par.diloco_outer_momentum, "wire_dtype": par.diloco_wire_dtype,
                             "fragments": par.diloco_fragments, "delay": par.diloco_delay, "mix": par.diloco_mix,
                             "synced_steps": [r["step"] for r in records if r.get("synced")],
                             "inter_node_floor_bytes_per_sync": per_sync}}
