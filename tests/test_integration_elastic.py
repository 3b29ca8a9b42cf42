"""The framework integrations on an elastic mesh read distinct data per replica.

On an elastic mesh (``init_mesh(elastic=True)``) each replica is a torchrun job of its own, so accelerate's process
index and count are those of one replica: split by them, every replica read the same batches. Two one-rank
replicas of a real elastic job (an hsdp coordinator of 2 replicas in this process, each replica its own process
and process group, as ``hsdp launch --elastic`` starts them) each prepare, without training:

* ``hsdp.integrations.accelerate.prepare(accelerator, model, loader)`` over a sequential loader of 12 sample ids,
* ``HSDPTrainer``'s training loader (Trainer's shuffled sampler, seeded alike on both replicas),
* ``HSDPTrainer``'s evaluation loader;

and report the sample ids each one yields. The two replicas' training ids are disjoint and together the whole
dataset, each replica's accelerate part being its ``mesh.data_parallel_rank`` slice; evaluation reads all of it on
each replica (accelerate's metrics span one replica). A shuffling loader without accelerate's seedable sampler,
and a dispatching one, are refused naming the fix. (Lightning's strategies split by ``mesh.data_parallel_rank``
already and build no elastic mesh.)
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch.distributed as dist

pytest.importorskip("accelerate", reason="the hf extra (pip install 'hsdp[hf]'); `make test` installs it")

from hsdp.engine.replicate.elastic.protocol import ElasticPolicy
from hsdp.tools.coordinator.server import Coordinator

SAMPLES, JOB = 12, "frameworks"
POLICY = ElasticPolicy(heartbeat_interval=0.05, heartbeat_timeout=30.0, connect_timeout=20.0, join_timeout=120.0)

# One rank of one replica: prepare the loaders, print what each yields (one JSON line), leave at once.
_PROGRAM = r"""
import json, os, sys
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset
sys.path.insert(0, os.environ["TESTS_DIR"])
from hf_tiny import SEQ, tiny_llama
import hsdp
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration
from transformers import TrainingArguments
from hsdp.integrations import accelerate as hsdp_accelerate
from hsdp.integrations.transformers import HSDPTrainer

N = int(os.environ["SAMPLES"])

class Ids(Dataset):
    def __len__(self):
        return N
    def __getitem__(self, i):
        return {"input_ids": torch.full((SEQ,), i), "labels": torch.full((SEQ,), i)}

policy = hsdp.ElasticPolicy(**json.loads(os.environ["POLICY"]))
mesh = hsdp.init_mesh(elastic=policy)
said = {"data_parallel": [mesh.data_parallel_rank, mesh.data_parallel_size]}
accelerator = Accelerator()
said["accelerate_world"] = [accelerator.process_index, accelerator.num_processes]
model = hsdp.ShardedModel(tiny_llama(), mesh=mesh)
model, loader = hsdp_accelerate.prepare(accelerator, model, DataLoader(TensorDataset(torch.arange(N)), batch_size=2))
said["accelerate"] = [int(i) for (batch,) in loader for i in batch]
for case, config in [("shuffle", DataLoaderConfiguration(use_seedable_sampler=False)),
                     ("dispatch", DataLoaderConfiguration(dispatch_batches=True))]:
    other = Accelerator(dataloader_config=config)
    try:
        hsdp_accelerate.prepare(other, model, DataLoader(TensorDataset(torch.arange(N)), batch_size=2, shuffle=True))
        said[case] = None
    except ValueError as e:
        said[case] = str(e)
args = TrainingArguments(output_dir=os.environ["OUT"], per_device_train_batch_size=2, per_device_eval_batch_size=2,
                         report_to=[], seed=0, use_cpu=True)
trainer = HSDPTrainer(model=tiny_llama(), args=args, train_dataset=Ids(), eval_dataset=Ids(), mesh=mesh)
said["trainer"] = [int(i) for batch in trainer.get_train_dataloader() for i in batch["input_ids"][:, 0]]
said["trainer_eval"] = [int(i) for batch in trainer.get_eval_dataloader() for i in batch["input_ids"][:, 0]]
print(json.dumps(said), flush=True)
os._exit(0)  # the replica's heartbeat and groups need no orderly teardown here
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _replica(replica: int, address: str, out: Path) -> subprocess.Popen:
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "OMP_NUM_THREADS": "1",
           "ACCELERATE_USE_CPU": "true", "TESTS_DIR": str(Path(__file__).parent), "SAMPLES": str(SAMPLES),
           "HSDP_COORDINATOR": address, "HSDP_REPLICA_ID": str(replica), "HSDP_ELASTIC_JOB": JOB,
           "POLICY": json.dumps({"heartbeat_interval": POLICY.heartbeat_interval,
                                 "heartbeat_timeout": POLICY.heartbeat_timeout,
                                 "connect_timeout": POLICY.connect_timeout, "join_timeout": POLICY.join_timeout}),
           "OUT": str(out / f"replica{replica}")}
    return subprocess.Popen([sys.executable, "-c", _PROGRAM], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_accelerate_and_trainer_read_distinct_data_per_elastic_replica(tmp_path: Path) -> None:
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    coordinator = Coordinator(master, JOB, replicas=2, policy=POLICY, start_grace=120.0)
    stop = threading.Event()
    thread = threading.Thread(target=coordinator.serve, args=(stop.is_set,), daemon=True)
    thread.start()
    procs = [_replica(r, f"127.0.0.1:{master.port}", tmp_path) for r in (0, 1)]
    try:
        outputs = [p.communicate(timeout=240) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        stop.set()
        thread.join()
    said = []
    for p, (out, err) in zip(procs, outputs):
        lines = [line for line in out.splitlines() if line.startswith("{")]
        assert p.returncode == 0 and lines, out[-3000:] + err[-3000:]
        said.append(json.loads(lines[-1]))

    everything = set(range(SAMPLES))
    for replica, s in enumerate(said):
        assert s["accelerate_world"] == [0, 1]  # accelerate sees one replica's torchrun job
        assert s["data_parallel"] == [replica, 2]
        # accelerate's shard rule as for rank r of 2 processes: every other batch of 2.
        assert s["accelerate"] == [i for i in range(SAMPLES) if (i // 2) % 2 == replica], s["accelerate"]
        assert sorted(s["trainer_eval"]) == sorted(everything)  # each replica evaluates all of it
        assert "use_seedable_sampler=True" in s["shuffle"], s["shuffle"]
        assert "dispatch_batches=False" in s["dispatch"], s["dispatch"]
    for kind in ("accelerate", "trainer"):
        first, second = (set(s[kind]) for s in said)
        assert not first & second and first | second == everything, (kind, said[0][kind], said[1][kind])
        assert all(len(s[kind]) == SAMPLES // 2 for s in said)
