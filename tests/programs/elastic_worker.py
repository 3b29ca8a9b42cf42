"""One rank of one replica of an elastic hsdp job (tests/test_elastic.py runs it under ``hsdp launch --elastic``).

Environment: what torchrun and ``hsdp launch --elastic`` give a rank (RANK, WORLD_SIZE, ..., HSDP_COORDINATOR,
HSDP_REPLICA_ID, HSDP_ELASTIC_JOB, TORCHELASTIC_RESTART_COUNT); ``ELASTIC_OUT`` (a folder), ``ELASTIC_FAULT``
(``kill`` or ``stop`` with ``ELASTIC_VICTIM`` and ``ELASTIC_FAULT_STEP``: in its first incarnation, that
replica's ranks SIGKILL, or its rank 0 SIGSTOPs, itself in the backward of that step; restarted, it runs
without the fault).

Every replica trains the same tiny model with AdamW; at step k, replica r's rank s reads batch ``(k, r, s)``
(``ELASTIC_ACCUM`` micro-batches of it, the inter-node hop deferred to the last).
Each rank appends what ``model.last_step`` says after every optimizer step, with the loss of the step, to
``<out>/r<replica>_s<rank>_i<incarnation>.jsonl``; the run stops after two consecutive committed steps of every
replica past the fault step, then checks replicas and saves the full parameters.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import torch

import hsdp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from models import ParityNet, batch, loss_fn

REPLICAS = 3
MAX_STEPS = 2000  # a safety bound: the run ends once the restarted replica trained with the others
PACE_S = 0.05  # a pause per step: survivors waiting for the restart leave the CPUs to it (2 cores in CI)
ACCUM = int(os.environ.get("ELASTIC_ACCUM", "1"))  # micro-batches per step
POLICY = hsdp.ElasticPolicy(heartbeat_interval=0.1, heartbeat_timeout=4.0, hop_timeout=60.0, connect_timeout=10.0,
                            join_timeout=120.0)


def main() -> None:
    torch.set_num_threads(1)
    out, replica = os.environ["ELASTIC_OUT"], int(os.environ["HSDP_REPLICA_ID"])
    first = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    fault = os.environ.get("ELASTIC_FAULT", "") if first else ""
    victim, fault_step = int(os.environ.get("ELASTIC_VICTIM", "-1")), int(os.environ.get("ELASTIC_FAULT_STEP", "-1"))
    # The watchdog's bound (a stopped rank of the own replica ends it) above the hop timeout.
    mesh = hsdp.init_mesh(elastic=POLICY, fault_policy=hsdp.FaultPolicy(timeout=8.0, interval=0.5))
    try:  # refused before any collective: replica-split state does not survive membership changes
        hsdp.ShardedModel(ParityNet(), mesh=mesh, shard_optimizer_across_replicas=True)
        refused = ""
    except ValueError as e:
        refused = str(e)
    torch.manual_seed(replica)  # replicas start different: the first quorum heals them all from replica 0
    model = hsdp.ShardedModel(ParityNet(), mesh=mesh)
    opt = hsdp.ShardedOptimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    rank = mesh.shard_rank
    incarnation = mesh.elastic.client.incarnation  # 0 on ranks but the leader
    log = open(os.path.join(out, f"r{replica}_s{rank}_i{os.getpid()}.jsonl"), "w")  # noqa: SIM115
    step = model.last_step.step + 1 if model.last_step is not None else 0
    log.write(json.dumps({"joined": step, "incarnation": incarnation, "refused": refused}) + "\n")

    def die(*_: object) -> None:
        if replica == victim and step == fault_step and fault:
            log.write(json.dumps({"fault": fault, "t": time.time()}) + "\n")
            log.flush()
            if fault == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif rank == 0:
                os.kill(os.getpid(), signal.SIGSTOP)

    model.blocks[1].register_full_backward_pre_hook(die)
    together = 0
    while step < MAX_STEPS:
        losses = []
        for micro in range(ACCUM):  # accumulation: the hop only on the last micro-batch
            x, y = batch(1000 * micro + step, REPLICAS * replica + rank)
            model.set_requires_all_reduce(micro == ACCUM - 1)
            loss = loss_fn(model(x), y)
            (loss / ACCUM).backward()
            losses.append(loss.item())
        opt.step()
        opt.zero_grad()
        time.sleep(PACE_S)
        last = model.last_step
        log.write(json.dumps({"step": last.step, "committed": last.committed, "replicas": list(last.replicas),
                              "losses": losses, "t": time.time()}) + "\n")
        log.flush()
        together = together + 1 if last.committed and len(last.replicas) == REPLICAS else 0
        step = last.step + 1
        if together >= 2 and last.step > fault_step:
            break
    model.check_replicas()
    torch.save({n: p.detach().full_tensor() for n, p in model.named_parameters()},
               os.path.join(out, f"params_r{replica}_s{rank}.pt"))
    log.write(json.dumps({"done": step}) + "\n")
    log.close()


if __name__ == "__main__":
    main()
