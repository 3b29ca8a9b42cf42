"""Checkpoints of a DiLoCo model (``hsdp/checkpoint/diloco.py``), on a 2 x 2 gloo mesh, in one 4-rank spawn.

- H = 4, inner AdamW, outer Nesterov: saved after step 6 (mid-phase: the replicas' weights differ, phase 2),
  trained on to step 10; a fresh model and optimizer loaded from the checkpoint and trained to step 10 give the
  same losses, weights, global copy, outer momentum and phase, bitwise (each replica resumes its own state);
- a model without DiLoCo loads the global copy's weights and replica 0's inner optimizer state;
- a checkpoint without DiLoCo loaded into a stepped DiLoCo model: local = global = the weights, phase 0, no
  outer momentum;
- the DiLoCo checkpoint on 1 replica of 4 ranks: the global copy, phase 0, the outer momentum kept, a warning;
- the int8 wire (``wire_dtype=torch.int8``): every rank's residuals come back exactly and the resume mid-phase is
  bitwise; on 1 replica they start from zero;
- ``optimizer.state_dict()`` and torch's ``get_state_dict`` refuse a DiLoCo optimizer (they would keep one
  replica's state), naming ``hsdp.save_checkpoint``, and so does ``save_checkpoint`` without the optimizer.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import pytest
import torch
from harness import run_distributed
from models import ParityNet, train_steps
from torch.distributed.checkpoint.state_dict import get_state_dict

import hsdp
from hsdp.checkpoint import restore
from hsdp.engine.optim.outer_checkpoint import global_weights, outer_state_dict

WORLD, H, SAVE, END = 4, 4, 6, 10


def _diloco() -> hsdp.DiLoCo:
    return hsdp.DiLoCo(every=H, outer_lr=0.7, outer_momentum=0.9)


def _build(sync: hsdp.DiLoCo | None, seed: int, sharding: int = 2) -> tuple[hsdp.ShardedModel, hsdp.ShardedOptimizer]:
    torch.manual_seed(seed)
    model = hsdp.ShardedModel(ParityNet(), mesh=hsdp.init_mesh(sharding), replica_sync=sync)
    return model, hsdp.ShardedOptimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-2))


def _local(model: hsdp.ShardedModel) -> dict[str, torch.Tensor]:
    """This rank's chunk of every parameter (this replica's weights)."""
    return {n: p.detach().to_local().clone() for n, p in model.named_parameters()}


def _outer(opt: hsdp.ShardedOptimizer, full: bool = False) -> dict[str, Any]:
    """The global copy (this rank's chunks, or full: a collective), outer momentum and phase."""
    sd = outer_state_dict(opt._hsdp_outer)
    take = (lambda t: t.full_tensor()) if full else (lambda t: t.to_local().clone())
    return {"global": {n: take(t) for n, t in sd["global"].items()},
            "momentum": {n: take(s["momentum_buffer"]) for n, s in sd["outer"].items()},
            "phase": int(sd["phase"])}


def _inner(opt: hsdp.ShardedOptimizer) -> dict[str, torch.Tensor]:
    """This rank's chunk of the inner AdamW's first moments, by parameter name."""
    sd = opt._named_state_dict()["state"]
    return {n: s["exp_avg"].to_local().clone() for n, s in sd.items()}


def _refusals(model: hsdp.ShardedModel, opt: hsdp.ShardedOptimizer, run: str) -> dict[str, str]:
    out = {}
    calls = {"state_dict": opt.state_dict, "get_state_dict": lambda: get_state_dict(model, opt),
             "model_only": lambda: hsdp.save_checkpoint(run, model)}
    for name, call in calls.items():
        try:
            call()
            out[name] = "accepted"
        except ValueError as e:
            out[name] = str(e)
    return out


def _int8(rank: int, run: str) -> dict[str, Any]:
    """The int8 wire's residuals (per rank, each replica's own) through a checkpoint mid-phase: a resume is
    bitwise; on another replica count they start from zero."""
    sync = hsdp.DiLoCo(every=H, outer_lr=0.7, outer_momentum=0.9, wire_dtype=torch.int8)
    model, opt = _build(sync, seed=0)
    train_steps(model, opt, rank, range(SAVE))
    saved = {k: v.clone() for k, v in opt._hsdp_outer.wire.residuals.items()}
    hsdp.save_checkpoint(run, model, opt)
    train_steps(model, opt, rank, range(SAVE, END))
    out: dict[str, Any] = {"end": _local(model), "nonzero": bool(saved) and all(bool(v.any()) for v in saved.values())}
    model, opt = _build(sync, seed=1)
    hsdp.load_checkpoint(run, model, opt)
    out["restored"] = _equal(saved, opt._hsdp_outer.wire.residuals)
    train_steps(model, opt, rank, range(SAVE, END))
    out["resumed_end"] = _local(model)
    model, opt = _build(sync, seed=5, sharding=4)  # one replica of 4 ranks
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the replica count's warning: test_another_replica_count_...
        hsdp.load_checkpoint(run, model, opt)
    out["one_replica"] = len(opt._hsdp_outer.wire.residuals)
    return out


def _worker(rank: int, world: int, tmp: str) -> dict:
    run, plain_run = os.path.join(tmp, "diloco"), os.path.join(tmp, "plain")
    out: dict[str, Any] = {"int8": _int8(rank, os.path.join(tmp, "int8"))}
    model, opt = _build(_diloco(), seed=0)
    out["replica"], out["shard"] = model.mesh.replicate_rank, model.mesh.shard_rank
    out["losses"] = train_steps(model, opt, rank, range(SAVE))
    hsdp.save_checkpoint(run, model, opt, extra={"step": SAVE}, step=SAVE)
    out["saved"] = {"local": _local(model), "outer": _outer(opt), "inner": _inner(opt),
                    "weights": {n: t.to_local().clone() for n, t in global_weights(opt._hsdp_outer).items()}}
    out["saved_full"] = _outer(opt, full=True)
    out["refusals"] = _refusals(model, opt, run)
    fresh_model, fresh = _build(_diloco(), seed=0)  # torch's helpers first step a fresh optimizer at lr 0
    out["fresh"] = {"refusal": _refusals(fresh_model, fresh, run)["get_state_dict"],
                    "phase": fresh._hsdp_outer.inner_steps, "last_sync": fresh.last_sync, "steps": fresh._hsdp_steps}
    del fresh_model, fresh
    out["losses"] += train_steps(model, opt, rank, range(SAVE, END))
    out["end"] = {"local": _local(model), "outer": _outer(opt)}

    model, opt = _build(_diloco(), seed=1)
    extra = hsdp.load_checkpoint(run, model, opt)
    out["resumed_at_save"] = {"extra": extra, "local": _local(model), "outer": _outer(opt), "inner": _inner(opt)}
    out["resumed_losses"] = train_steps(model, opt, rank, range(SAVE, END))
    out["resumed_end"] = {"local": _local(model), "outer": _outer(opt)}

    model, opt = _build(None, seed=2)  # no DiLoCo: the global copy's weights, replica 0's inner state
    restore(run, model, opt)  # what hsdp train's resume calls
    out["plain_from_diloco"] = {"local": _local(model), "inner": _inner(opt)}

    plain, plain_opt = _build(None, seed=3)
    train_steps(plain, plain_opt, rank, range(3))
    hsdp.save_checkpoint(plain_run, plain, plain_opt, step=3)
    model, opt = _build(_diloco(), seed=4)
    train_steps(model, opt, rank, range(H + 1))  # a sync (outer momentum) and phase 1 to be replaced
    out["stepped_before_plain_load"] = _outer(opt)["phase"], len(opt._hsdp_outer.outer.state)
    hsdp.load_checkpoint(plain_run, model, opt)
    out["diloco_from_plain"] = {"expected": _local(plain), "local": _local(model), "outer": _outer(opt),
                                "outer_state": len(opt._hsdp_outer.outer.state)}

    model, opt = _build(_diloco(), seed=5, sharding=4)  # one replica of 4 ranks
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hsdp.load_checkpoint(run, model, opt)
    out["one_replica"] = {"full": {n: p.detach().full_tensor() for n, p in model.named_parameters()},
                          "outer": _outer(opt, full=True), "warnings": [str(w.message) for w in caught]}
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return run_distributed(_worker, WORLD, str(tmp_path_factory.mktemp("diloco_ckpt")), timeout=300)


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _peer(results: list[dict], r: dict, replica: int) -> dict:
    """The rank holding ``r``'s shard on replica ``replica``."""
    return next(o for o in results if o["shard"] == r["shard"] and o["replica"] == replica)


def test_mid_phase_replicas_differ_so_the_resume_is_meaningful(results: list[dict]) -> None:
    for r in results:
        assert r["saved"]["outer"]["phase"] == SAVE % H
        other = _peer(results, r, 1 - r["replica"])
        assert not _equal(r["saved"]["local"], other["saved"]["local"])
        assert not _equal(r["saved"]["inner"], other["saved"]["inner"])
        assert not _equal(r["saved"]["local"], r["saved"]["weights"])  # the global copy is neither replica's


def test_resume_mid_phase_is_bitwise(results: list[dict]) -> None:
    for r in results:
        at = r["resumed_at_save"]
        assert at["extra"] == {"step": SAVE}
        assert _equal(at["local"], r["saved"]["local"]) and _equal(at["inner"], r["saved"]["inner"])
        assert _equal(at["outer"]["global"], r["saved"]["outer"]["global"])
        assert _equal(at["outer"]["momentum"], r["saved"]["outer"]["momentum"])
        assert at["outer"]["phase"] == r["saved"]["outer"]["phase"]
        assert r["resumed_losses"] == r["losses"][SAVE:]
        assert _equal(r["resumed_end"]["local"], r["end"]["local"])
        assert _equal(r["resumed_end"]["outer"]["global"], r["end"]["outer"]["global"])
        assert _equal(r["resumed_end"]["outer"]["momentum"], r["end"]["outer"]["momentum"])
        assert r["resumed_end"]["outer"]["phase"] == r["end"]["outer"]["phase"] == END % H


def test_a_model_without_diloco_loads_the_global_copy_and_replica_0s_inner_state(results: list[dict]) -> None:
    for r in results:
        got = r["plain_from_diloco"]
        assert _equal(got["local"], r["saved"]["weights"])
        assert _equal(got["inner"], _peer(results, r, 0)["saved"]["inner"])


def test_a_checkpoint_without_diloco_restarts_the_outer_state_from_its_weights(results: list[dict]) -> None:
    for r in results:
        phase, momenta = r["stepped_before_plain_load"]
        assert phase == 1 and momenta > 0  # what loading must replace
        got = r["diloco_from_plain"]
        assert _equal(got["local"], got["expected"]) and _equal(got["outer"]["global"], got["expected"])
        assert got["outer"]["phase"] == 0 and got["outer"]["momentum"] == {} and got["outer_state"] == 0


def test_another_replica_count_starts_every_replica_from_the_global_copy(results: list[dict]) -> None:
    saved = results[0]["saved_full"]
    for r in results:
        got = r["one_replica"]
        assert _equal(got["full"], saved["global"])
        assert _equal(got["outer"]["global"], saved["global"])
        assert _equal(got["outer"]["momentum"], saved["momentum"])
        assert got["outer"]["phase"] == 0
    assert any("a DiLoCo run of 2 replica(s) loaded on 1" in w for w in results[0]["one_replica"]["warnings"])


def test_int8_wire_residuals_resume_mid_phase_bitwise(results: list[dict]) -> None:
    for rank, r in enumerate(results):
        int8 = r["int8"]
        assert int8["nonzero"] and int8["restored"], rank
        assert _equal(int8["resumed_end"], int8["end"]), rank
        assert int8["one_replica"] == 0, rank  # replicas have no identity across replica counts


def test_state_dicts_that_would_keep_one_replica_are_refused(results: list[dict]) -> None:
    for r in results:
        for name in ("state_dict", "get_state_dict"):
            assert "would keep one replica's inner optimizer state" in r["refusals"][name], name
            assert "hsdp.save_checkpoint" in r["refusals"][name]
        assert "needs its ShardedOptimizer" in r["refusals"]["model_only"]
        # torch's zero-lr step creating a fresh optimizer's state is no inner step: the phase did not move.
        fresh = r["fresh"]
        assert "would keep one replica's inner optimizer state" in fresh["refusal"]
        assert (fresh["phase"], fresh["last_sync"], fresh["steps"]) == (0, None, 0), fresh
