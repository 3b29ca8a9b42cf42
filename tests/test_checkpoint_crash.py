"""Crash safety: a rank SIGKILLed while writing, and interruptions at every later step of the commit,
leave the previous checkpoint loadable; broken checkpoints are skipped; retention keeps the last K."""

from __future__ import annotations

import os
import signal
import warnings
from collections.abc import Callable

import pytest
import torch
from checkpoint_helpers import build, model_state, optim_state, same, seed_rank, train_step
from harness import run_distributed

import hsdp
from hsdp.checkpoint import restore


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    return {"model": model_state(model), "optim": optim_state(opt.state_dict())}


def _die_on_third_write() -> None:
    """SIGKILL this process in the middle of DCP writing its file (after two items hit the disk)."""
    import torch.distributed.checkpoint.filesystem as fs

    original, count = fs._write_item, [0]

    def dying(*args: object, **kwargs: object) -> object:
        count[0] += 1
        if count[0] == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        return original(*args, **kwargs)

    fs._write_item = dying


def _crash_while_writing(rank: int, world: int, run: str, ref_path: str) -> None:
    model, opt = build(hsdp.init_mesh(2))
    seed_rank(rank)
    train_step(model, opt)
    hsdp.save_checkpoint(run, model, opt, extra={"step": 1}, step=1)
    state = _state(model, opt)  # a collective (full tensors): every rank
    if rank == 0:
        torch.save(state, ref_path)
    train_step(model, opt)
    if rank == 1:
        _die_on_third_write()
    hsdp.save_checkpoint(run, model, opt, extra={"step": 2}, step=2)


def _interrupted(fn: Callable[[], object], where: str) -> str:
    """Run a save that raises at ``where`` (where a kill would stop it); every rank must see the error."""
    import hsdp.checkpoint.save as save_mod

    original = getattr(save_mod, where)

    def crash(*args: object, **kwargs: object) -> None:
        raise OSError(f"simulated crash in {where}")

    setattr(save_mod, where, crash)
    try:
        fn()
        return "no error"
    except hsdp.CheckpointError as e:
        return "ok" if "simulated crash" in str(e) else str(e)
    finally:
        setattr(save_mod, where, original)


def _load(run: str, mesh: hsdp.HSDPMesh) -> tuple[int | None, dict, list[str]]:
    model, opt = build(mesh, seed=6)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = restore(run, model, opt)
    return result.step, _state(model, opt), [str(w.message) for w in caught]


def _after_crash(rank: int, world: int, run: str, ref_path: str) -> dict:
    mesh = hsdp.init_mesh(2)
    ref1 = torch.load(ref_path, weights_only=True)
    out: dict = {}
    step, state, _ = _load(run, mesh)
    out["after SIGKILL: previous checkpoint"] = step == 1 and same(state, ref1)
    model, opt = build(mesh, seed=6)
    hsdp.load_checkpoint(run, model, opt)
    seed_rank(rank)
    train_step(model, opt)
    save = lambda s: lambda: hsdp.save_checkpoint(run, model, opt, step=s)  # noqa: E731
    out["crash while hashing"] = _interrupted(save(2), "hash_file")
    out["crash before the rename"] = _interrupted(save(3), "commit_dir")
    out["after both: still step 1"] = _load(run, mesh)[0] == 1
    # Committed but `latest` not moved: loading follows `latest`, the new directory is complete.
    out["crash before latest moves"] = _interrupted(save(4), "write_latest")
    out["latest still step 1"] = _load(run, mesh)[0] == 1
    step4 = _state(model, opt)
    explicit = restore(os.path.join(run, "step_000004"), *build(mesh, seed=6))
    out["step 4 complete"] = explicit.step == 4
    train_step(model, opt)
    hsdp.save_checkpoint(run, model, opt, step=5, options=hsdp.CheckpointOptions(keep_last=3))
    out["leftovers pruned"] = sorted(os.listdir(run)) == ["latest", "step_000001", "step_000004", "step_000005"]
    if rank == 0:  # bit rot in the newest checkpoint: skipped with a warning, the next newest is used
        victim = os.path.join(run, "step_000005", "__1_0.distcp")
        with open(victim, "r+b") as f:
            f.seek(100)
            byte = f.read(1)
            f.seek(100)
            f.write(bytes([byte[0] ^ 1]))
    torch.distributed.barrier()
    step, state, caught = _load(run, mesh)
    out["corrupt latest: falls back to step 4"] = step == 4 and same(state, step4)
    out["warned"] = rank != 0 or any("ignoring invalid checkpoint" in w for w in caught)
    hsdp.save_checkpoint(run, model, opt, step=6, options=hsdp.CheckpointOptions(keep_last=2))
    out["keep_last=2"] = sorted(os.listdir(run)) == ["latest", "step_000005", "step_000006"]
    step6 = _state(model, opt)
    if rank == 0:  # a re-save of step 6 killed between its two renames: only the set-aside copy remains
        os.rename(os.path.join(run, "step_000006"), os.path.join(run, "step_000006.old-0123abcd"))
    torch.distributed.barrier()
    step, state, _ = _load(run, mesh)
    out["re-save crash: set-aside copy used"] = step == 6 and same(state, step6)
    return out


def test_sigkill_during_save_then_interruptions_at_every_commit_step(tmp_path) -> None:
    run, ref = str(tmp_path / "run"), str(tmp_path / "ref.pt")
    with pytest.raises(AssertionError, match="rank 1: no result"):
        run_distributed(_crash_while_writing, 2, run, ref, timeout=120)
    names = sorted(os.listdir(run))
    assert names[:2] == ["latest", "step_000001"] and len(names) == 3 and names[2].startswith("step_000002.tmp-")
    partial = os.listdir(os.path.join(run, names[2]))
    assert "manifest.json" not in partial and any(n.endswith(".distcp") for n in partial), partial
    with open(os.path.join(run, "latest")) as f:
        assert f.read().strip() == "step_000001"
    for rank, r in enumerate(run_distributed(_after_crash, 2, run, ref)):
        bad = {k: v for k, v in r.items() if v not in (True, "ok")}
        assert not bad, f"rank {rank}: {bad}"
