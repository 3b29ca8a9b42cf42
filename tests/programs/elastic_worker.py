"""One rank of one replica of an elastic hsdp job (tests/test_elastic.py runs it under ``hsdp launch --elastic``).

Environment: what torchrun and ``hsdp launch --elastic`` give a rank (RANK, WORLD_SIZE, ..., HSDP_COORDINATOR,
HSDP_REPLICA_ID, HSDP_ELASTIC_JOB, TORCHELASTIC_RESTART_COUNT); ``ELASTIC_OUT`` (a folder), ``ELASTIC_FAULT``
with ``ELASTIC_VICTIM`` and ``ELASTIC_FAULT_STEP``: in its first incarnation, that replica's ranks SIGKILL
(``kill``), or its rank ``ELASTIC_STOP_RANK`` (default 0) SIGSTOPs (``stop``), itself in the backward of that
step; restarted, it runs without the fault. ``starve``: after that step's optimizer step, every rank of the
victim holds the GIL for ``STARVE_S`` (as a C extension's long call can), its heartbeats silent past the
coordinator's timeout: the coordinator drops it although it lives on, and it must rejoin without a restart.
``ELASTIC_WATCHDOG_S``: the watchdog's bound (default 8 s).

Every replica trains the same tiny model with AdamW; at step k, replica r's rank s reads batch ``(k, r, s)``
(``ELASTIC_ACCUM`` micro-batches of it, the inter-node hop deferred to the last) of 4 rows, or, with
``ELASTIC_ROWS=a,b,c``, of ``a``, ``b``, ``c`` rows on replica 0, 1, 2, each rank weighting its backwards by its
rows (``model.set_batch_weight``). ``ELASTIC_TP=2``: every replica's two ranks are one shard position of two tp
ranks (``init_mesh(elastic=True, tensor_parallel_degree=2)``), training a tiny GPT split by ``hsdp.tp_plans``
with SGD and momentum (sequences of 4 tokens); both read the batch of that position. ``ELASTIC_NPROC=2,1,1``: the
replicas' rank counts (``hsdp launch --elastic --nproc-per-node 2,1,1``, replicas of different shard degrees; the
worker reads it only to know which files the others save).
Each rank appends what ``model.last_step`` says after every optimizer step, with the loss of the step, to
``<out>/r<replica>_s<rank>_i<incarnation>.jsonl`` (``{"healed": k}`` instead when the step ended with this
replica healed to go on at step k, after the coordinator had dropped it); the run stops after two consecutive
committed steps of every replica past the fault step, or after step ``ELASTIC_LAST_STEP`` when set (then a
restarted replica waits, before it starts, until the others saved their parameters: it comes too late to train),
then checks replicas and saves the full parameters.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import time

# A restarted victim of the kill case waits a second before it imports torch: on a cluster the restart runs on its
# own node; here its import would take the 2 cores from the survivors in the very second the test measures.
if os.environ.get("ELASTIC_FAULT") == "kill" and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
    time.sleep(1.0)

import torch

import hsdp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from models import ParityNet, batch, logits, loss_fn, tiny_gpt

REPLICAS = 3
MAX_STEPS = 2000  # a safety bound: the run ends once the restarted replica trained with the others
PACE_S = 0.05  # a pause per step: survivors waiting for the restart leave the CPUs to it (2 cores in CI)
ACCUM = int(os.environ.get("ELASTIC_ACCUM", "1"))  # micro-batches per step
STARVE_S = 6.0  # above the coordinator's heartbeat timeout (4 s in tests/test_elastic.py), below the watchdog's
TP = int(os.environ.get("ELASTIC_TP", "1"))
SEQ = 4 if TP > 1 else 5  # sequence parallelism splits every sequence over the tp ranks
ROWS = tuple(int(n) for n in os.environ.get("ELASTIC_ROWS", "").split(",") if n)  # per replica: weighted
NPROC = tuple(int(n) for n in os.environ.get("ELASTIC_NPROC", "2,2,2").split(","))  # per replica: its ranks
POLICY = hsdp.ElasticPolicy(heartbeat_interval=0.1, heartbeat_timeout=4.0, hop_timeout=60.0, connect_timeout=10.0,
                            join_timeout=120.0)


# Watches a stopped process and continues it once a SIGTERM is pending (Linux: bit 15 of ShdPnd/SigPnd), so that
# it ends at once when torchrun stops the failed replica, instead of after torchrun's fixed 30 s grace for workers
# that ignore SIGTERM: the test's point is what the other replicas do meanwhile, not torchrun's grace.
_RESUMER = """
import os, signal, sys, time
pid, path = int(sys.argv[1]), f"/proc/{sys.argv[1]}/status"
for _ in range(12000):
    try:
        fields = dict(line.split(":", 1) for line in open(path))
    except (OSError, ValueError):
        break
    if fields.get("State", "").strip().startswith(("Z", "X")):
        break
    if any(int(fields.get(k, "0"), 16) & (1 << (signal.SIGTERM - 1)) for k in ("ShdPnd", "SigPnd")):
        os.kill(pid, signal.SIGCONT)
        break
    time.sleep(0.01)
"""


def _resume_when_terminated(pid: int) -> None:
    # Its own session: torchrun signals the worker's whole process group, which would end the resumer first.
    subprocess.Popen([sys.executable, "-c", _RESUMER, str(pid)], start_new_session=True)


def main() -> None:
    torch.set_num_threads(1)
    out, replica = os.environ["ELASTIC_OUT"], int(os.environ["HSDP_REPLICA_ID"])
    first = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    fault = os.environ.get("ELASTIC_FAULT", "") if first else ""
    victim, fault_step = int(os.environ.get("ELASTIC_VICTIM", "-1")), int(os.environ.get("ELASTIC_FAULT_STEP", "-1"))
    last_step = int(os.environ.get("ELASTIC_LAST_STEP", str(MAX_STEPS)))
    if not first and last_step < MAX_STEPS:
        _wait_for_the_others(out, replica)
    # The watchdog's bound: a stopped rank of the own replica ends it.
    watchdog = float(os.environ.get("ELASTIC_WATCHDOG_S", "8"))
    mesh = hsdp.init_mesh(elastic=POLICY, tensor_parallel_degree=TP if TP > 1 else None,
                          fault_policy=hsdp.FaultPolicy(timeout=watchdog, interval=0.5))
    try:  # refused before any collective: replica-split state does not survive membership changes
        hsdp.ShardedModel(ParityNet(), mesh=mesh, shard_optimizer_across_replicas=True)
        refused = ""
    except ValueError as e:
        refused = str(e)
    torch.manual_seed(replica)  # replicas start different: the first quorum heals them all from replica 0
    module = tiny_gpt() if TP > 1 else ParityNet()
    if TP > 1:
        hsdp.tp_plans.gpt_plan(module, mesh.tp_mesh)
    model = hsdp.ShardedModel(module, mesh=mesh)
    opt = hsdp.ShardedOptimizer(model, optimizer(model.parameters(), TP))
    rank, position = mesh.rank, mesh.shard_rank  # the rank in the replica's job; the data it reads
    rows = ROWS[replica] if ROWS else 4
    incarnation = mesh.elastic.client.incarnation  # 0 on ranks but the leader
    log = open(os.path.join(out, f"r{replica}_s{rank}_i{os.getpid()}.jsonl"), "w")  # noqa: SIM115
    step = model.last_step.step + 1 if model.last_step is not None else 0
    log.write(json.dumps({"joined": step, "incarnation": incarnation, "refused": refused, "tp": mesh.tp_degree,
                          "tp_split": sum(p.placements[-1].is_shard() for p in model.parameters())}) + "\n")

    def die(*_: object) -> None:
        if replica == victim and step == fault_step and fault:
            log.write(json.dumps({"fault": fault, "t": time.time()}) + "\n")
            log.flush()
            if fault == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif fault == "stop" and rank == int(os.environ.get("ELASTIC_STOP_RANK", "0")):
                _resume_when_terminated(os.getpid())
                os.kill(os.getpid(), signal.SIGSTOP)

    model.blocks[1].register_full_backward_pre_hook(die)
    together = 0
    while step < MAX_STEPS:
        losses = []
        for micro in range(ACCUM):  # accumulation: the hop only on the last micro-batch
            x, y = batch(1000 * micro + step, REPLICAS * replica + position, rows, SEQ)
            model.set_requires_all_reduce(micro == ACCUM - 1)
            if ROWS:  # the weighted average over ranks and micro-batches divides: backward the mean loss
                model.set_batch_weight(rows)
            loss = loss_fn(logits(model, x), y)
            (loss if ROWS else loss / ACCUM).backward()
            losses.append(loss.item())
        opt.step()
        done = time.time()  # the step's record time: when it committed, not after the pace below
        opt.zero_grad()
        if fault == "starve" and replica == victim and step == fault_step:
            log.write(json.dumps({"fault": fault, "t": time.time()}) + "\n")
            log.flush()
            ctypes.PyDLL(None).usleep(int(STARVE_S * 1e6))  # holds the GIL: no thread of this process runs
        time.sleep(PACE_S)
        last = model.last_step
        if replica not in last.replicas:  # dropped while alive: healed to the others' last step, go on after it
            log.write(json.dumps({"healed": last.step + 1, "t": time.time()}) + "\n")
        else:
            ops = model.comm_stats().get("replicate", {})  # the heals' point-to-point part, sent and received
            sent, got = ops.get("send_copies", {}).get("wire_bytes", 0), ops.get("receive_copy", {}).get("bytes", 0)
            log.write(json.dumps({"step": last.step, "committed": last.committed, "replicas": list(last.replicas),
                                  "losses": losses, "t": done, "heal_sent": sent, "heal_received": got}) + "\n")
        log.flush()
        together = together + 1 if last.committed and len(last.replicas) == REPLICAS else 0
        step = last.step + 1
        if (together >= 2 and last.step > fault_step) or last.step >= last_step:
            break
    model.check_replicas()
    torch.save({n: p.detach().full_tensor() for n, p in model.named_parameters()},
               os.path.join(out, f"params_r{replica}_s{rank}.pt"))
    log.write(json.dumps({"done": step}) + "\n")
    log.close()


def optimizer(params: object, tp: int) -> torch.optim.Optimizer:
    """AdamW; under tensor parallelism SGD with momentum, whose step is linear in the gradient: AdamW's normalised
    step would turn the rounding noise of a near-zero gradient element (which TP's summation order changes) into
    a step of about the learning rate, far above the replay's tolerance."""
    if tp > 1:
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-2)


def _wait_for_the_others(out: str, replica: int) -> None:
    """Until every other replica saved its parameters (bounded: the test fails on what follows instead)."""
    others = [os.path.join(out, f"params_r{r}_s{s}.pt") for r in range(REPLICAS) if r != replica
              for s in range(NPROC[r])]
    deadline = time.monotonic() + 120
    while not all(map(os.path.exists, others)) and time.monotonic() < deadline:
        time.sleep(0.1)


if __name__ == "__main__":
    main()
