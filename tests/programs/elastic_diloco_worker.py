"""One rank of one replica of an elastic DiLoCo job (tests/test_elastic_diloco.py runs it under ``hsdp launch
--elastic``).

Environment: what torchrun and ``hsdp launch --elastic`` give a rank, ``ELASTIC_OUT`` (a folder),
``ELASTIC_SYNC`` (a key of ``SYNCS``: whole-model DiLoCo, or Streaming DiLoCo with two fragments and a delay),
``ELASTIC_MID_SYNC`` ("0": replica 1 does not die mid-sync; default "1") and ``ELASTIC_WIRE`` ("int8": the int8
wire). Three replicas (of any rank counts: the launch's ``--nproc-per-node 2,1,1`` gives them different shard
degrees) train the same tiny model, inner AdamW,
syncing each fragment every ``EVERY`` inner steps through an outer Nesterov SGD (``hsdp.DiLoCo``); at inner step
k, replica r's rank s reads batch ``(k, 3 r + s)``. Two faults (one without ``ELASTIC_MID_SYNC``), each in a
replica's first incarnation (torchrun restarts it, and it rejoins at a sync boundary):

- mid-phase: replica ``2``'s ranks SIGKILL themselves in the backward of inner step ``MID_PHASE_STEP`` (a step
  with no sync in flight);
- mid-sync: once replica 2 is back (a sync with all three more than a phase after that step), replica ``1``'s
  ranks SIGKILL themselves at the next sync's start, just before their pseudo-gradient all-reduce: the others'
  all-reduce fails and they redo that sync among themselves (with a delay, where it was to land).

Each rank logs to ``<out>/r<replica>_s<rank>_i<pid>.jsonl``: ``{"joined": k}`` once its optimizer exists (k: the
inner step it goes on at, after the heal; with the fragments' parameter names), then per inner step its loss, the
fragments whose sync started and landed after it, how long its syncs waited for the others (``last_sync.waited``:
replica 1 reaches its first sync start after step 0 ``LATE_S`` late) and the last sync's replicas
(``model.last_step``). The run stops
after two consecutive syncs of all three replicas following a sync without the last victim (replica 1; replica 2
without the mid-sync fault), the restarted victim counting its own join as one when it landed a sync, then checks
replicas (the global copy) and saves the full parameters; then ``opt.sync_replicas()``, the full parameters again
(``final_...``), and one replica alone (``ELASTIC_WRITER``, default 0) checkpoints (``<out>/checkpoint``), as
``hsdp train``'s writer does.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import torch

import hsdp
from hsdp.engine.optim import outer_step

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from models import ParityNet, batch, loss_fn

REPLICAS, EVERY = 3, 3
# Per case: the policy, and the inner step in whose backward replica 2 dies (no sync in flight then).
SYNCS = {"whole": (dict(), 4), "streaming": (dict(fragments=2, delay=1), 5)}
MAX_STEPS = 600  # a safety bound
# A pause per step: survivors leave the CPUs to a restart (2 cores in CI), the more while a replica is away: fewer
# syncs before its restart is back however slow the machine (each adds float rounding for the replay to match at
# 1e-5: 0.05 s let a slow restart's survivors run 180 steps and drift 1.2e-5 from it), more CPU for it.
PACE_S, AWAY_PACE_S = 0.05, 0.5
POLICY = hsdp.ElasticPolicy(heartbeat_interval=0.1, heartbeat_timeout=4.0, hop_timeout=60.0, connect_timeout=10.0,
                            join_timeout=120.0)
CASE, MID_PHASE_STEP = SYNCS[os.environ.get("ELASTIC_SYNC", "whole")]
WIRE = torch.int8 if os.environ.get("ELASTIC_WIRE") == "int8" else None  # ELASTIC_WIRE=int8: DiLoCo's int8 wire
SYNC = hsdp.DiLoCo(every=EVERY, outer_lr=0.7, outer_momentum=0.9, wire_dtype=WIRE, **CASE)
MID_SYNC = os.environ.get("ELASTIC_MID_SYNC", "1") == "1"
OFFSETS = {SYNC.offset(f) for f in range(SYNC.fragments)}  # phases at which a fragment's sync starts
LATE_S = 1.0  # replica 1 reaches its first sync start after step 0 this late (the others' last_sync.waited)
LAST_VICTIM = 1 if MID_SYNC else 2  # whose rejoining ends the run
WRITER = int(os.environ.get("ELASTIC_WRITER", "0"))  # the replica that checkpoints at the end (alone)


def main() -> None:
    torch.set_num_threads(1)
    out, replica = os.environ["ELASTIC_OUT"], int(os.environ["HSDP_REPLICA_ID"])
    first = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    mesh = hsdp.init_mesh(elastic=POLICY, fault_policy=hsdp.FaultPolicy(timeout=8, interval=0.5))
    rank = mesh.shard_rank
    log = open(os.path.join(out, f"r{replica}_s{rank}_i{os.getpid()}.jsonl"), "w")  # noqa: SIM115

    def fault(kind: str) -> None:
        log.write(json.dumps({"fault": kind, "t": time.time()}) + "\n")
        log.flush()
        os.kill(os.getpid(), signal.SIGKILL)

    armed = {"mid-sync": False}
    start = outer_step.OuterState._start

    def start_or_die(self: outer_step.OuterState, fragment: int) -> outer_step.PendingSync:
        if armed["mid-sync"]:
            fault("mid-sync")
        return start(self, fragment)

    if replica == 1 and first and MID_SYNC:
        outer_step.OuterState._start = start_or_die  # type: ignore[method-assign]

    torch.manual_seed(replica)  # replicas start different: the first sync's heal makes them all replica 0
    model = hsdp.ShardedModel(ParityNet(), mesh=mesh, replica_sync=SYNC)
    opt = hsdp.ShardedOptimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    step = model.last_step.step + 1
    outer = opt._hsdp_outer
    fragments = [[p.fqn for u in outer.fragment_units(f) for p in u.params] for f in range(SYNC.fragments)]
    log.write(json.dumps({"joined": step, "replicas": list(model.last_step.replicas), "fragments": fragments,
                          "t": time.time()}) + "\n")
    log.flush()
    step_now = {"k": step}

    def die(*_: object) -> None:
        if replica == 2 and first and step_now["k"] == MID_PHASE_STEP:
            fault("mid-phase")

    model.blocks[1].register_full_backward_pre_hook(die)
    # A restarted last victim came back after its fault: its join is a sync of all three after it.
    after = not first and replica == LAST_VICTIM
    joined_sync = opt.last_sync is not None and bool(opt.last_sync.landed)  # its join landed a sync
    together = 1 if after and joined_sync and len(model.last_step.replicas) == REPLICAS else 0
    late = True  # replica 1's one late start still to come
    while step < MAX_STEPS:
        step_now["k"] = step
        x, y = batch(step, REPLICAS * replica + rank)
        loss = loss_fn(model(x), y)
        loss.backward()
        if replica == 1 and first and 1 <= step < MID_PHASE_STEP and (step + 1) % EVERY in OFFSETS and late:
            late = False
            log.write(json.dumps({"late": step, "seconds": LATE_S}) + "\n")
            time.sleep(LATE_S)
        opt.step()
        opt.zero_grad()
        last, synced = model.last_step, bool(opt.last_sync.landed)
        time.sleep(PACE_S if len(last.replicas) == REPLICAS else AWAY_PACE_S)
        log.write(json.dumps({"step": last.step, "loss": loss.item(), "synced": synced,
                              "started": list(opt.last_sync.started), "landed": list(opt.last_sync.landed),
                              "replicas": list(last.replicas), "waited": opt.last_sync.waited,
                              "t": time.time()}) + "\n")
        log.flush()
        step = last.step + 1
        if not synced:
            continue
        everyone = len(last.replicas) == REPLICAS
        if LAST_VICTIM not in last.replicas:
            after = True
        together = together + 1 if after and everyone else 0
        if replica == 1 and everyone and last.step > MID_PHASE_STEP + EVERY:
            armed["mid-sync"] = True  # replica 2 is back: die at the next sync
        if together >= 2:
            break
    model.check_replicas()
    torch.save({n: p.detach().full_tensor() for n, p in model.named_parameters()},
               os.path.join(out, f"params_r{replica}_s{rank}.pt"))
    # The end of training as hsdp train ends it: every fragment synced (the replicas leave with the global copy),
    # then one replica alone checkpoints, with no step of the job open (the others are gone by then).
    opt.sync_replicas()
    torch.save({n: p.detach().full_tensor() for n, p in model.named_parameters()},
               os.path.join(out, f"final_r{replica}_s{rank}.pt"))
    if replica == WRITER:
        hsdp.save_checkpoint(os.path.join(out, "checkpoint"), model, opt)
    log.write(json.dumps({"done": step}) + "\n")
    log.close()


if __name__ == "__main__":
    main()
