"""Checkpoints: save on 2x2, layout on disk, replica-0-only reads, exact resume, resharding, FSDP2 both ways,
safetensors export. One spawn per world layout; each sweeps several configurations."""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any

import pytest
import torch
from checkpoint_helpers import (
    LR,
    WD,
    CkptNet,
    build,
    close,
    eval_step,
    full,
    local_snapshot,
    model_state,
    optim_state,
    same,
    seed_rank,
    train_step,
)
from harness import run_distributed
from models import global_batch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

import hsdp
from hsdp.apps.cli import main as cli_main
from hsdp.checkpoint import load_safetensors, restore
from hsdp.checkpoint.dcp_io import read_metadata_file


# ---------------------------------------------------------------------------------------------------------
# Spawn A (2x2): train 5 steps, save, train 5 more; probe a load on 2x2 (bytes and file opens per rank).
# ---------------------------------------------------------------------------------------------------------
def _opens_under(root: str) -> list[str]:
    """Files opened under ``root`` while the returned list's first item is truthy (a Python audit hook)."""
    record: list[Any] = [False]

    def hook(event: str, args: tuple) -> None:
        if record[0] and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
            path = os.fsdecode(args[0])
            if os.path.abspath(path).startswith(root):
                record.append(path)

    sys.addaudithook(hook)
    return record


def _probe_load(rank: int, world: int, mesh: hsdp.HSDPMesh, run_dir: str, ref: dict) -> dict:
    model, opt = build(mesh, seed=1)
    opens = _opens_under(run_dir)
    opens[0] = True
    result = restore(run_dir, model, opt)
    opens[0] = False
    out = {"bytes": result.bytes_read, "tensor_bytes": result.tensor_bytes, "opens": len(opens) - 1,
           "extra_step": result.extra["step"], "extra_rank": result.extra["rank"],
           "model": same(model_state(model), ref["model"]), "optim": same(optim_state(opt.state_dict()), ref["optim"])}
    out["eval_loss"] = eval_step(model, opt, rank, world)
    out["after_eval"] = model_state(model)
    return out


def _save_train_probe(rank: int, world: int, run_dir: str) -> dict:
    mesh = hsdp.init_mesh(2)
    model, opt = build(mesh)
    seed_rank(rank)
    losses = [train_step(model, opt) for _ in range(5)]
    extra = {"step": 5, "pos": 5, "rank": rank, "rng": hsdp.capture_rng_state()}
    path = hsdp.save_checkpoint(run_dir, model, opt, extra=extra, step=5)
    ref = {"model": model_state(model), "optim": optim_state(opt.state_dict())}
    losses += [train_step(model, opt) for _ in range(5)]
    out = {"path": path, "losses": losses, "final": model_state(model), "final_optim": optim_state(opt.state_dict())}
    out["probe"] = _probe_load(rank, world, mesh, run_dir, ref)
    if rank == 0:
        out["ref"] = ref
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict:
    run_dir = str(tmp_path_factory.mktemp("ckpt") / "run")
    results = run_distributed(_save_train_probe, 4, run_dir)
    return {"run_dir": run_dir, "ranks": results, "ref": results[0]["ref"], "path": results[0]["path"]}


def test_save_layout_each_shard_written_once_spread_over_writers(saved: dict) -> None:
    path = saved["path"]
    assert os.path.basename(path) == "step_000005"
    with open(os.path.join(saved["run_dir"], "latest")) as f:
        assert f.read().strip() == "step_000005"
    assert not [n for n in os.listdir(saved["run_dir"]) if ".tmp-" in n]
    md, _ = read_metadata_file(os.path.join(path, ".metadata"))
    ref = saved["ref"]
    per_file: dict[str, int] = {}
    for info in md.storage_data.values():
        per_file[info.relative_path] = per_file.get(info.relative_path, 0) + info.length
    for key, meta in md.state_dict_metadata.items():
        if isinstance(meta, TensorStorageMetadata):
            covered = sum(torch.Size(c.sizes).numel() for c in meta.chunks)
            assert covered == meta.size.numel(), f"{key}: chunks cover {covered} of {meta.size.numel()} elements"
    # Original names and shapes, FSDP2's layout.
    for name, tensor in ref["model"].items():
        assert tuple(md.state_dict_metadata[f"model.{name}"].size) == tuple(tensor.shape), name
    assert "optim.state.blocks.0.up.weight.exp_avg" in md.state_dict_metadata
    assert "optim.param_groups.0.lr" in md.state_dict_metadata
    writers = [n for n in per_file if n.endswith(".distcp")]
    assert len(writers) == 4
    mean = sum(per_file[n] for n in writers) / 4
    assert all(per_file[n] > 0.4 * mean for n in writers), per_file  # spread across the 4 writers


def test_only_replica_0_reads_and_each_shard_is_read_once(saved: dict) -> None:
    probes = [r["probe"] for r in saved["ranks"]]
    for rank, p in enumerate(probes):
        assert p["model"] and p["optim"], f"rank {rank}: loaded state differs from the saved one"
        assert p["extra_step"] == 5 and p["extra_rank"] == rank
    # Replica 1 (ranks 2, 3): no checkpoint bytes and no file opened under the run directory.
    assert [p["bytes"] for p in probes[2:]] == [0, 0] and [p["opens"] for p in probes[2:]] == [0, 0]
    assert all(p["bytes"] > 0 and p["opens"] > 0 for p in probes[:2])
    md, _ = read_metadata_file(os.path.join(saved["path"], ".metadata"))
    stored = sum(info.length for idx, info in md.storage_data.items()
                 if isinstance(md.state_dict_metadata[idx.fqn], TensorStorageMetadata))
    assert sum(p["tensor_bytes"] for p in probes) == stored, "every stored tensor byte read exactly once"


# ---------------------------------------------------------------------------------------------------------
# Exact resume: fresh processes load step 5 and run 5 more steps: bitwise the uninterrupted run.
# ---------------------------------------------------------------------------------------------------------
def _resume(rank: int, world: int, run_dir: str) -> dict:
    model, opt = build(hsdp.init_mesh(2), seed=7)  # other weights: everything must come from the checkpoint
    seed_rank(50 + rank)  # other RNG states too
    extra = hsdp.load_checkpoint(run_dir, model, opt)
    hsdp.restore_rng_state(extra["rng"])
    losses = [train_step(model, opt) for _ in range(extra["pos"], 10)]
    return {"losses": losses, "final": model_state(model), "final_optim": optim_state(opt.state_dict())}


def test_exact_resume_is_bitwise(saved: dict, world4: list[dict]) -> None:
    resumed = [r["resume"] for r in world4]  # a fresh spawn: new processes, loaded before anything else
    for rank, (straight, r) in enumerate(zip(saved["ranks"], resumed)):
        assert r["losses"] == straight["losses"][5:], f"rank {rank}"
        assert same(r["final"], straight["final"]), f"rank {rank}: parameters differ"
        assert same(r["final_optim"], straight["final_optim"]), f"rank {rank}: optimizer state differs"


# ---------------------------------------------------------------------------------------------------------
# Resharding and FSDP2 interop.
# ---------------------------------------------------------------------------------------------------------
def _fsdp2(shape: tuple[int, ...]) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    names = ("replicate", "shard") if len(shape) == 2 else ("shard",)
    dm = init_device_mesh("cpu", shape, mesh_dim_names=names)
    torch.manual_seed(5)
    net = CkptNet()
    for block in net.blocks:
        fully_shard(block, mesh=dm)
    fully_shard(net, mesh=dm)
    return net, torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=WD)


def _fsdp2_both_ways(rank: int, world: int, step_dir: str, ref: dict, fsdp_dir: str, shape: tuple[int, ...],
                     hsdp_degree: int, sliced: bool = False) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    net, opt = _fsdp2(shape)
    msd, osd = get_state_dict(net, opt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=step_dir)  # the FSDP2 recipe, unchanged
    set_state_dict(net, opt, model_state_dict=msd, optim_state_dict=osd)
    msd, osd = get_state_dict(net, opt)
    out = {"fsdp_loaded_model": same(full(msd), ref["model"]),
           "fsdp_loaded_optim": same(optim_state(osd)["state"], ref["optim"]["state"])}
    out["fsdp_eval_loss"] = eval_step(net, opt, rank, world)
    msd, osd = get_state_dict(net, opt)
    out["fsdp_after_eval"] = full(msd)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=fsdp_dir)
    model, hopt = build(hsdp.init_mesh(hsdp_degree), seed=9, sliced=sliced)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hsdp.load_checkpoint(fsdp_dir, model, hopt)
    out["hsdp_from_fsdp_model"] = same(model_state(model), full(msd))
    out["hsdp_from_fsdp_optim"] = same(optim_state(hopt.state_dict())["state"], optim_state(osd)["state"])
    out["warned_no_manifest"] = rank != 0 or any("no hsdp manifest" in str(w.message) for w in caught)
    return out


def _reshard_load(rank: int, world: int, degree: int, run_dir: str, ref: dict, sliced: bool = False) -> dict:
    model, opt = build(hsdp.init_mesh(degree), seed=3, sliced=sliced)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        extra = hsdp.load_checkpoint(run_dir, model, opt)
    out = {"model": same(model_state(model), ref["model"]), "optim": same(optim_state(opt.state_dict()), ref["optim"]),
           "extra_step": extra["step"], "warnings": [str(w.message) for w in caught]}
    out["eval_loss"] = eval_step(model, opt, rank, world)
    out["after_eval"] = model_state(model)
    return out


def _world4(rank: int, world: int, run_dir: str, step_dir: str, ref: dict, fsdp_dir: str, work: str) -> dict:
    """Fresh processes: the exact resume on 2x2 first, then the 1x4 and 4x1 reshards and FSDP2 on 2-D, then
    the replica-sharded optimizer's round trips."""
    out = {"resume": _resume(rank, world, run_dir)}
    out |= {f"{4 // d}x{d}": _reshard_load(rank, world, d, run_dir, ref) for d in (4, 1)}
    out["fsdp2_2d"] = _fsdp2_both_ways(rank, world, step_dir, ref, fsdp_dir, (2, 2), 2)
    out["sliced"] = _sliced(rank, world, run_dir, ref, work)
    return out


def _sliced(rank: int, world: int, run_dir: str, ref: dict, work: str) -> dict:
    """``shard_optimizer_across_replicas``: the 2x2 checkpoint saved without it loads into it on 2x2 and 4x1;
    saved with it, resume is bitwise, and it loads without it (1x4) and into FSDP2, and back."""
    out = {f"{4 // d}x{d}": _reshard_load(rank, world, d, run_dir, ref, sliced=True) for d in (2, 1)}
    mesh = hsdp.init_mesh(2)
    model, opt = build(mesh, seed=1, sliced=True)
    hsdp.restore_rng_state(hsdp.load_checkpoint(run_dir, model, opt)["rng"])
    for _ in range(2):
        train_step(model, opt)
    own = os.path.join(work, "sliced")
    path = hsdp.save_checkpoint(own, model, opt, extra={"rng": hsdp.capture_rng_state()}, step=7)
    saved = {"model": model_state(model), "optim": optim_state(opt.state_dict())}
    straight = [train_step(model, opt) for _ in range(2)]
    final = {"model": model_state(model), "optim": optim_state(opt.state_dict())}
    fresh, fresh_opt = build(mesh, seed=8, sliced=True)
    seed_rank(60 + rank)
    hsdp.restore_rng_state(hsdp.load_checkpoint(own, fresh, fresh_opt)["rng"])
    resumed = [train_step(fresh, fresh_opt) for _ in range(2)]
    out["bitwise resume"] = resumed == straight and same(
        {"model": model_state(fresh), "optim": optim_state(fresh_opt.state_dict())}, final)
    plain, plain_opt = build(hsdp.init_mesh(4), seed=9)
    hsdp.load_checkpoint(own, plain, plain_opt)
    out["into 1x4 without"] = same(model_state(plain), saved["model"]) and same(
        optim_state(plain_opt.state_dict()), saved["optim"])
    out["fsdp2"] = _fsdp2_both_ways(rank, world, path, saved, os.path.join(work, "fsdp2"), (2, 2), 2, sliced=True)
    return out


def _reshard_world2(rank: int, world: int, run_dir: str, step_dir: str, ref: dict, fsdp_dir: str) -> dict:
    out = {"1x2": _reshard_load(rank, world, 2, run_dir, ref)}
    out["fsdp2_1d"] = _fsdp2_both_ways(rank, world, step_dir, ref, fsdp_dir, (2,), 2)
    # An FSDP2 checkpoint (no manifest) into an optimizer of another kind: caught by its hyper-parameters.
    model, _ = build(hsdp.init_mesh(2), seed=4)
    sgd = hsdp.ShardedOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    before = local_snapshot(model, sgd)
    try:
        hsdp.load_checkpoint(fsdp_dir, model, sgd)
        out["sgd"] = "loaded"
    except ValueError as e:
        out["sgd"] = str(e)
    out["sgd_unchanged"] = same(local_snapshot(model, sgd), before)
    return out


def _single(rank: int, world: int, run_dir: str, ref: dict) -> dict:
    return {"1x1": _reshard_load(rank, world, 1, run_dir, ref)}


@pytest.fixture(scope="module")
def world4(saved: dict, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    fsdp_dir = str(tmp_path_factory.mktemp("fsdp2d"))
    work = str(tmp_path_factory.mktemp("sliced"))
    return run_distributed(_world4, 4, saved["run_dir"], saved["path"], saved["ref"], fsdp_dir, work)


def test_reshard_and_fsdp2_interop(saved: dict, world4: list[dict], tmp_path) -> None:
    ref, run_dir, step_dir = saved["ref"], saved["run_dir"], saved["path"]
    targets: dict[str, list[dict]] = {}
    four = [{k: v for k, v in r.items() if k not in ("resume", "sliced")} for r in world4]
    two = run_distributed(_reshard_world2, 2, run_dir, step_dir, ref, str(tmp_path / "fsdp1d"))
    one = run_distributed(_single, 1, run_dir, ref)
    for results in (four, two, one):
        for name in results[0]:
            targets[name] = [r[name] for r in results]
    reference = saved["ranks"][0]["probe"]  # the same step on the original 2x2 mesh
    for name in ("1x4", "4x1", "1x2", "1x1"):
        for rank, r in enumerate(targets[name]):
            assert r["model"] and r["optim"], f"{name} rank {rank}: loaded state differs"
            assert r["extra_step"] == 5
            assert close(r["after_eval"], reference["after_eval"]), f"{name}: training does not continue alike"
    assert any("rank 0's extra" in w for w in targets["1x2"][0]["warnings"]), targets["1x2"][0]["warnings"]
    for name in ("fsdp2_2d", "fsdp2_1d"):
        for rank, r in enumerate(targets[name]):
            flags = {k: v for k, v in r.items() if isinstance(v, bool)}
            assert all(flags.values()), (name, rank, flags)
            assert close(r["fsdp_after_eval"], reference["after_eval"]), f"{name}: FSDP2 continues differently"
    assert all("another kind" in r for r in targets["sgd"]), targets["sgd"]
    assert all(targets["sgd_unchanged"])


def test_replica_sharded_optimizer_round_trips(saved: dict, world4: list[dict]) -> None:
    reference = saved["ranks"][0]["probe"]  # the same step on the original 2x2 mesh, without the option
    for rank, r in enumerate(world4):
        sliced = r["sliced"]
        for name in ("2x2", "4x1"):
            assert sliced[name]["model"] and sliced[name]["optim"], f"{name} rank {rank}: loaded state differs"
            assert close(sliced[name]["after_eval"], reference["after_eval"]), f"{name}: training continues differently"
        assert sliced["bitwise resume"], f"rank {rank}"
        assert sliced["into 1x4 without"], f"rank {rank}"
        flags = {k: v for k, v in sliced["fsdp2"].items() if isinstance(v, bool)}
        assert all(flags.values()), (rank, flags)


# ---------------------------------------------------------------------------------------------------------
# Export: consolidated safetensors (tied weights under every name), via Python and the CLI.
# ---------------------------------------------------------------------------------------------------------
def test_export_safetensors_and_cli(saved: dict, tmp_path, capsys: pytest.CaptureFixture) -> None:
    from safetensors.torch import load_file, load_model

    ref = saved["ref"]["model"]
    out = str(tmp_path / "model.safetensors")
    assert cli_main(["export", saved["run_dir"], "--to", out]) == 0
    assert "head.weight = embed.weight" in capsys.readouterr().out
    stored = load_file(out)
    assert set(stored) == set(ref) and all(torch.equal(stored[k], ref[k]) for k in stored)  # tied: a copy
    plain = CkptNet()
    plain.load_state_dict(load_file(out))  # strict, plain: every name is in the file
    assert same({k: v.detach() for k, v in plain.state_dict().items()}, ref)
    assert plain.head.weight is plain.embed.weight
    shared = load_safetensors(out)  # the aliases share one tensor, as in the model
    assert shared["head.weight"] is shared["embed.weight"]
    CkptNet().load_state_dict(shared)
    other = CkptNet()
    assert load_model(other, out, strict=False) == (set(), ["head.weight"])  # safetensors' loader: the copy
    x, _ = global_batch(3, 1)
    plain.eval()
    other.eval()
    assert torch.equal(plain(x), other(x))
    out2 = str(tmp_path / "m2.safetensors")
    assert hsdp.export_safetensors(saved["path"], out2) == {"head.weight": "embed.weight"}
    assert cli_main(["export", str(tmp_path / "nope"), "--to", out2]) == 2
    assert "does not exist" in capsys.readouterr().err
