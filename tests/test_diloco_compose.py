"""DiLoCo composed with replicas of different shard degrees and with batch weights, against one process.

One 3-rank gloo spawn on ``sharding_degree=[2, 1]`` (a replica of ranks 0, 1 and one of rank 2), inner AdamW, outer
Nesterov SGD, each run equal to a one-process simulation of two DiLoCo workers (worker q trains on the
concatenation of its ranks' batches) to 1e-5:
- no batch weights: the pseudo-gradients, reduced piece by piece over the replicas' common partition, take the
  plain mean; the inter-node bytes of a sync are the all-reduce floor (every replica sends each element once);
- batch weights (rank r reads ``1 + (2r + step) % 4`` samples): the outer gradient is ``sum_q W_q delta_q /
  sum_q W_q``, ``W_q`` the samples worker q processed since the fragment's last sync; the result differs from
  the plain mean's;
- Streaming DiLoCo (two fragments, delay 1) with batch weights over two accumulated micro-batches per step (the
  first's inter-node part deferred): each worker equals the simulated one;
- ``check_replicas`` (the global copy, compared piece by piece) passes after every run.
"""

from __future__ import annotations

import os

import pytest
import torch
from harness import run_distributed
from models import ParityNet, batch, loss_fn
from test_diloco_streaming import _fragment_of
from test_hetero_mesh import NODES

import hsdp

# Per run: the policy, weighted, steps, micro-batches, hsdp.clip_grad_norm_'s max norm (0: none; the plain run clips,
# binding: each replica by its own inner gradient's norm, nothing across nodes; an agreement on the largest replica's
# norm, as per-step HSDP's across degrees, mismatches the simulation and sends bytes between syncs).
RUNS = {"plain": (dict(every=2), False, 4, 1, 0.05), "weighted": (dict(every=2), True, 4, 1, 0.0),
        "streaming": (dict(every=4, fragments=2, delay=1), True, 8, 2, 0.0)}
REPLICAS = ((0, 1), (2,))  # the data-parallel ranks of each replica of [2, 1]


def _samples(rank: int, step: int, weighted: bool) -> int:
    return 1 + (2 * rank + step) % 4 if weighted else 4


def _replicate_bytes(model: hsdp.ShardedModel) -> float:
    return sum(op["bytes"] for op in model.comm_stats().get("replicate", {}).values())


def _data(rank: int, step: int, weighted: bool, micro: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The rank's micro-batches of ``step``: ``_samples`` samples each."""
    return [batch(10 * step + m, rank, per_rank=_samples(rank, step + m, weighted)) for m in range(micro)]


def _train(rank: int, policy: dict, weighted: bool, steps: int, micro: int, clip: float) -> dict:
    torch.manual_seed(0)
    model = hsdp.ShardedModel(ParityNet(), mesh=hsdp.init_mesh(),
                              replica_sync=hsdp.DiLoCo(outer_lr=0.7, outer_momentum=0.9, **policy))
    opt = hsdp.ShardedOptimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    sent = []
    for step in range(steps):
        model.reset_comm_stats()
        for m, (x, y) in enumerate(_data(rank, step, weighted, micro)):
            if weighted:
                model.set_batch_weight(len(x))
            model.set_requires_all_reduce(m == micro - 1)
            loss_fn(model(x), y).backward()
        if clip:
            hsdp.clip_grad_norm_(model, clip)
        opt.step()
        opt.zero_grad()
        sent.append(_replicate_bytes(model))
    model.check_replicas()  # raises on a global copy that differs across replicas
    return {"params": {n: p.detach().full_tensor() for n, p in model.named_parameters()}, "sent": sent,
            "numel": sum(p.numel() for p in model.parameters())}


def _worker(rank: int, world: int) -> dict:
    os.environ["LOCAL_RANK"], os.environ["LOCAL_WORLD_SIZE"] = map(str, NODES[rank])  # nodes of 2 and 1 ranks
    assert hsdp.init_mesh().replicas.degrees == (2, 1)
    return {run: _train(rank, *spec) for run, spec in RUNS.items()}


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_distributed(_worker, 3, timeout=240)


def _simulate(every: int, weighted: bool, steps: int, fragments: int = 1, delay: int = 0, micro: int = 1,
              by_samples: bool | None = None, clip: float = 0.0) -> list[dict[str, torch.Tensor]]:
    """Two (streaming) DiLoCo workers: worker q's inner step is on its ranks' concatenated micro-batches; fragment f's
    pseudo-gradients, taken after step s with s % every == its offset, are averaged weighted by the samples each
    worker processed since the fragment's last sync (``by_samples``, by default when ``weighted``; else the plain
    mean) and land ``delay`` steps later; ``clip``: each worker clips its gradient's norm to it. Returns each worker's
    weights."""
    by_samples = weighted if by_samples is None else by_samples
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: more threads only contend on the shared cores
    try:
        torch.manual_seed(0)
        global_model = ParityNet()
        workers = [ParityNet() for _ in REPLICAS]
        for w in workers:
            w.load_state_dict(global_model.state_dict())
        inner = [torch.optim.AdamW(w.parameters(), lr=1e-2) for w in workers]
        outer = torch.optim.SGD(global_model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
        seen = [[0.0] * len(REPLICAS) for _ in range(fragments)]  # samples per fragment and worker since its sync
        pending: list[tuple[int, dict[str, torch.Tensor]]] = []
        for step in range(1, steps + 1):
            for q, (w, opt) in enumerate(zip(workers, inner, strict=True)):
                parts = [part for r in REPLICAS[q] for part in _data(r, step - 1, weighted, micro)]
                loss_fn(w(torch.cat([p[0] for p in parts])), torch.cat([p[1] for p in parts])).backward()
                if clip:
                    torch.nn.utils.clip_grad_norm_(w.parameters(), clip)
                opt.step()
                opt.zero_grad()
                for f in range(fragments):
                    seen[f][q] += sum(len(p[0]) for p in parts)
            for f in range(fragments):
                if step % every == (f + 1) * every // fragments % every:
                    share = torch.tensor(seen[f] if by_samples else [1.0] * len(REPLICAS))
                    share, seen[f] = share / share.sum(), [0.0] * len(REPLICAS)
                    with torch.no_grad():
                        means = {name: sum(s * (g - dict(w.named_parameters())[name])
                                           for s, w in zip(share.tolist(), workers, strict=True))
                                 for name, g in global_model.named_parameters() if _fragment_of(name, fragments) == f}
                    pending.append((step + delay, means))
            for _, means in [p for p in pending if p[0] == step]:
                params = dict(global_model.named_parameters())
                for name, mean in means.items():
                    params[name].grad = mean
                outer.step()
                outer.zero_grad(set_to_none=True)
                with torch.no_grad():
                    for w in workers:
                        for name, p in w.named_parameters():
                            if name in means:
                                p.copy_(params[name])
            pending = [p for p in pending if p[0] > step]
        return [{n: p.detach().clone() for n, p in w.named_parameters()} for w in workers]
    finally:
        torch.set_num_threads(threads)


def _assert_workers(results: list[dict], run: str, ref: list[dict[str, torch.Tensor]]) -> None:
    for rank, r in enumerate(results):
        worker = 0 if rank in REPLICAS[0] else 1
        for name, value in ref[worker].items():
            torch.testing.assert_close(r[run]["params"][name], value, rtol=1e-5, atol=1e-5, msg=f"{rank} {name}")


def test_diloco_on_degrees_2_1_equals_two_simulated_workers(results: list[dict]) -> None:
    _assert_workers(results, "plain", _simulate(2, weighted=False, steps=4, clip=0.05))
    # A sync's inter-node bytes, summed over the ranks: each replica sends every element of the model once.
    sent = [sum(r["plain"]["sent"][step] for r in results) for step in range(4)]
    assert sent == [0, 2 * 4 * results[0]["plain"]["numel"]] * 2


def test_diloco_with_batch_weights_weighs_each_replica_by_its_samples(results: list[dict]) -> None:
    _assert_workers(results, "weighted", _simulate(2, weighted=True, steps=4))
    unweighted = _simulate(2, weighted=True, steps=4, by_samples=False)  # the same batches, the plain mean
    assert not torch.allclose(results[0]["weighted"]["params"]["blocks.0.up.weight"],
                              unweighted[0]["blocks.0.up.weight"], rtol=1e-4, atol=1e-4)


def test_streaming_diloco_with_delay_and_batch_weights_on_degrees_2_1(results: list[dict]) -> None:
    ref = _simulate(4, weighted=True, steps=8, fragments=2, delay=1, micro=2)
    _assert_workers(results, "streaming", ref)
    assert not torch.equal(ref[0]["blocks.0.up.weight"], ref[1]["blocks.0.up.weight"])  # mid-phase: they differ
