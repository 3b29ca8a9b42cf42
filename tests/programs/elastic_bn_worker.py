"""One rank of one replica of an elastic job training a BatchNorm model (tests/test_elastic_buffers.py).

Environment: what ``hsdp launch --elastic`` gives a rank, plus ``ELASTIC_OUT`` (a folder), ``ELASTIC_VICTIM`` and
``ELASTIC_FAULT_STEP``: in its first incarnation that replica's ranks SIGKILL themselves in the backward of that
step; torchrun restarts it and it rejoins, healed from a live replica.

Each replica reads its own batches, with a replica-dependent scale and shift, so the running statistics its
forward computes differ from the others'. The inter-node hop is int8 with error feedback. After every optimizer
step each rank appends ``model.last_step``, its BatchNorm buffers and digests of its hop residuals before the
step's forward and after the step (a discarded step must leave them as they were; a joiner starts from none) to
``<out>/r<replica>_s<rank>_i<pid>.jsonl``. The run ends after two committed steps of every replica past the
fault; then ``check_replicas`` must pass, and must fail once replica 1's rank 0 changed a buffer.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import time

import torch
from torch import nn

import hsdp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from models import BNNet

REPLICAS = 2
MAX_STEPS = 2000
PACE_S = 0.05
POLICY = hsdp.ElasticPolicy(heartbeat_interval=0.1, heartbeat_timeout=4.0, hop_timeout=60.0, connect_timeout=10.0,
                            join_timeout=120.0)


def batch(step: int, replica: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * replica + rank)
    return torch.randn(5, 6, generator=g) * (1 + replica) + 2 * replica, torch.randint(0, 3, (5,), generator=g)


def main() -> None:
    torch.set_num_threads(1)
    out, replica = os.environ["ELASTIC_OUT"], int(os.environ["HSDP_REPLICA_ID"])
    first = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    victim, fault_step = int(os.environ["ELASTIC_VICTIM"]), int(os.environ["ELASTIC_FAULT_STEP"])
    mesh = hsdp.init_mesh(elastic=POLICY, fault_policy=hsdp.FaultPolicy(timeout=8.0, interval=0.5))
    torch.manual_seed(replica)  # replicas start different: the first quorum heals them all from replica 0
    hop = hsdp.Int8ErrorFeedbackHop(block_size=16)
    # BNNet tracks running statistics: buffers synced every step.
    model = hsdp.ShardedModel(BNNet(), mesh=mesh, replica_hop=hop)
    opt = hsdp.ShardedOptimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    rank = mesh.shard_rank
    log = open(os.path.join(out, f"r{replica}_s{rank}_i{os.getpid()}.jsonl"), "w")  # noqa: SIM115
    step = model.last_step.step + 1 if model.last_step is not None else 0

    def buffers() -> dict[str, list]:
        return {n: b.reshape(-1).tolist() for n, b in model.named_buffers()}

    def residuals() -> dict:
        values = [hop.residuals[k].reshape(-1) for k in sorted(hop.residuals)]
        flat = torch.cat(values) if values else torch.zeros(0)
        return {"digest": hashlib.sha1(flat.numpy().tobytes()).hexdigest(), "norm": float(flat.norm())}

    log.write(json.dumps({"joined": step, "buffers": buffers(), "residuals": residuals()}) + "\n")  # as healed

    def die(*_: object) -> None:
        if first and replica == victim and step == fault_step:
            log.write(json.dumps({"fault": "kill", "t": time.time()}) + "\n")
            log.flush()
            os.kill(os.getpid(), signal.SIGKILL)

    model.inp.register_full_backward_pre_hook(die)
    together = 0
    while step < MAX_STEPS:
        x, y = batch(step, replica, rank)
        before = residuals()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        time.sleep(PACE_S)
        last = model.last_step
        log.write(json.dumps({"step": last.step, "committed": last.committed, "replicas": list(last.replicas),
                              "buffers": buffers(), "residuals_before": before, "residuals": residuals()}) + "\n")
        log.flush()
        together = together + 1 if last.committed and len(last.replicas) == REPLICAS else 0
        step = last.step + 1
        if together >= 2 and last.step > fault_step:
            break
    model.check_replicas()
    if replica == 1 and rank == 0:
        model.bn.running_mean.add_(1.0)
    try:
        model.check_replicas()
        verdict = "passed"
    except hsdp.ReplicaDivergence as e:
        verdict = str(e)
    log.write(json.dumps({"done": step, "changed_buffer_check": verdict}) + "\n")
    log.close()


if __name__ == "__main__":
    main()
