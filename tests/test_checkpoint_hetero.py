"""Checkpoints on a heterogeneous mesh (``init_mesh([2, 1])``: replica 0 = ranks 0, 1, replica 1 = rank 2).

Three spawns: [2, 1] trains 2 steps, saves, trains 2 more (and checks full_state_dict, a direct dcp.save);
2x2 loads that checkpoint, FSDP2 (2-D) too, each saves one of its own; a fresh [2, 1] resumes bitwise and
loads the 2x2 and FSDP2 checkpoints. The test process loads the [2, 1] checkpoint in one plain process and
exports it. Every comparison is bitwise (``torch.equal``) against the saving run's full tensors.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from checkpoint_helpers import LR, WD, CkptNet, eval_step, full, model_state, optim_state, same, seed_rank, train_step
from harness import run_distributed
from torch import nn
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import hsdp
from hsdp.apps.cli import main as cli_main
from hsdp.checkpoint import ReplicaSavePlanner, restore
from hsdp.checkpoint.dcp_io import read_metadata_file
from hsdp.checkpoint.manifest import read_manifest
from hsdp.checkpoint.names import save_state
from hsdp.checkpoint.replica_planner import one_layout_per_key

DEGREES = [2, 1]
TEMP = "temp"  # HeteroNet's 0-d parameter: FSDP2 cannot shard it (left out of fully_shard)


class HeteroNet(CkptNet):
    """CkptNet (tied weights, odd row counts, a frozen layer, a buffer, dropout) with a 0-d parameter, a
    ``Replicate`` DTensor that every replica holds whole."""

    def __init__(self) -> None:
        super().__init__()
        self.temp = nn.Parameter(torch.tensor(0.7))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) * self.temp


def _build(mesh: hsdp.HSDPMesh, seed: int) -> tuple[hsdp.ShardedModel, hsdp.ShardedOptimizer]:
    torch.manual_seed(seed)
    model = hsdp.ShardedModel(HeteroNet(), mesh=mesh)
    return model, hsdp.ShardedOptimizer(model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD))


def _state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": model_state(model), "optim": optim_state(opt.state_dict())}


def _dcp_save(model: hsdp.ShardedModel, opt: hsdp.ShardedOptimizer, path: str, planner: Any) -> str | None:
    """A user's direct ``dcp.save`` of hsdp's state dicts (FSDP2's layout); the error text if DCP refuses it."""
    try:
        dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=path, planner=planner)
    except dcp.api.CheckpointException as e:  # a BaseException: DCP raises it on every rank
        return str(e)
    return None


# ---------------------------------------------------------------------------------------------------------
# Spawn 1, [2, 1]: 2 steps, save, 2 more steps; full_state_dict; direct dcp.save with and without the planner.
# ---------------------------------------------------------------------------------------------------------
def _save_on_hetero(rank: int, world: int, work: str) -> dict:
    mesh = hsdp.init_mesh(DEGREES)
    model, opt = _build(mesh, 0)
    seed_rank(rank)
    losses = [train_step(model, opt) for _ in range(2)]
    path = hsdp.save_checkpoint(os.path.join(work, "hetero"), model, opt,
                                extra={"rank": rank, "rng": hsdp.capture_rng_state()}, step=2)
    saved = _state(model, opt)
    consolidated = hsdp.full_state_dict(model)
    losses += [train_step(model, opt) for _ in range(2)]
    out = {"path": path, "losses": losses, "saved": saved, "final": _state(model, opt),
           "full_state_dict": consolidated, "mesh": (mesh.heterogeneous, mesh.replicate_rank)}
    out["default_planner"] = _dcp_save(model, opt, os.path.join(work, "direct_default"), None)
    out["replica_planner"] = _dcp_save(model, opt, os.path.join(work, "direct"), ReplicaSavePlanner(mesh))
    return out


# ---------------------------------------------------------------------------------------------------------
# Spawn 2, 2x2 and FSDP2 (2-D): load the [2, 1] checkpoint, save their own.
# ---------------------------------------------------------------------------------------------------------
def _fsdp2() -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dm = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(5)
    net = HeteroNet()
    for block in net.blocks:
        fully_shard(block, mesh=dm)
    fully_shard(net, mesh=dm, ignored_params={net.temp})
    return net, torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=WD)


def _fsdp2_round_trip(path: str, saved: dict, out_dir: str) -> dict:
    """The FSDP2 recipe loads the [2, 1] checkpoint, then saves it in FSDP2's own layout."""
    net, opt = _fsdp2()
    msd, osd = get_state_dict(net, opt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=path)
    set_state_dict(net, opt, model_state_dict=msd, optim_state_dict=osd)
    msd, osd = get_state_dict(net, opt)
    out = {"fsdp2 model": same(full(msd), saved["model"]),
           "fsdp2 optim": same(optim_state(osd)["state"], saved["optim"]["state"])}
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=out_dir)
    return out


def _on_grid(rank: int, world: int, path: str, saved: dict, work: str) -> dict:
    mesh = hsdp.init_mesh(2)
    model, opt = _build(mesh, 3)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*rank 0's extra")  # 3 ranks saved, 4 load
        hsdp.load_checkpoint(path, model, opt)
    out = {"2x2 loads": same(_state(model, opt), saved)}
    eval_step(model, opt, rank, world)  # move away from the [2, 1] state: the next checkpoint is 2x2's own
    grid = hsdp.save_checkpoint(os.path.join(work, "grid"), model, opt, step=3)
    out["grid"] = {"path": grid, "saved": _state(model, opt)}
    # The same state with DCP's default planner: the layout must equal hsdp's (the planner changes nothing here).
    dcp.save(save_state(model, opt), checkpoint_id=os.path.join(work, "grid_default"))
    out |= _fsdp2_round_trip(path, saved, os.path.join(work, "fsdp2"))
    return out


# ---------------------------------------------------------------------------------------------------------
# Spawn 3, a fresh [2, 1]: resume bitwise; load the 2x2 and the FSDP2 checkpoints.
# ---------------------------------------------------------------------------------------------------------
def _on_fresh_hetero(rank: int, world: int, path: str, grid: str, fsdp2: str) -> dict:
    mesh = hsdp.init_mesh(DEGREES)
    model, opt = _build(mesh, 7)  # other weights and RNG states: everything must come from the checkpoint
    seed_rank(50 + rank)
    result = restore(path, model, opt)
    hsdp.restore_rng_state(result.extra["rng"])
    losses = [train_step(model, opt) for _ in range(2)]
    out = {"resumed": {"losses": losses, "final": _state(model, opt)}, "tensor_bytes": result.tensor_bytes}
    for name, source, seed in (("grid", grid, 8), ("fsdp2", fsdp2, 9)):
        model, opt = _build(mesh, seed)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*no hsdp manifest")  # FSDP2 writes none
            hsdp.load_checkpoint(source, model, opt)
        out[name] = _state(model, opt)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    work = str(tmp_path_factory.mktemp("hetero"))
    first = run_distributed(_save_on_hetero, 3, work)
    path, saved = first[0]["path"], first[0]["saved"]
    grid = run_distributed(_on_grid, 4, path, saved, work)
    fresh = run_distributed(_on_fresh_hetero, 3, path, grid[0]["grid"]["path"], os.path.join(work, "fsdp2"))
    return {"work": work, "first": first, "grid": grid, "fresh": fresh, "path": path, "saved": saved}


def test_hetero_checkpoint_layout_is_replica_0s(runs: dict) -> None:
    """Original names, full shapes, chunks that tile each tensor once: sharded tensors in replica 0's two
    chunks, none of them in rank 2's file."""
    first, saved = runs["first"], runs["saved"]
    assert [r["mesh"] for r in first] == [(True, 0), (True, 0), (True, 1)]
    md, _ = read_metadata_file(os.path.join(runs["path"], ".metadata"))
    for name, tensor in saved["model"].items():
        assert tuple(md.state_dict_metadata[f"model.{name}"].size) == tuple(tensor.shape), name
    assert "optim.state.blocks.0.up.weight.exp_avg" in md.state_dict_metadata
    for key, meta in md.state_dict_metadata.items():
        if isinstance(meta, TensorStorageMetadata):
            covered = sum(torch.Size(c.sizes).numel() for c in meta.chunks)
            assert covered == meta.size.numel(), f"{key}: chunks cover {covered} of {meta.size.numel()} elements"
    # Sharded: every tensor of one dim or more but the plain buffer; all in replica 0's two chunks.
    sharded = {k for k, m in md.state_dict_metadata.items()
               if isinstance(m, TensorStorageMetadata) and len(m.size) and k != "model.scale"}
    assert len(sharded) > 50
    for key in sharded:
        chunks = md.state_dict_metadata[key].chunks
        assert len(chunks) == 2, f"{key}: {chunks} is not replica 0's layout"
    on_rank2 = {idx.fqn for idx, info in md.storage_data.items() if info.relative_path.startswith("__2_")}
    assert not on_rank2 & sharded, sorted(on_rank2 & sharded)
    manifest, _ = read_manifest(runs["path"])
    assert manifest.sharding_degrees == (2, 1) and manifest.world_size == 3


def test_hetero_checkpoint_loads_on_2x2_and_into_fsdp2(runs: dict) -> None:
    for rank, r in enumerate(runs["grid"]):
        assert r["2x2 loads"], f"rank {rank}: the 2x2 load differs from the [2, 1] state"
        assert r["fsdp2 model"] and r["fsdp2 optim"], f"rank {rank}: FSDP2's load differs"


def test_grid_save_layout_equals_dcp_default(runs: dict) -> None:
    """On a grid the planner is a no-op: the same files, offsets and metadata as DefaultSavePlanner."""
    ours, _ = read_metadata_file(os.path.join(runs["grid"][0]["grid"]["path"], ".metadata"))
    theirs, _ = read_metadata_file(os.path.join(runs["work"], "grid_default", ".metadata"))
    assert ours.storage_data == theirs.storage_data
    assert ours.state_dict_metadata == theirs.state_dict_metadata
    assert len({info.relative_path for info in ours.storage_data.values()}) == 4  # spread over every writer


def test_hetero_resume_is_bitwise(runs: dict) -> None:
    for rank, (straight, fresh) in enumerate(zip(runs["first"], runs["fresh"], strict=True)):
        resumed = fresh["resumed"]
        assert resumed["losses"] == straight["losses"][2:], f"rank {rank}"
        assert same(resumed["final"], straight["final"]), f"rank {rank}: parameters or optimizer state differ"
    # Every replica reads its own shards (replica 1's chunks are not replica 0's): none reads nothing.
    assert all(r["tensor_bytes"] > 0 for r in runs["fresh"])


def test_grid_and_fsdp2_checkpoints_load_on_hetero(runs: dict) -> None:
    grid_saved = runs["grid"][0]["grid"]["saved"]
    for rank, r in enumerate(runs["fresh"]):
        assert same(r["grid"], grid_saved), f"rank {rank}: the 2x2 checkpoint loads differently"
        assert same(r["fsdp2"], runs["saved"]), f"rank {rank}: the FSDP2 checkpoint loads differently"


def _plain_load(path: str) -> dict[str, Any]:
    """The checkpoint in one process, no process group: a plain module and optimizer (torch's recipe)."""
    net = HeteroNet()
    opt = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=WD)
    msd, osd = get_state_dict(net, opt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=path, no_dist=True)
    set_state_dict(net, opt, model_state_dict=msd, optim_state_dict=osd)
    msd, osd = get_state_dict(net, opt)
    return {"model": full(msd), "optim": optim_state(osd)}


def test_hetero_checkpoint_in_one_process_full_state_dict_and_export(runs: dict, tmp_path,
                                                                     capsys: pytest.CaptureFixture) -> None:
    from safetensors.torch import load_file

    saved, first = runs["saved"], runs["first"]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        plain = _plain_load(runs["path"])
    assert same(plain["model"], saved["model"])
    assert same(plain["optim"]["state"], saved["optim"]["state"])
    # hsdp.full_state_dict: rank 0 gets every full tensor (tied aliases, buffers), the others nothing.
    assert same(first[0]["full_state_dict"], saved["model"])
    assert first[1]["full_state_dict"] == {} and first[2]["full_state_dict"] == {}
    out = str(tmp_path / "model.safetensors")
    assert cli_main(["export", runs["path"], "--to", out]) == 0
    capsys.readouterr()
    assert same(load_file(out), saved["model"])


def test_direct_dcp_save_needs_the_replica_planner(runs: dict) -> None:
    """dcp.save with DCP's default planner refuses a heterogeneous mesh on every rank (overlapping chunks;
    nothing hsdp can intercept); with ``planner=ReplicaSavePlanner(mesh)`` it writes a loadable checkpoint."""
    for rank, r in enumerate(runs["first"]):
        assert r["default_planner"] is not None and "overlapping chunks" in r["default_planner"], rank
        assert r["replica_planner"] is None, f"rank {rank}: {r['replica_planner']}"
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        plain = _plain_load(os.path.join(runs["work"], "direct"))
    final = runs["first"][0]["final"]
    assert same(plain["model"], final["model"]) and same(plain["optim"]["state"], final["optim"]["state"])


# ---------------------------------------------------------------------------------------------------------
# The planner's rule on hand-made plans (no spawn): what is kept, what is dropped.
# ---------------------------------------------------------------------------------------------------------
def _item(fqn: str, offset: int, rows: int, total: int) -> WriteItem:
    chunk = ChunkStorageMetadata(torch.Size([offset]), torch.Size([rows]))
    data = TensorWriteData(chunk, TensorProperties(dtype=torch.float32), torch.Size([total]))
    return WriteItem(MetadataIndex(fqn, torch.Size([offset])), WriteItemType.SHARD, tensor_data=data)


def _blob(fqn: str) -> WriteItem:
    return WriteItem(MetadataIndex(fqn), WriteItemType.BYTE_IO)


def test_one_layout_per_key_rule() -> None:
    # [2, 1]: "w" sharded (replica 1's whole chunk overlaps), "s" whole everywhere, "only1" on replica 1 alone.
    plans = [SavePlan([_item("w", 0, 9, 17), _item("s", 0, 4, 4), _blob("lr")]),
             SavePlan([_item("w", 9, 8, 17), _item("s", 0, 4, 4), _blob("lr")]),
             SavePlan([_item("w", 0, 17, 17), _item("s", 0, 4, 4), _item("only1", 0, 2, 2), _blob("lr")])]
    kept = [[(i.index.fqn, tuple(i.index.offset or ())) for i in p.items] for p in one_layout_per_key(plans, (0, 0, 1))]
    assert kept == [[("w", (0,)), ("s", (0,)), ("lr", ())], [("w", (9,)), ("s", (0,)), ("lr", ())],
                    [("s", (0,)), ("only1", (0,)), ("lr", ())]]
    # A grid (2x2): replicas' chunks coincide, nothing is dropped (DCP's dedup then picks one writer each).
    grid = [SavePlan([_item("w", 0, 9, 17)]), SavePlan([_item("w", 9, 8, 17)])] * 2
    assert one_layout_per_key(grid, (0, 0, 1, 1)) == grid
    # Optimizer state sharded across replicas (2x2): each replica holds a slice, no replica tiles "w" alone.
    sliced = [SavePlan([_item("w", 0, 5, 17)]), SavePlan([_item("w", 5, 4, 17)]),
              SavePlan([_item("w", 9, 4, 17)]), SavePlan([_item("w", 13, 4, 17)])]
    assert one_layout_per_key(sliced, (0, 0, 1, 1)) == sliced
    # [4, 1] on 3 rows: replica 0's empty chunk stays (as DCP would keep it); replica 1's whole one goes.
    rows3 = [SavePlan([_item("g", r, 1, 3)]) for r in range(3)] + [SavePlan([_item("g", 3, 0, 3)]),
                                                                   SavePlan([_item("g", 0, 3, 3)])]
    kept = one_layout_per_key(rows3, (0, 0, 0, 0, 1))
    assert [len(p.items) for p in kept] == [1, 1, 1, 1, 0]
