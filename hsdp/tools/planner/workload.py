"""The ready-made tuning workload: ``hsdp tune`` runs it when no script is given.

Trains a GPT preset (``hsdp.models``) with hsdp for a few steps under torchrun, with the shard degree left
to ``hsdp.init_mesh()`` (so ``$HSDP_SHARDING_DEGREE`` picks the layout) and writes the metrics file
(``$HSDP_METRICS_FILE``, see :mod:`hsdp.tools.planner.metrics`), including a compute profile measured on the
unwrapped model with every rank busy at once::

    hsdp launch --nodes 2 --nproc-per-node 2 -- -m hsdp.tools.planner.workload --preset small --steps 5

``$HSDP_SHARD_OPTIMIZER_ACROSS_REPLICAS=1`` (``hsdp tune`` sets it per candidate) wraps the model with
``shard_optimizer_across_replicas=True`` (every built-in hop reduce-scatters across replicas, int8 included).
"""

from __future__ import annotations

import argparse
import copy
import os

import torch
import torch.distributed as dist

import hsdp
from hsdp.engine.hops import HOP_NAMES, named_hop
from hsdp.models import GPT, preset
from hsdp.tools.planner.metrics import StepRecorder, profile_ranks
from hsdp.tools.planner.model import ComputeProfile
from hsdp.tools.planner.tune import SHARD_OPTIMIZER_ENV


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="small", help="GPT preset of hsdp.models (default: small)")
    p.add_argument("--batch", type=int, default=2, help="sequences per rank per micro-batch")
    p.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    p.add_argument("--micro-batches", type=int, default=1, help="micro-batches per step (deferred sync)")
    p.add_argument("--steps", type=int, default=5, help="measured steps")
    p.add_argument("--warmup", type=int, default=2, help="steps before measuring")
    p.add_argument("--hop", choices=HOP_NAMES, default="fp32", help="inter-node hop")
    p.add_argument("--no-reshard-after-forward", action="store_true")
    p.add_argument("--out", default=None, help="metrics file (default: $HSDP_METRICS_FILE)")
    return p.parse_args(argv)


def _batches(cfg: object, args: argparse.Namespace, g: torch.Generator) -> list[tuple[torch.Tensor, torch.Tensor]]:
    tokens = [torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=g)  # type: ignore[attr-defined]
              for _ in range(args.micro_batches)]
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def _train_step(model: hsdp.ShardedModel, optimizer: torch.optim.Optimizer,
                batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    # zero_grad first: the recorder reads state bytes right after the step, gradients included.
    optimizer.zero_grad(set_to_none=True)
    for i, (x, y) in enumerate(batches):
        model.set_requires_all_reduce(i == len(batches) - 1)  # deferred sync: one inter-node hop per step
        _, loss = model(x, y)
        (loss / len(batches)).backward()
    optimizer.step()
    return float(loss.item())


def _profile(mesh: hsdp.HSDPMesh, model: GPT, batch: tuple[torch.Tensor, torch.Tensor],
             ) -> tuple[ComputeProfile, list[float]]:
    # On a copy: the probe's optimizer step must not touch the weights every layout starts from.
    probe = copy.deepcopy(model)
    x, y = batch
    return profile_ranks(mesh, lambda: probe(x, y)[1], list(probe.parameters()))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    mesh = hsdp.init_mesh()  # honours $HSDP_SHARDING_DEGREE
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    cfg = preset(args.preset)
    torch.manual_seed(0)
    model = GPT(cfg)
    g = torch.Generator().manual_seed(1000 + dist.get_rank())
    profile, rank_compute = _profile(mesh, model, _batches(cfg, args, g)[0])
    hop = named_hop(args.hop)
    sliced = os.environ.get(SHARD_OPTIMIZER_ENV) == "1"
    sharded = hsdp.ShardedModel(model, mesh=mesh, replica_hop=hop, shard_optimizer_across_replicas=sliced,
                                reshard_after_forward=not args.no_reshard_after_forward)
    optimizer = hsdp.ShardedOptimizer(sharded, torch.optim.AdamW(sharded.parameters(), lr=3e-4, foreach=True))
    recorder = StepRecorder(sharded, optimizer, micro_batches=args.micro_batches, warmup=args.warmup,
                            seq_len=args.seq, micro_batch=args.batch, name=f"GPT {args.preset}")
    losses = []
    for _ in range(args.warmup + args.steps):
        batches = _batches(cfg, args, g)
        with recorder.step():
            losses.append(_train_step(sharded, optimizer, batches))
    extra = {"workload": {"preset": args.preset, "hop": args.hop, "losses": losses,
                          "reshard_after_forward": not args.no_reshard_after_forward},
             "compute_s_per_rank": rank_compute}  # forward+backward per rank, unwrapped: the GPU ranks' times
    result = recorder.write(args.out, profile=profile, extra=extra)
    if dist.get_rank() == 0:
        print(f"hsdp tune workload: S={result['sharding_degree']} median step {result['median_step_s']:.3f} s",
              flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
