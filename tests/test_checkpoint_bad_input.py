"""Bad checkpoint input: a clear error naming the problem on every rank, the live model and optimizer
unchanged. One 2x2 spawn sweeps every case."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
from collections.abc import Callable

import torch
import torch.distributed as dist
from checkpoint_helpers import build, local_snapshot, same, seed_rank, train_step
from harness import run_distributed
from torch import nn

import hsdp


class _Payload:
    """Unpickling this runs ``touch <marker>``: what a hostile ``.metadata`` could do to stock DCP."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {self.marker}",))


def _copy(src: str, dst: str) -> str:
    shutil.copytree(src, dst)
    return dst


def _forge(ckpt: str, name: str, data: bytes) -> None:
    """Replace a file and make the manifest agree with it (a consistent but hostile checkpoint)."""
    with open(os.path.join(ckpt, name), "wb") as f:
        f.write(data)
    path = os.path.join(ckpt, "manifest.json")
    with open(path) as f:
        manifest = json.load(f)
    manifest["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    with open(path, "w") as f:
        json.dump(manifest, f)


def _make_bad_checkpoints(good: str, work: str) -> None:
    """Rank 0 only: broken copies of the good checkpoint, one defect each."""
    path = _copy(good, os.path.join(work, "truncated"))
    data_file = os.path.join(path, "__1_0.distcp")
    os.truncate(data_file, os.path.getsize(data_file) // 2)
    path = _copy(good, os.path.join(work, "flipped"))
    with open(os.path.join(path, "__1_0.distcp"), "r+b") as f:
        f.seek(os.path.getsize(f.name) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    os.remove(os.path.join(_copy(good, os.path.join(work, "missing_file")), "__0_0.distcp"))
    with open(os.path.join(_copy(good, os.path.join(work, "bad_manifest")), "manifest.json"), "w") as f:
        f.write('{"format": "hsdp-checkpoint", "version": 1, "files": {')
    _forge(_copy(good, os.path.join(work, "garbage_meta")), ".metadata", os.urandom(3000))
    marker = os.path.join(work, "pwned")
    _forge(_copy(good, os.path.join(work, "evil_meta")), ".metadata", pickle.dumps(_Payload(marker)))
    _copy(good, os.path.join(work, "step_000009.tmp-0123abcd"))
    os.makedirs(os.path.join(work, "empty"))
    broken_run = os.path.join(work, "broken_run")
    os.makedirs(broken_run)
    shutil.copytree(os.path.join(work, "truncated"), os.path.join(broken_run, "step_000001"))
    with open(os.path.join(broken_run, "latest"), "w") as f:
        f.write("step_000001\n")
    with open(os.path.join(work, "afile"), "w") as f:
        f.write("not a directory")


def _outcome(fn: Callable[[], object], fix: str, models: list[tuple[nn.Module, object]]) -> str:
    before = [local_snapshot(m, o) for m, o in models]
    try:
        fn()
        outcome = "no error"
    except ValueError as e:
        outcome = "ok" if fix in str(e) else f"message lacks {fix!r}: {e}"
    if not all(same(local_snapshot(m, o), b) for (m, o), b in zip(models, before)):
        outcome += " (and the live state changed)"
    return outcome


def _cases(work: str, run: str, model_only: str, mesh: hsdp.HSDPMesh) -> dict[str, tuple[Callable, str, list]]:
    model, opt = build(mesh, seed=2)
    train_step(model, opt)  # live state differs from the checkpoint: any partial load would show
    fewer, fewer_opt = build(mesh, n_blocks=2)
    more, more_opt = build(mesh, n_blocks=4)
    wider, wider_opt = build(mesh, unused_rows=4)
    plain_model, _ = build(mesh, seed=3)
    sgd_opt = hsdp.ShardedOptimizer(plain_model, torch.optim.SGD(plain_model.parameters(), lr=0.1, momentum=0.9))
    groups_model, _ = build(mesh, seed=4)
    params = list(groups_model.parameters())
    groups_opt = hsdp.ShardedOptimizer(groups_model, torch.optim.AdamW(
        [{"params": params[:4]}, {"params": params[4:], "weight_decay": 0.0}]))
    live = [(model, opt)]
    w = lambda name: os.path.join(work, name)  # noqa: E731
    load = hsdp.load_checkpoint
    return {
        "empty path": (lambda: load("", model, opt), "path is empty", live),
        "missing path": (lambda: load(w("nope"), model, opt), "does not exist", live),
        "path is a file": (lambda: load(w("afile"), model, opt), "is a file", live),
        "empty directory": (lambda: load(w("empty"), model, opt), "holds no checkpoint", live),
        "truncated file": (lambda: load(w("truncated"), model, opt), "truncated", live),
        "corrupted byte": (lambda: load(w("flipped"), model, opt), "does not match its manifest checksum", live),
        "missing data file": (
            lambda: load(w("missing_file"), model, opt, options=hsdp.CheckpointOptions(verify="size")),
            "__0_0.distcp is missing", live),
        "corrupted manifest": (lambda: load(w("bad_manifest"), model, opt), "corrupted manifest", live),
        "garbage .metadata": (lambda: load(w("garbage_meta"), model, opt), "unreadable DCP metadata", live),
        "code in .metadata": (lambda: load(w("evil_meta"), model, opt), "refusing to unpickle posix.system", live),
        "interrupted save": (lambda: load(w("step_000009.tmp-0123abcd"), model, opt), "temporary directory", live),
        "only broken checkpoints": (lambda: load(w("broken_run"), model, opt), "holds no valid checkpoint", live),
        "unexpected keys": (lambda: load(run, fewer, fewer_opt), "unexpected keys [blocks.2.", [(fewer, fewer_opt)]),
        "missing keys": (lambda: load(run, more, more_opt), "missing keys [blocks.3.", [(more, more_opt)]),
        "shape mismatch": (lambda: load(run, wider, wider_opt), "shape mismatch for unused.weight (3, 16)",
                           [(wider, wider_opt)]),
        "optimizer of another kind": (lambda: load(run, plain_model, sgd_opt),
                                      "AdamW state but this optimizer is torch.optim.sgd.SGD",
                                      [(plain_model, sgd_opt)]),
        "other parameter groups": (lambda: load(run, groups_model, groups_opt), "1 parameter groups, this optimizer 2",
                                   [(groups_model, groups_opt)]),
        "no optimizer state saved": (lambda: load(model_only, model, opt), "holds no optimizer state", live),
        "optimizer of another model": (lambda: load(run, model, sgd_opt), "belongs to another ShardedModel", live),
        "not a ShardedModel": (lambda: load(run, nn.Linear(2, 2)), "wrap the model with hsdp.ShardedModel", []),
        "extra not JSON": (lambda: hsdp.save_checkpoint(run, model, opt, extra={"t": torch.ones(2)}),
                           "JSON-serialisable", live),
        "save into a file": (lambda: hsdp.save_checkpoint(w("afile"), model, opt), "is a file", live),
        "save into a checkpoint": (lambda: hsdp.save_checkpoint(w("truncated"), model, opt),
                                   "pass its parent, the run directory", live),
    }


def _bad_inputs(rank: int, world: int, work: str) -> dict[str, str]:
    mesh = hsdp.init_mesh(2)
    model, opt = build(mesh)
    seed_rank(rank)
    train_step(model, opt)
    run = os.path.join(work, "run")
    good = hsdp.save_checkpoint(run, model, opt, extra={"step": 1})
    model_only = hsdp.save_checkpoint(os.path.join(work, "model_only"), model)
    if rank == 0:
        _make_bad_checkpoints(good, work)
    dist.barrier()
    listing = sorted(os.listdir(run))
    out = {name: _outcome(fn, fix, models) for name, (fn, fix, models) in _cases(work, run, model_only, mesh).items()}
    out["failed saves left nothing behind"] = "ok" if sorted(os.listdir(run)) == listing else str(os.listdir(run))
    out["payload did not run"] = "ok" if not os.path.exists(os.path.join(work, "pwned")) else "payload ran"
    return out


def test_bad_inputs_fail_cleanly_on_every_rank(tmp_path) -> None:
    results = run_distributed(_bad_inputs, 4, str(tmp_path))
    assert len(results[0]) >= 20
    for rank, r in enumerate(results):
        bad = {k: v for k, v in r.items() if v != "ok"}
        assert not bad, f"rank {rank}: {bad}"
