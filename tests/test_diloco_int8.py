"""DiLoCo's int8 wire with error feedback (``DiLoCo(wire_dtype=torch.int8)``, ``hsdp/engine/optim/outer_wire.py``).

One 3-rank gloo spawn on ``sharding_degree=[2, 1]`` (a replica of ranks 0, 1 and one of rank 2: the pseudo-gradients
cross bucket by bucket of pieces, bucket ``j`` being chunk ``j`` of every parameter of a unit, in slot order, on
both replicas), inner SGD, outer Nesterov SGD. Against a one-process simulation of two DiLoCo workers whose
pseudo-gradients (plus the residual of the unit's previous sync) are quantised per bucket in int8 blocks of 256 with
one fp32 scale each, averaged dequantised in fp32, the rounding error kept as the next sync's residual:
- plain, with batch weights (the weighted pseudo-gradient quantised, the weight exact) and Streaming DiLoCo (two
  fragments, delay 1, each fragment's units carrying their own residuals): each replica's weights to 1e-5, while
  exact fp32 DiLoCo and int8 without the residuals are both further than that (the check can fail);
- the inter-node bytes of a sync about a quarter of the fp32 wire's (a wider model, so that the last block's
  padding weighs little);
- a checkpoint mid-phase keeps every replica's residuals (under its own keys): a resume gives the uninterrupted
  run's weights bitwise, and the same resume with the residuals dropped does not; a model-only load (weights
  without DiLoCo's state) restarts them from zero.
The grid's path (each rank's padded flat shard quantised whole) is ``tests/test_diloco.py``'s 2 x 2 spawn.

The same spawn, as three 1-rank replicas, checks the wire's hop from 3 replicas (``two_stage``: a reduce-scatter and
an all-gather, both in int8): two averages (the second with the first's residuals) equal a simulation that rounds
each replica's value plus its residual, averages in fp32 and rounds that mean once more, on every replica alike; the
flags cross exact; its bytes are two thirds of the one-stage all-gather's (the all-reduce floor in int8 at R = 3).
Flushed (DiLoCo's sync), its second stage is issued by the hop worker: the average completes unwaited, the same values.
"""

from __future__ import annotations

import functools
import os
import time

import pytest
import torch
from harness import run_distributed
from models import Block, ParityNet, loss_fn
from reference import int8_roundtrip
from reference import max_distance as _distance
from test_diloco_compose import REPLICAS, _data
from test_hetero_mesh import NODES
from test_int8_compose import Net

import hsdp
from hsdp.engine.collectives import Comm
from hsdp.engine.hops import Int8ErrorFeedbackHop

INNER_LR, OUTER_LR, MOMENTUM, BLOCK, TOL = 0.3, 0.7, 0.9, 256, 1e-5
_int8 = functools.partial(int8_roundtrip, block=BLOCK)  # the quantiser, written out (tests/reference.py)
RUNS = {"int8": (dict(every=2), False, 6), "weighted": (dict(every=2), True, 6),
        "streaming": (dict(every=4, fragments=2, delay=1), True, 8)}  # policy, weighted, steps
TWO_STAGE_N = 3000  # 12 blocks (the last one partial): 4 per replica
SAVE, END = 3, 6  # the resume: saved after step 3 (mid-phase, one sync's residuals held), trained on to step 6


def _policy(policy: dict, wire: torch.dtype | None = torch.int8) -> hsdp.DiLoCo:
    return hsdp.DiLoCo(outer_lr=OUTER_LR, outer_momentum=MOMENTUM, wire_dtype=wire, **policy)


def _build(module: torch.nn.Module, policy: hsdp.DiLoCo, **kw: object) -> tuple[hsdp.ShardedModel,
                                                                                   hsdp.ShardedOptimizer]:
    model = hsdp.ShardedModel(module, mesh=hsdp.init_mesh(), replica_sync=policy, **kw)
    return model, hsdp.ShardedOptimizer(model, torch.optim.SGD(model.parameters(), lr=INNER_LR))


def _steps(model: hsdp.ShardedModel, opt: hsdp.ShardedOptimizer, rank: int, steps: range, weighted: bool) -> list:
    """Train ``steps``; each step's inter-node bytes this rank sent."""
    sent = []
    for step in steps:
        model.reset_comm_stats()
        for x, y in _data(rank, step, weighted, 1):
            if weighted:
                model.set_batch_weight(len(x))
            loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        sent.append(sum(op["wire_bytes"] for op in model.comm_stats().get("replicate", {}).values()))
    return sent


def _full(model: hsdp.ShardedModel) -> dict[str, torch.Tensor]:
    return {n: p.detach().full_tensor().clone() for n, p in model.named_parameters()}


def _train(rank: int, policy: dict, weighted: bool, steps: int) -> dict:
    torch.manual_seed(0)
    model, opt = _build(ParityNet(), _policy(policy))
    _steps(model, opt, rank, range(steps), weighted)
    model.check_replicas()  # raises on a global copy that differs across replicas
    outer = opt._hsdp_outer
    return {"params": _full(model), "units": [[p.fqn for p in u.params] for u in outer.units],
            "fragments": [list(f) for f in outer.fragments]}


def _bytes(rank: int) -> dict[str, float]:
    """One sync's bytes (every 2 steps) of the fp32 and the int8 wire on a model of ~10k parameters."""
    out = {}
    for name, wire in (("fp32", None), ("int8", torch.int8)):
        torch.manual_seed(0)
        model, opt = _build(Net(), _policy(dict(every=2), wire), wrap={Block})
        out[name] = sum(_steps(model, opt, rank, range(2), False))
    return out


def _resume(rank: int, folder: str) -> dict:
    """Save after step ``SAVE``, load into a fresh model and optimizer, train on to ``END``: with the residuals,
    and with them dropped after the load."""
    policy = _policy(dict(every=2))
    torch.manual_seed(0)
    model, opt = _build(ParityNet(), policy)
    _steps(model, opt, rank, range(SAVE), False)
    saved = {k: v.clone() for k, v in opt._hsdp_outer.wire.residuals.items()}
    hsdp.save_checkpoint(folder, model, opt)
    out: dict = {"nonzero": bool(saved) and all(bool(v.abs().sum() > 0) for v in saved.values())}
    for run in ("resumed", "dropped"):
        torch.manual_seed(1)  # other initial weights: the load must replace them
        model, opt = _build(ParityNet(), policy)
        hsdp.load_checkpoint(folder, model, opt)
        residuals = opt._hsdp_outer.wire.residuals
        if run == "resumed":
            out["restored"] = saved.keys() == residuals.keys() and all(torch.equal(saved[k], residuals[k])
                                                                        for k in saved)
        else:
            residuals.clear()
        _steps(model, opt, rank, range(SAVE, END), False)
        out[run] = _full(model)
    # A model-only load (weights without DiLoCo's state) restarts the outer state: the residuals start from zero.
    hsdp.load_checkpoint(folder, model)
    _steps(model, opt, rank, range(END, END + 1), False)  # an inner step, no sync
    out["after_model_load"] = len(opt._hsdp_outer.wire.residuals)
    return out


def _two_stage(rank: int) -> dict:
    """Three 1-rank replicas: the wire's hop averaging two buffers of ``TWO_STAGE_N`` values and a flag (the second
    with the first's residuals), and the bytes of the two-stage and of the one-stage hop."""
    os.environ["LOCAL_RANK"], os.environ["LOCAL_WORLD_SIZE"] = "0", "1"
    comm = Comm(hsdp.init_mesh())
    assert comm.size("replicate") == 3
    out: dict = {"means": []}
    for two_stage in (True, False):
        hop, sent = Int8ErrorFeedbackHop(BLOCK, two_stage=two_stage), 0
        for i in range(2):
            comm.stats.reset()
            buffer = torch.cat([_values(rank, i), torch.tensor([float(rank + 1)])])
            hop.start(buffer, 1, comm, "unit").wait()
            sent += sum(op.wire_bytes for (group, _), op in comm.stats.ops.items() if group == "replicate")
            if two_stage:
                out["means"].append(buffer)
        out["two_stage" if two_stage else "one_stage"] = sent
    out["flushed"], out["ready_before_flush"], out["ready_unwaited"] = [], [], []
    hop = Int8ErrorFeedbackHop(BLOCK, two_stage=True)
    for i in range(2):  # the same averages, their second stage issued by the hop worker (flush), then polled
        buffer = torch.cat([_values(rank, i), torch.tensor([float(rank + 1)])])
        handle = hop.start(buffer, 1, comm, "unit")
        out["ready_before_flush"].append(handle.ready())
        hop.flush(comm)
        deadline = time.monotonic() + 60
        while not handle.ready() and time.monotonic() < deadline:
            time.sleep(0.001)
        out["ready_unwaited"].append(handle.ready())
        handle.wait()
        out["flushed"].append(buffer)
    return out


def _values(rank: int, i: int) -> torch.Tensor:
    return torch.randn(TWO_STAGE_N, generator=torch.Generator().manual_seed(100 * i + rank))


def _worker(rank: int, world: int, folder: str) -> dict:
    os.environ["LOCAL_RANK"], os.environ["LOCAL_WORLD_SIZE"] = map(str, NODES[rank])  # nodes of 2 and 1 ranks
    assert hsdp.init_mesh().replicas.degrees == (2, 1)
    out = {run: _train(rank, *spec) for run, spec in RUNS.items()}
    out["bytes"] = _bytes(rank)
    out["resume"] = _resume(rank, folder)
    out["three"] = _two_stage(rank)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return run_distributed(_worker, 3, str(tmp_path_factory.mktemp("diloco_int8")), timeout=240)


def _rows(t: torch.Tensor, j: int) -> tuple[int, int, int]:
    """Chunk ``j`` of two of ``t``'s dim 0 (FSDP2's: ``ceil(rows / 2)`` rows, the last may be short or empty):
    its first and end row and the full chunk's rows."""
    rows = t.shape[0]
    c = -(-rows // 2)
    return min(j * c, rows), min((j + 1) * c, rows), c


class _Wire:
    """The sync's average of the workers' (weighted) pseudo-gradients of one unit, piece by piece: what rank ``j``
    of a 2-rank replica sends, chunk ``j`` of every parameter in slot order (``padded``: each chunk padded to its
    full rows with zeros, a 2 x 2 grid's flat shard; else the chunks alone, ``[2, 1]``'s bucket of pieces), in
    ``kind``: ``"int8"`` with error feedback, ``"no-feedback"``, or ``"fp32"``."""

    def __init__(self, kind: str, padded: bool = False) -> None:
        self.kind, self.padded, self.residual = kind, padded, {}  # (unit, worker, piece) -> the error kept

    def _piece(self, t: torch.Tensor, j: int) -> torch.Tensor:
        lo, hi, c = _rows(t, j)
        flat = t[lo:hi].reshape(-1)
        return torch.cat([flat, flat.new_zeros((c - (hi - lo)) * t[0].numel())]) if self.padded else flat

    def mean(self, u: int, names: list[str], deltas: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        out = {n: torch.zeros_like(deltas[0][n]) for n in names}
        for j in range(2):
            sent = []
            for q, delta in enumerate(deltas):
                x = torch.cat([self._piece(delta[n], j) for n in names])
                if self.kind != "fp32":
                    x = x + self.residual.get((u, q, j), 0) if self.kind == "int8" else x
                    self.residual[(u, q, j)], x = x - _int8(x), _int8(x)
                sent.append(x)
            avg, at = torch.stack(sent).mean(dim=0), 0
            for n in names:
                lo, hi, _ = _rows(out[n], j)
                out[n][lo:hi].copy_(avg[at: at + out[n][lo:hi].numel()].view(out[n][lo:hi].shape))
                at += self._piece(out[n], j).numel()
        return out

    def means(self, units: list[list[str]], deltas: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Every unit's :meth:`mean` (``units``: each unit's parameter names in slot order)."""
        return {n: m for u, names in enumerate(units) for n, m in self.mean(u, names, deltas).items()}


def _simulate(layout: dict, wire: str, every: int, weighted: bool, steps: int, fragments: int = 1,
              delay: int = 0) -> list[dict[str, torch.Tensor]]:
    """Two (streaming) DiLoCo workers in one process, worker q on its ranks' concatenated batches; fragment f's
    units (``layout``: the engine's units and fragments, as recorded) sync after step s with s % every == its
    offset: each unit's pseudo-gradients, weighted by the samples each worker processed since the fragment's last
    sync when ``weighted``, averaged through ``_Wire(wire)`` (then divided by the mean weight), land ``delay``
    steps later. Returns each worker's weights."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: more threads only contend on the shared cores
    try:
        torch.manual_seed(0)
        global_model = ParityNet()
        workers = [ParityNet() for _ in REPLICAS]
        for w in workers:
            w.load_state_dict(global_model.state_dict())
        inner = [torch.optim.SGD(w.parameters(), lr=INNER_LR) for w in workers]
        outer = torch.optim.SGD(global_model.parameters(), lr=OUTER_LR, momentum=MOMENTUM, nesterov=True)
        channel, seen = _Wire(wire), [[0.0] * len(REPLICAS) for _ in range(fragments)]
        pending: list[tuple[int, dict[str, torch.Tensor]]] = []
        for step in range(1, steps + 1):
            for q, (w, opt) in enumerate(zip(workers, inner, strict=True)):
                parts = [part for r in REPLICAS[q] for part in _data(r, step - 1, weighted, 1)]
                loss_fn(w(torch.cat([p[0] for p in parts])), torch.cat([p[1] for p in parts])).backward()
                opt.step()
                opt.zero_grad()
                for f in range(fragments):
                    seen[f][q] += sum(len(p[0]) for p in parts)
            for f in range(fragments):
                if step % every == (f + 1) * every // fragments % every:
                    share = seen[f] if weighted else [1.0] * len(REPLICAS)
                    seen[f] = [0.0] * len(REPLICAS)
                    means = {}
                    with torch.no_grad():
                        params = dict(global_model.named_parameters())
                        deltas = [{n: (params[n] - p) * share[q] for n, p in w.named_parameters()}
                                  for q, w in enumerate(workers)]
                        for u in layout["fragments"][f]:
                            names = layout["units"][u]
                            means.update(channel.mean(u, names, deltas))
                        means = {n: m / (sum(share) / len(share)) for n, m in means.items()}
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


@pytest.mark.parametrize("run", list(RUNS))
def test_int8_wire_equals_two_simulated_workers_with_error_feedback(results: list[dict], run: str) -> None:
    policy, weighted, steps = RUNS[run]
    layout = results[0][run]
    expected = _simulate(layout, "int8", weighted=weighted, steps=steps, **policy)
    for rank, r in enumerate(results):
        worker = 0 if rank in REPLICAS[0] else 1
        for name, value in expected[worker].items():
            torch.testing.assert_close(r[run]["params"][name], value, rtol=TOL, atol=TOL, msg=f"{rank} {name}")
    # The check can fail: exact fp32 DiLoCo and int8 without the residuals land further than the tolerance.
    for other in ("fp32", "no-feedback"):
        far = _simulate(layout, other, weighted=weighted, steps=steps, **policy)
        assert _distance(expected[0], far[0]) > 10 * TOL, (run, other, _distance(expected[0], far[0]))


def test_int8_wire_sends_about_a_quarter_of_fp32(results: list[dict]) -> None:
    for rank, r in enumerate(results):
        ratio = r["bytes"]["int8"] / r["bytes"]["fp32"]
        # 1 byte per element plus one fp32 scale per 256, the last block's padding, against 2 (R-1)/R x 4 bytes.
        assert 0.25 < ratio < 0.3, (rank, r["bytes"])


def test_int8_wire_residuals_checkpoint_and_resume_bitwise(results: list[dict]) -> None:
    uninterrupted = _simulate(results[0]["int8"], "int8", every=2, weighted=False, steps=END)
    for rank, r in enumerate(results):
        resume = r["resume"]
        assert resume["nonzero"] and resume["restored"] and resume["after_model_load"] == 0, rank
        worker = 0 if rank in REPLICAS[0] else 1
        assert _distance(resume["resumed"], r["int8"]["params"]) == 0.0, rank  # "int8" ran 6 steps uninterrupted
        assert _distance(resume["resumed"], uninterrupted[worker]) < TOL, rank
        assert _distance(resume["dropped"], r["int8"]["params"]) > 10 * TOL, rank


def test_two_stage_int8_from_three_replicas_rounds_the_mean_again_and_sends_two_thirds(results: list[dict]) -> None:
    residuals = [torch.zeros(TWO_STAGE_N) for _ in results]
    for i in range(2):
        sent = []
        for rank in range(len(results)):
            x = _values(rank, i) + residuals[rank]
            sent.append(_int8(x))
            residuals[rank] = x - sent[-1]
        expected = _int8(torch.stack(sent).mean(dim=0))  # the owners' fp32 means, rounded once more
        for rank, r in enumerate(results):
            mean = r["three"]["means"][i]
            torch.testing.assert_close(mean[:-1], expected, rtol=1e-6, atol=1e-6, msg=f"{rank} {i}")
            assert mean[-1].item() == 2.0  # the flags' mean, exact: (1 + 2 + 3) / 3
            assert torch.equal(mean, results[0]["three"]["means"][i])  # every replica applies the same values
        one_rounding = torch.stack(sent).mean(dim=0)  # the check can fail: the second rounding shows
        assert (expected - one_rounding).abs().max().item() > 1e-4
    for rank, r in enumerate(results):
        ratio = r["three"]["two_stage"] / r["three"]["one_stage"]
        assert 0.66 < ratio < 0.7, (rank, r["three"])  # 2 (R-1)/R against (R-1), the flags' bytes aside


def test_a_flushed_two_stage_average_completes_on_the_hop_worker(results: list[dict]) -> None:
    """DiLoCo's landing polls ``ready()`` and votes without waiting (``OuterState._vote_reduced``): once flushed,
    the second stage is issued by the hop worker, so the average completes with nobody waiting for it; unflushed,
    the wait would issue it, so it is never ready before. The same values as the wait-issued average, bitwise."""
    for rank, r in enumerate(results):
        three = r["three"]
        assert three["ready_before_flush"] == [False, False], rank
        assert three["ready_unwaited"] == [True, True], rank
        for flushed, waited in zip(three["flushed"], three["means"], strict=True):
            assert torch.equal(flushed, waited), rank
