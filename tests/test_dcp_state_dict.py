"""torch's own state dict helpers (``torch.distributed.checkpoint.state_dict``) on a ShardedModel and its
ShardedOptimizer: the FSDP2 recipe ``msd, osd = get_state_dict(model, opt); dcp.save(...)`` /
``set_state_dict(...)`` gives what it gives on FSDP2, keyed by parameter name (not by index).

One spawn of 4 ranks: a 2x2 hsdp mesh (plain and replica-sharded optimizer, an int8 hop), FSDP2 on a 2x2
mesh with a plain AdamW, and a heterogeneous [2, 1, 1] mesh. Every comparison is bitwise (``torch.equal``).
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from checkpoint_helpers import LR, WD, CkptNet, build, eval_step, full, model_state, optim_state, same
from harness import run_distributed
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    get_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map_only

import hsdp

FULL_CPU = StateDictOptions(full_state_dict=True, cpu_offload=True)
FULL = StateDictOptions(full_state_dict=True)
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def _copy(sd: Any) -> Any:
    """A deep copy (state dict values alias the live parameters and optimizer state)."""
    return tree_map_only(torch.Tensor, lambda t: t.detach().clone(), sd)


def _full_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Model and optimizer as full tensors, through the helpers (the same code path on hsdp and FSDP2)."""
    msd, osd = get_state_dict(model, opt)
    return {"model": full(msd), "optim": optim_state(osd)}


def _outputs(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Every form of the optimizer state the helpers give, as full tensors (collectives: call on every rank)."""
    return {"sharded": optim_state(get_optimizer_state_dict(model, opt)),
            "full": optim_state(get_optimizer_state_dict(model, opt, options=FULL)),
            "full_cpu": get_optimizer_state_dict(model, opt, options=FULL_CPU),
            "flat": full(get_optimizer_state_dict(model, opt, options=FLAT))}


def _fsdp2() -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dm = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(5)
    net = CkptNet()
    for block in net.blocks:
        fully_shard(block, mesh=dm)
    fully_shard(net, mesh=dm)
    return net, torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=WD)


def _load(model: nn.Module, opt: torch.optim.Optimizer, path: str) -> None:
    """The FSDP2 recipe's load, unchanged."""
    msd, osd = get_state_dict(model, opt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)


def _is_opt_state_dict(model: hsdp.ShardedModel, opt: hsdp.ShardedOptimizer) -> dict[str, bool]:
    """get_state_dict's optimizer part is ``opt.state_dict()``: names in the same order, the same param groups,
    the very DTensors (on the replica's param mesh, or the replica-sharded optimizer's slice mesh); its model
    part is ``model.state_dict()``."""
    msd, osd = get_state_dict(model, opt)
    ref, ref_model = opt.state_dict(), model.state_dict()
    tensors = [v for e in osd["state"].values() for v in e.values() if torch.is_tensor(v) and v.dim() > 0]
    meshes = {sp.fqn: sp.device_mesh if sp.slice is None else sp.slice_mesh for sp in model.sharded_params()}
    return {"names": list(osd["state"]) == list(ref["state"]) and all(isinstance(k, str) for k in osd["state"]),
            "groups": osd["param_groups"] == ref["param_groups"],
            "values": all(osd["state"].get(k, {}).get(n) is v for k, e in ref["state"].items() for n, v in e.items()),
            "dtensors": bool(tensors) and all(isinstance(v, DTensor) for v in tensors),
            "mesh": all(v.device_mesh == meshes.get(k) for k, e in osd["state"].items() for v in e.values()
                        if isinstance(v, DTensor) and v.dim() > 0),
            "model": list(msd) == list(ref_model) and same(full(msd), full(ref_model))}


def _round_trip(model: hsdp.ShardedModel, opt: hsdp.ShardedOptimizer, rank: int, world: int) -> dict[str, bool]:
    """get -> one step -> set restores bitwise: the state, and the next step (step counters included)."""
    msd, osd = _copy(get_state_dict(model, opt))
    before = _full_state(model, opt)
    eval_step(model, opt, rank, world)
    after_one = _full_state(model, opt)
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    restored = _full_state(model, opt)
    eval_step(model, opt, rank, world)
    return {"moved": not same(after_one, before), "restored": same(restored, before),
            "next_step": same(_full_state(model, opt), after_one)}


def _regular(rank: int, world: int, work: str) -> dict[str, Any]:
    """2x2 hsdp against FSDP2 2x2: the same outputs for the same state, checkpoints loading both ways."""
    mesh = hsdp.init_mesh(2)
    model, opt = build(mesh)
    for _ in range(2):
        eval_step(model, opt, rank, world)
    out: dict[str, Any] = {"layout": _is_opt_state_dict(model, opt)}
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(work, "hsdp"))
    saved = _full_state(model, opt)
    hsdp_out = _outputs(model, opt)
    whole = full(opt.state_dict()["state"])  # a collective: on every rank
    out["full_cpu_rank0"] = same(hsdp_out["full_cpu"]["state"], whole) if rank == 0 else hsdp_out["full_cpu"] == {}
    out["flat_keys"] = sorted(k for k in hsdp_out["flat"] if k.startswith("state.embed.weight."))

    net, fopt = _fsdp2()
    fresh = {"hsdp": full(get_optimizer_state_dict(*build(mesh, seed=3))), "fsdp2": full(get_optimizer_state_dict(
        net, fopt))}
    out["fresh_like_fsdp2"] = same(fresh["hsdp"], fresh["fsdp2"])
    _load(net, fopt, os.path.join(work, "hsdp"))
    out["fsdp2_loads_hsdp"] = same(_full_state(net, fopt), saved)
    out["outputs_like_fsdp2"] = {k: same(v, hsdp_out[k]) for k, v in _outputs(net, fopt).items()}
    eval_step(net, fopt, rank, world)
    fmsd, fosd = get_state_dict(net, fopt)
    dcp.save({"model": fmsd, "optim": fosd}, checkpoint_id=os.path.join(work, "fsdp2"))
    fsdp2_saved = _full_state(net, fopt)

    model2, opt2 = build(mesh, seed=7)
    _load(model2, opt2, os.path.join(work, "fsdp2"))
    out["hsdp_loads_fsdp2"] = same(_full_state(model2, opt2), fsdp2_saved)
    out["round_trip"] = _round_trip(model, opt, rank, world)
    out |= _options(model, opt, rank, world)
    return out


def _options(model: hsdp.ShardedModel, opt: hsdp.ShardedOptimizer, rank: int, world: int) -> dict[str, bool]:
    """set_optimizer_state_dict of the flattened, full and full + cpu_offload (broadcast from rank 0) forms
    restores the state they were taken from, after a step moved it."""
    out = {}
    broadcast = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    for name, get, put in (("flat", FLAT, FLAT), ("full", FULL, FULL), ("broadcast", FULL_CPU, broadcast)):
        sd = _copy(get_optimizer_state_dict(model, opt, options=get))
        before = _full_state(model, opt)["optim"]
        eval_step(model, opt, rank, world)
        set_optimizer_state_dict(model, opt, sd, options=put)
        out[f"set_{name}"] = same(_full_state(model, opt)["optim"], before)
    return out


def _fresh_init(mesh: hsdp.HSDPMesh) -> dict[str, Any]:
    """torch's helpers create a fresh optimizer's state with one zero-gradient step at lr 0: the parameters
    must not move (weight decay too), for hsdp's own steps as well (Adafactor)."""
    out = {}
    for name, make in (("adamw", lambda p: torch.optim.AdamW(p, lr=LR, weight_decay=WD)),
                       ("adafactor", lambda p: torch.optim.Adafactor(p, lr=LR, weight_decay=WD))):
        torch.manual_seed(11)
        model = hsdp.ShardedModel(CkptNet(), mesh=mesh)
        opt = hsdp.ShardedOptimizer(model, make(model.parameters()))
        before = model_state(model)
        osd = get_optimizer_state_dict(model, opt)
        out[name] = {"params_kept": same(model_state(model), before), "state_created": len(osd["state"]) > 0,
                     "names": all(isinstance(k, str) for k in osd["state"])}
    return out


def _sliced(rank: int, world: int, work: str) -> dict[str, Any]:
    """Replica-sharded optimizer: loads the plain 2x2 checkpoint through a fresh optimizer (torch's
    zero-gradient init step on sliced state), gives opt.state_dict(), round-trips."""
    mesh = hsdp.init_mesh(2)
    model, opt = build(mesh, seed=4, sliced=True)
    _load(model, opt, os.path.join(work, "hsdp"))
    plain, popt = build(mesh, seed=5)
    _load(plain, popt, os.path.join(work, "hsdp"))
    out: dict[str, Any] = {"loads_plain": same(_full_state(model, opt), _full_state(plain, popt))}
    eval_step(model, opt, rank, world)
    eval_step(plain, popt, rank, world)
    out["steps_like_plain"] = same(_full_state(model, opt), _full_state(plain, popt))
    out["layout"] = _is_opt_state_dict(model, opt)
    full_cpu, whole = get_optimizer_state_dict(model, opt, options=FULL_CPU), full(opt.state_dict()["state"])
    out["full_cpu_rank0"] = same(full_cpu["state"], whole) if rank == 0 else full_cpu == {}
    out["round_trip"] = _round_trip(model, opt, rank, world)
    return out


def _hop_and_hetero(rank: int, world: int) -> dict[str, Any]:
    """The int8 hop's residuals: not in torch's layout, a warning; a heterogeneous mesh: names, round trip."""
    torch.manual_seed(0)
    model = hsdp.ShardedModel(CkptNet(), mesh=hsdp.init_mesh(2), replica_hop=hsdp.Int8ErrorFeedbackHop())
    opt = hsdp.ShardedOptimizer(model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD))
    eval_step(model, opt, rank, world)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        osd = get_optimizer_state_dict(model, opt)
    out: dict[str, Any] = {
        "hop_warned": any("hop residuals" in str(w.message) for w in caught),
        "hop_in_state_dict": "hop_residuals" in opt.state_dict() and "hop_residuals" not in osd}
    model, opt = build(hsdp.init_mesh([2, 1, 1]), seed=2)
    for _ in range(2):
        eval_step(model, opt, rank, world)
    out["hetero_layout"] = _is_opt_state_dict(model, opt)
    out["hetero_round_trip"] = _round_trip(model, opt, rank, world)
    return out


def _all(rank: int, world: int, work: str) -> dict[str, Any]:
    out = {"regular": _regular(rank, world, work), "fresh": _fresh_init(hsdp.init_mesh(2))}
    out["sliced"] = _sliced(rank, world, work)
    out |= _hop_and_hetero(rank, world)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_distributed(_all, 4, str(tmp_path_factory.mktemp("dsd")))


def _every_rank(runs: list[dict[str, Any]], *path: str) -> list[Any]:
    values = []
    for r in runs:
        for key in path:
            r = r[key]
        values.append(r)
    return values


def test_get_state_dict_is_name_keyed_like_opt_state_dict(runs: list[dict[str, Any]]) -> None:
    for layout in _every_rank(runs, "regular", "layout"):
        assert layout == dict.fromkeys(layout, True)


def test_fsdp2_and_hsdp_load_each_others_checkpoints(runs: list[dict[str, Any]]) -> None:
    for r in _every_rank(runs, "regular"):
        assert r["fsdp2_loads_hsdp"] and r["hsdp_loads_fsdp2"]
        assert r["fresh_like_fsdp2"]  # a fresh optimizer's templates: the same zero state, step 1


def test_every_option_gives_what_fsdp2_gives(runs: list[dict[str, Any]]) -> None:
    for r in _every_rank(runs, "regular"):
        assert r["outputs_like_fsdp2"] == dict.fromkeys(r["outputs_like_fsdp2"], True)
        assert r["full_cpu_rank0"]
        assert r["flat_keys"] == ["state.embed.weight.exp_avg", "state.embed.weight.exp_avg_sq",
                                  "state.embed.weight.step"]


def test_round_trip_and_set_options_restore_bitwise(runs: list[dict[str, Any]]) -> None:
    for r in _every_rank(runs, "regular"):
        assert r["round_trip"] == {"moved": True, "restored": True, "next_step": True}
        assert r["set_flat"] and r["set_full"] and r["set_broadcast"]


def test_fresh_optimizer_init_step_keeps_parameters(runs: list[dict[str, Any]]) -> None:
    for fresh in _every_rank(runs, "fresh"):
        for name, checks in fresh.items():
            assert checks == dict.fromkeys(checks, True), name


def test_replica_sharded_optimizer(runs: list[dict[str, Any]]) -> None:
    for r in _every_rank(runs, "sliced"):
        assert r["loads_plain"] and r["steps_like_plain"] and r["full_cpu_rank0"]
        assert r["layout"] == dict.fromkeys(r["layout"], True)
        assert r["round_trip"] == {"moved": True, "restored": True, "next_step": True}


def test_hop_residuals_left_out_with_a_warning(runs: list[dict[str, Any]]) -> None:
    for r in runs:
        assert r["hop_warned"] and r["hop_in_state_dict"]


def test_heterogeneous_mesh(runs: list[dict[str, Any]]) -> None:
    for r in runs:
        assert r["hetero_layout"] == dict.fromkeys(r["hetero_layout"], True)
        assert r["hetero_round_trip"] == {"moved": True, "restored": True, "next_step": True}
