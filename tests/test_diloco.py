"""DiLoCo as the inter-node mode (``ShardedModel(replica_sync=hsdp.DiLoCo(...))``), on a 2 x 2 gloo mesh.

One 4-rank spawn:
- H = 1, outer lr 1, no outer momentum, inner SGD with momentum: equal to plain hsdp's training (1e-5), the
  update being linear in the gradients;
- H = 4, outer Nesterov SGD (lr 0.7, momentum 0.9), inner AdamW, 8 steps: equal to a hand-written one-process
  simulation of two DiLoCo workers (each replica's batch the concatenation of its two ranks') to 1e-5;
- inter-node bytes: nothing on the 3 inner steps, one all-reduce of the model's flat shards per sync, in fp32 or
  in the wire dtype (bf16: half);
- the int8 wire (``wire_dtype=torch.int8``): equal to the simulation whose mean is each rank's flat shard
  quantised with error feedback (``tests/test_diloco_int8.py``'s, here on a grid: padded chunks);
- refused with a ValueError before any collective: every < 1, a replica_hop next to DiLoCo,
  the replica-sharded optimizer; a plain torch optimizer stepping a DiLoCo model is refused at its step (batch
  weights and replicas of different degrees compose with DiLoCo: ``tests/test_diloco_compose.py``);
  ``hsdp.save_checkpoint`` of a DiLoCo model is accepted (its resume: ``tests/test_diloco_checkpoint.py``);
- ``check_replicas`` (``check_replicas_every=1`` under Streaming DiLoCo, whose replicas never all agree) compares
  the global copy: it passes at every step and names a global copy changed on one replica.
"""

from __future__ import annotations

import time

import pytest
import torch
from harness import run_distributed
from models import ParityNet, batch, loss_fn, train_steps
from test_diloco_int8 import _Wire

import hsdp

WORLD, STEPS = 4, 8
LATE_S = 0.4  # replica 1's lateness at a sync (_sync_seconds)


def _replicate_bytes(model: hsdp.ShardedModel) -> float:
    return sum(op["bytes"] for op in model.comm_stats().get("replicate", {}).values())


def _train(rank: int, sync: hsdp.DiLoCo | None, inner: str, steps: int = STEPS,
           finish: bool = False) -> tuple[dict[str, torch.Tensor], list[float]]:
    torch.manual_seed(0)
    model = hsdp.ShardedModel(ParityNet(), mesh=hsdp.init_mesh(2), replica_sync=sync)
    base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9) if inner == "sgd" \
        else torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt = hsdp.ShardedOptimizer(model, base)
    sent = []
    for step in range(steps):
        model.reset_comm_stats()
        x, y = batch(step, rank)
        loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        sent.append(_replicate_bytes(model))
    if finish:  # mid-phase: the replicas differ until the final sync
        model.reset_comm_stats()
        opt.sync_replicas()
        sent.append(_replicate_bytes(model))
    return {n: p.detach().full_tensor() for n, p in model.named_parameters()}, sent


def _sync_seconds(rank: int, late: float) -> list[float]:
    """``last_sync.seconds`` after each of 4 inner steps of DiLoCo(every=4), replica 1 reaching the sync (the 4th
    step) ``late`` seconds after replica 0."""
    model = hsdp.ShardedModel(ParityNet(), mesh=hsdp.init_mesh(2), replica_sync=hsdp.DiLoCo(every=4))
    opt = hsdp.ShardedOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1))
    seconds = []
    for step in range(4):
        x, y = batch(step, rank)
        loss_fn(model(x), y).backward()
        if step == 3 and model.mesh.replicate_rank == 1:
            time.sleep(late)
        opt.step()
        opt.zero_grad()
        seconds.append(opt.last_sync.seconds)
        assert opt.last_sync.waited < 0.05  # a fixed mesh has no quorum to wait for: the wait is the landing's
    return seconds


def _refusals(rank: int, tmp: str) -> dict[str, str]:
    out = {}
    cases = {"every": lambda: hsdp.DiLoCo(every=0),
             "hop": lambda: hsdp.ShardedModel(ParityNet(), mesh=hsdp.init_mesh(2), replica_sync=hsdp.DiLoCo(),
                                              replica_hop=hsdp.AllReduceHop()),
             "sliced": lambda: hsdp.ShardedModel(ParityNet(), mesh=hsdp.init_mesh(2), replica_sync=hsdp.DiLoCo(),
                                                 shard_optimizer_across_replicas=True)}
    for name, make in cases.items():
        try:
            make()
            out[name] = "accepted"
        except ValueError as e:
            out[name] = str(e)
    model = hsdp.ShardedModel(ParityNet(), mesh=hsdp.init_mesh(2), replica_sync=hsdp.DiLoCo(every=2))
    wrapped = hsdp.ShardedOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1))
    try:
        hsdp.save_checkpoint(tmp, model, wrapped)  # every replica's state: hsdp/checkpoint/diloco.py
        out["checkpoint"] = "accepted"
    except ValueError as e:
        out["checkpoint"] = str(e)
    plain = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = batch(0, rank)
    loss_fn(model(x), y).backward()
    try:
        plain.step()
        out["plain"] = "accepted"
    except ValueError as e:
        out["plain"] = str(e)
    return out


def _checked(rank: int) -> dict[str, str]:
    """Streaming DiLoCo with ``check_replicas_every=1``: the replicas' weights never all agree, the global copy
    always does, and a global copy changed on one replica is caught."""
    torch.manual_seed(0)
    sync = hsdp.DiLoCo(every=4, outer_lr=0.7, outer_momentum=0.9, fragments=2, delay=1)
    model = hsdp.ShardedModel(ParityNet(), mesh=hsdp.init_mesh(2), replica_sync=sync)
    opt = hsdp.ShardedOptimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-2), check_replicas_every=1)
    out = {}
    try:
        train_steps(model, opt, rank, range(6))
        out["every_step"] = "passed"
    except hsdp.ReplicaDivergence as e:
        out["every_step"] = str(e)
    if rank >= 2:  # replica 1's copy of the first unit's global weights
        opt._hsdp_outer.global_copy[0].add_(1.0)
    try:
        model.check_replicas()
        out["corrupted"] = "passed"
    except hsdp.ReplicaDivergence as e:
        out["corrupted"] = str(e)
    return out


def _worker(rank: int, world: int, tmp: str) -> dict:
    flat = sum(u.sharded_flat.numel() for u in hsdp.ShardedModel(ParityNet(), mesh=hsdp.init_mesh(2)).units)
    return {"flat": flat, "plain": _train(rank, None, "sgd")[0],
            "h1": _train(rank, hsdp.DiLoCo(every=1, outer_lr=1.0, outer_momentum=0.0), "sgd")[0],
            "h4": _train(rank, hsdp.DiLoCo(every=4, outer_lr=0.7, outer_momentum=0.9), "adamw"),
            "h4_bf16": _train(rank, hsdp.DiLoCo(every=4, wire_dtype=torch.bfloat16), "adamw")[1],
            "h4_int8": _train(rank, hsdp.DiLoCo(every=4, outer_lr=0.7, outer_momentum=0.9, wire_dtype=torch.int8),
                              "adamw")[0],
            "units": [[p.fqn for p in u.params] for u in hsdp.ShardedModel(ParityNet(), mesh=hsdp.init_mesh(2)).units
                      if u.params],
            "h4_final": _train(rank, hsdp.DiLoCo(every=4, outer_lr=0.7, outer_momentum=0.9), "adamw", steps=6,
                               finish=True),
            "refusals": _refusals(rank, tmp), "checked": _checked(rank), "rank": rank,
            "seconds": _sync_seconds(rank, LATE_S)}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return run_distributed(_worker, WORLD, str(tmp_path_factory.mktemp("diloco")), timeout=240)


def _simulate(every: int, outer_lr: float, momentum: float, steps: int = STEPS,
              wire: tuple[_Wire, list[list[str]]] | None = None) -> dict[str, torch.Tensor]:
    """Two DiLoCo workers in one process: replica q trains on its ranks' batches (2q, 2q + 1), inner AdamW; a
    last sync after the last step when it is not a sync step (``sync_replicas``). ``wire``: the pseudo-gradients'
    mean through an int8 wire (and the units), else the exact mean."""
    torch.manual_seed(0)
    global_model = ParityNet()
    workers = [ParityNet() for _ in range(2)]
    for w in workers:
        w.load_state_dict(global_model.state_dict())
    inner = [torch.optim.AdamW(w.parameters(), lr=1e-2) for w in workers]
    outer = torch.optim.SGD(global_model.parameters(), lr=outer_lr, momentum=momentum, nesterov=momentum > 0)
    for step in range(steps):
        for q, (w, opt) in enumerate(zip(workers, inner, strict=True)):
            parts = [batch(step, 2 * q + s) for s in range(2)]
            loss_fn(w(torch.cat([p[0] for p in parts])), torch.cat([p[1] for p in parts])).backward()
            opt.step()
            opt.zero_grad()
        if (step + 1) % every == 0 or step == steps - 1:
            with torch.no_grad():
                if wire is not None:
                    params = dict(global_model.named_parameters())
                    means = wire[0].means(wire[1], [{n: params[n] - p for n, p in w.named_parameters()}
                                                    for w in workers])
                for name, g in global_model.named_parameters():
                    locals_ = [dict(w.named_parameters())[name] for w in workers]
                    g.grad = torch.stack([g - p for p in locals_]).mean(0) if wire is None else means[name]
            outer.step()
            outer.zero_grad()
            for w in workers:
                w.load_state_dict(global_model.state_dict())
    return {n: p.detach().clone() for n, p in global_model.named_parameters()}


def test_one_step_syncs_with_unit_outer_lr_equal_plain_hsdp(results: list[dict]) -> None:
    for r in results:
        for name, value in r["plain"].items():
            torch.testing.assert_close(r["h1"][name], value, rtol=1e-5, atol=1e-5, msg=name)


def test_four_step_syncs_equal_two_simulated_workers(results: list[dict]) -> None:
    ref = _simulate(4, 0.7, 0.9)
    for r in results:
        params, _ = r["h4"]
        for name, value in ref.items():
            torch.testing.assert_close(params[name], value, rtol=1e-5, atol=1e-5, msg=name)


def test_an_int8_wire_equals_two_simulated_workers_with_error_feedback(results: list[dict]) -> None:
    ref = _simulate(4, 0.7, 0.9, wire=(_Wire("int8", padded=True), results[0]["units"]))
    for r in results:
        for name, value in ref.items():
            torch.testing.assert_close(r["h4_int8"][name], value, rtol=1e-5, atol=1e-5, msg=name)
    # The check can fail: exact fp32 and int8 without the residuals are further than the tolerance.
    for far in (_simulate(4, 0.7, 0.9), _simulate(4, 0.7, 0.9, wire=(_Wire("no-feedback", padded=True),
                                                                      results[0]["units"]))):
        assert max((ref[n] - far[n]).abs().max().item() for n in ref) > 1e-4


def test_a_final_sync_mid_phase_makes_every_replica_the_global_copy(results: list[dict]) -> None:
    ref = _simulate(4, 0.7, 0.9, steps=6)  # syncs after steps 4 and, by sync_replicas, 6
    for r in results:
        params, sent = r["h4_final"]
        for name, value in ref.items():
            torch.testing.assert_close(params[name], value, rtol=1e-5, atol=1e-5, msg=name)
        assert sent == [0, 0, 0, r["flat"] * 4, 0, 0, r["flat"] * 4]


def test_inter_node_bytes_are_one_all_reduce_of_the_model_per_sync(results: list[dict]) -> None:
    for r in results:
        _, sent = r["h4"]
        assert sent == [0, 0, 0, r["flat"] * 4] * 2  # fp32 pseudo-gradients of this rank's flat shards
        assert r["h4_bf16"] == [0, 0, 0, r["flat"] * 2] * 2


def test_a_sync_reports_its_seconds_waits_for_a_late_replica_included(results: list[dict]) -> None:
    for r in results:
        *inner, sync = r["seconds"]
        assert all(0 <= s < 0.05 for s in inner), r["seconds"]  # no sync: nothing but the phase's count
        if r["rank"] < 2:  # replica 0 waited for replica 1's pseudo-gradients
            assert LATE_S * 0.75 < sync < LATE_S + 2.0, r["seconds"]
        else:
            assert sync < LATE_S * 0.75, r["seconds"]


def test_check_replicas_compares_the_global_copy_under_streaming_diloco(results: list[dict]) -> None:
    for r in results:
        assert r["checked"]["every_step"] == "passed", r["checked"]
        assert "DiLoCo global copy shard(s) differ across replicas" in r["checked"]["corrupted"], r["checked"]


def test_refusals_name_the_fix(results: list[dict]) -> None:
    got = results[0]["refusals"]
    assert "the inner steps between syncs must be an int >= 1" in got["every"]
    assert "drop replica_hop" in got["hop"]
    assert "turn shard_optimizer_across_replicas off" in got["sliced"]
    assert got["checkpoint"] == "accepted"
    assert "syncs replicas with DiLoCo" in got["plain"] and "hsdp.ShardedOptimizer(model, optimizer)" in got["plain"]
