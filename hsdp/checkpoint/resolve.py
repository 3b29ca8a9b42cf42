"""Which checkpoint directory a path means: a step directory itself, or the newest valid one of a run.

``path`` may be
  * a run directory (what ``save_checkpoint`` was given): ``latest`` first, then every ``step_*`` by step,
    newest first; directories that fail the manifest checks are skipped with a warning;
  * an ``hsdp train`` run directory (``runs/train``), which keeps that run directory in ``checkpoints/``:
    the same as passing ``runs/train/checkpoints``, so every command takes the directory ``--resume`` and
    ``hsdp report`` take;
  * one checkpoint directory (``run/step_000010``): it must be valid, there is no fallback;
  * a DCP directory written by another tool (``.metadata`` but no hsdp manifest, e.g. FSDP2's
    ``dcp.save``): loaded with a warning, since nothing vouches that it is complete.

The checks here are cheap (``stat``, the manifest); checksums are verified afterwards by the loader, so
the candidates come back in order of preference and the first one whose checksums hold wins.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

from hsdp.checkpoint.dcp_io import METADATA
from hsdp.checkpoint.manifest import MANIFEST, InvalidCheckpoint, Manifest, check_sizes, read_manifest
from hsdp.checkpoint.rundir import OLD_MARK, is_temporary, list_steps, read_latest, set_aside_step

TRAIN_CHECKPOINTS = "checkpoints"  # the subdirectory of an `hsdp train` run that save_checkpoint writes into


@dataclass(frozen=True)
class Candidate:
    """A checkpoint directory that passed the cheap checks. ``manifest`` is ``None`` for foreign DCP."""

    path: str
    manifest: Manifest | None
    explicit: bool  # named directly: a failure is an error, not a reason to fall back


def candidates(path: str | os.PathLike) -> list[Candidate]:
    """Checkpoint directories for ``path``, most preferred first; ``ValueError`` naming the problem."""
    text = os.fspath(path) if path is not None else ""
    if not text:
        raise ValueError("checkpoint path is empty: pass the run directory given to save_checkpoint, "
                         "or one of its step_* directories")
    path = os.path.abspath(text)
    if not os.path.exists(path):
        raise ValueError(f"checkpoint path {path} does not exist: check the path (and that the file system "
                         f"holding it is mounted on this node)")
    if not os.path.isdir(path):
        raise ValueError(f"checkpoint path {path} is a file: pass the checkpoint directory (a .safetensors export "
                         f"loads with safetensors.torch.load_model)")
    if is_checkpoint_dir(path):
        return [_explicit(path)]
    return _from_run_dir(_checkpoint_root(path))


def is_checkpoint_dir(path: str) -> bool:
    return any(os.path.exists(os.path.join(path, n)) for n in (MANIFEST, METADATA))


def _checkpoint_root(path: str) -> str:
    """``path``, or its ``checkpoints`` subdirectory when ``path`` is an ``hsdp train`` run directory: one
    that holds no checkpoint (nor ``latest``) of its own."""
    inner = os.path.join(path, TRAIN_CHECKPOINTS)
    if os.path.isdir(inner) and read_latest(path) is None and not list_steps(path):
        return inner
    return path


def _explicit(path: str) -> Candidate:
    if is_temporary(os.path.basename(path)):
        raise ValueError(f"{path} is the temporary directory of an unfinished or interrupted save: load the run "
                         f"directory instead, which resolves to the newest complete checkpoint")
    if not os.path.exists(os.path.join(path, MANIFEST)):
        warnings.warn(f"{path} has no hsdp manifest (written by another tool?): loading it without verifying "
                      f"that it is complete", stacklevel=3)
        return Candidate(path, None, True)
    manifest, _ = read_manifest(path)
    check_sizes(path, manifest)
    return Candidate(path, manifest, True)


def _from_run_dir(run_dir: str) -> list[Candidate]:
    names = [name for _, name in reversed(list_steps(run_dir))]
    latest = read_latest(run_dir)
    # Last resort: a checkpoint set aside by a re-save of its step that crashed before the new one landed.
    aside = sorted((n for n in os.listdir(run_dir) if set_aside_step(n) is not None), key=set_aside_step)
    names += [n for n in reversed(aside) if n.partition(OLD_MARK)[0] not in names]
    if latest is not None:
        if latest in names:
            names.remove(latest)
            names.insert(0, latest)
        else:
            warnings.warn(f"{run_dir}: 'latest' names {latest}, which does not exist; using the newest valid "
                          f"checkpoint", stacklevel=3)
    found, problems = [], []
    for name in names:
        path = os.path.join(run_dir, name)
        try:
            manifest, _ = read_manifest(path)
            check_sizes(path, manifest)
        except InvalidCheckpoint as e:
            problems.append(str(e))
            warnings.warn(f"ignoring invalid checkpoint: {e}", stacklevel=3)
            continue
        found.append(Candidate(path, manifest, False))
    if found:
        return found
    if problems:
        raise ValueError(f"{run_dir} holds no valid checkpoint: " + "; ".join(problems))
    raise ValueError(f"{run_dir} holds no checkpoint (no step_* directory and no DCP .metadata): pass the "
                     f"directory given to save_checkpoint, or an hsdp train run directory")


def to_json(c: Candidate) -> dict:
    return {"path": c.path, "manifest": None if c.manifest is None else c.manifest.to_json().decode(),
            "explicit": c.explicit}


def from_json(d: dict) -> Candidate:
    m = d["manifest"]
    return Candidate(d["path"], None if m is None else Manifest.from_json(m.encode(), d["path"]), d["explicit"])
