"""How ``hsdp train`` keeps its replicas in sync: ``parallel.replica_sync``.

``"every_step"`` (the default): every step's gradients cross nodes through the inter-node hop
(``parallel.replica_hop``) and every replica applies the same update: DDP's math.

``"diloco"``: ``hsdp.DiLoCo`` (:mod:`hsdp.engine.replica_sync`). Nothing crosses nodes for H - 1 steps
(H = ``parallel.diloco_every``): each replica trains on its own batches with its own AdamW state. Every H-th step
each rank all-reduces its shards' pseudo-gradient (the global copy minus its weights) over the replicas in
``parallel.diloco_wire_dtype`` (``bf16`` halves the bytes; ``int8`` quantises with error feedback, about a
quarter with two replicas), and an outer SGD (``diloco_outer_lr``, Nesterov
momentum ``diloco_outer_momentum``; the paper's 0.7 and 0.9) steps the global copy, which becomes every replica's
weights. This is not DDP's math: the replicas drift apart between syncs, and the update is the outer optimizer's;
tune H and the outer learning rate against a plain run's held-out loss. Each step's record in ``metrics.jsonl``
says whether it synced (``"synced"``: an outer update landed after its inner AdamW step), and its
``replicate_bytes`` show the spike: one all-reduce of the rank's flat shards on a sync step, 0 on the others. The
step's ``grad_norm`` and ``loss`` are the replica's own; the held-out loss and the sample are the replicas' weights
as they stand (the same on all of them right after a sync step, each its own in between). The last of
``train.steps`` ends with ``opt.sync_replicas()`` (:func:`sync_at_end`; its record says ``"synced_all"``): every
fragment synced at once, so the final evaluation, sample, checkpoint and export are the global copy with every
replica's last steps in, and the replicas leave equal (on an elastic mesh too: the replicas present at that sync).

Streaming DiLoCo: ``diloco_fragments`` F splits the model's units into F fragments, each synced once every H steps
at its own staggered step (the link carries 1/F of the model at a time); ``diloco_delay`` tau lets a fragment's
all-reduce run behind tau more inner steps before its update lands; ``diloco_mix`` alpha is the share of its own
weights a replica keeps then (0: the global copy replaces them). The records then also say which fragments started
their all-reduce after the step (``"sync_started"``: the step's ``replicate_bytes`` are theirs) and which landed
(``"sync_landed"``), in ``metrics.jsonl`` (the CSV keeps ``synced``). A sync started in the last tau steps of a
session stopped early (``train.stop_after``, a signal) lands in the resumed one (its checkpoint keeps it). F must
not exceed the model's units with parameters (refused by the optimizer at start-up).

What DiLoCo does not combine with is refused when the configuration is read, before any rank starts: a
``parallel.replica_hop`` other than ``fp32`` (there is no per-step hop to compress; the wire dtype is
``diloco_wire_dtype``), ``shard_optimizer_across_replicas`` (each replica steps its own whole optimizer state), and
with ``elastic`` a ``diloco_delay`` above ``diloco_every // diloco_fragments`` (one fragment's sync in flight at a
time). A list of sharding degrees, batch weights and ``elastic`` combine with it (a sync averages the
pseudo-gradients piece by piece, each replica's weighted by the batch weight it processed since the last sync; on an
elastic job, replicas of different degrees included, each sync is a transaction of the replicas present). Checkpoints
(``hsdp.save_checkpoint``: every replica's weights and AdamW state, the global copy, the outer momentum, the phase
and, with ``diloco_delay`` > 0, the fragments' all-reduces in flight) resume a DiLoCo run bit for bit, mid-phase
too; a resume on another number of replicas starts every replica from the global copy at phase 0 (a warning says
so). The ``diloco_*`` fields are read only with ``replica_sync = "diloco"``; setting one without it is refused, as a
forgotten switch would otherwise train plain HSDP.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from hsdp.apps.train.config_replica_sync import is_diloco, sync_floor

if TYPE_CHECKING:
    import hsdp
    from hsdp.apps.train.config import ParallelConfig, RunConfig
    from hsdp.engine.replica_sync import DiLoCo


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

    wire = {"fp32": None, "bf16": torch.bfloat16, "int8": torch.int8}[par.diloco_wire_dtype]
    return DiLoCo(every=par.diloco_every, outer_lr=par.diloco_outer_lr, outer_momentum=par.diloco_outer_momentum,
                  wire_dtype=wire, fragments=par.diloco_fragments, delay=par.diloco_delay, mix=par.diloco_mix)


def step_fields(par: ParallelConfig, optimizer: hsdp.ShardedOptimizer) -> dict[str, Any]:
    """What a step's record adds under DiLoCo (``{}`` otherwise), from the optimizer's ``last_sync``: ``synced``,
    whether an outer update landed after the step (with one fragment and no delay: every H-th step); with
    fragments or a delay also ``sync_started`` and ``sync_landed``, the fragments whose all-reduce started and
    whose update landed (a checkpoint keeps the syncs in flight, so a resumed run lands those started before it)."""
    record = optimizer.last_sync if is_diloco(par) else None
    if record is None:
        return {}
    if par.diloco_fragments == 1 and par.diloco_delay == 0:
        return {"synced": bool(record.landed)}
    return {"synced": bool(record.landed), "sync_started": list(record.started), "sync_landed": list(record.landed)}


def sync_at_end(par: ParallelConfig, optimizer: hsdp.ShardedOptimizer, fields: dict[str, Any]) -> dict[str, Any]:
    """After the last of ``train.steps`` under DiLoCo: ``optimizer.sync_replicas()``, so the final evaluation,
    sample, checkpoint and export hold the global copy with every replica's last steps in (not the copy of the last
    sync, nor one replica's weights), and every replica leaves with it. ``fields`` (the step's own
    :func:`step_fields`) gain that sync's fragments and ``synced_all``. Not at ``train.stop_after``: a session
    stopped there resumes bit for bit."""
    if not is_diloco(par):
        return fields
    optimizer.sync_replicas()
    final = step_fields(par, optimizer)
    merged = {key: value + final[key] for key, value in fields.items() if key != "synced"}
    return {**fields, **merged, "synced": True, "synced_all": True}


def summary_fields(cfg: RunConfig, records: list[dict[str, Any]], n_params: int,
                   mesh: hsdp.HSDPMesh) -> dict[str, Any]:
    """``summary.json``'s ``"replica_sync"`` entry under DiLoCo (``{}`` otherwise): the options, the steps after
    which an update landed and the inter-node floor per node of one sync of the whole model (every fragment once,
    each H steps), ``2(R-1)/R x P x b`` (int8: ``(R-1) x P x (1 + 4/256)``, an all-gather)."""
    par = cfg.parallel
    if not is_diloco(par):
        return {}
    replicas = mesh.replicate_degree
    per_sync = sync_floor(par.diloco_wire_dtype, replicas, n_params)
    return {"replica_sync": {"mode": "diloco", "every": par.diloco_every, "outer_lr": par.diloco_outer_lr,
                             "outer_momentum": par.diloco_outer_momentum, "wire_dtype": par.diloco_wire_dtype,
                             "fragments": par.diloco_fragments, "delay": par.diloco_delay, "mix": par.diloco_mix,
                             "synced_steps": [r["step"] for r in records if r.get("synced")],
                             "inter_node_floor_bytes_per_sync": per_sync}}
