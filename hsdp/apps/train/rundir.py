"""The run directory of ``hsdp train`` and the decision whether a run may start there.

Layout::

    runs/train/
      config.toml        the resolved configuration (``--resume`` without a config file reads it back)
      metrics.jsonl      one record per step (see hsdp.apps.train.metrics); metrics.csv the same as a table
      tb/                TensorBoard events (when tensorboard is installed)
      checkpoints/       hsdp.save_checkpoint's run directory: step_000100/, ..., latest
      checkpoints.lease  the job holding the directory (see hsdp.checkpoint.lease): taken before anything
                         is written, given back at the end; a second job is refused while it is live
      profile/           rank<r>.json chrome traces (--profile)
      summary.json       the final summary; sample.txt the text sampled at the end
      report/            PNG plots written by `hsdp report`

On a cluster it must be on storage every node sees (checkpoints are written by all ranks).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from hsdp.apps.train.config import RunConfig
from hsdp.apps.train.config_io import CONFIG_NAME, to_toml
from hsdp.apps.train.metrics import JSONL_NAME
from hsdp.apps.train.ranks import RankChannel
from hsdp.checkpoint.lease import hold_lease, lease_problem, release_lease
from hsdp.checkpoint.resolve import TRAIN_CHECKPOINTS
from hsdp.checkpoint.rundir import list_steps
from hsdp.engine.agreement import on_rank0
from hsdp.engine.faults.watchdog import Watchdog


@dataclass(frozen=True)
class RunDir:
    """Paths inside one run directory."""

    path: str

    @property
    def checkpoints(self) -> str:
        return os.path.join(self.path, TRAIN_CHECKPOINTS)

    @property
    def profile(self) -> str:
        return os.path.join(self.path, "profile")

    @property
    def summary(self) -> str:
        return os.path.join(self.path, "summary.json")

    @property
    def sample(self) -> str:
        return os.path.join(self.path, "sample.txt")

    @property
    def report(self) -> str:
        return os.path.join(self.path, "report")

    def checkpoint_steps(self) -> list[int]:
        """Steps of the committed checkpoints, oldest first."""
        if not os.path.isdir(self.checkpoints):
            return []
        return [step for step, _ in list_steps(self.checkpoints)]


def _held(run: RunDir) -> list[str]:
    """The files that make ``run`` hold a run (a fresh run there would overwrite them)."""
    return [name for name in (JSONL_NAME, TRAIN_CHECKPOINTS) if os.path.exists(os.path.join(run.path, name))]


def start_problem(cfg: RunConfig) -> str | None:
    """Why a run with ``cfg`` may not start in its directory (``None``: it may). Any run refuses a directory
    another live job holds; a fresh run also refuses one that already holds a run, so nothing is
    overwritten by accident."""
    run = RunDir(cfg.train.out_dir)
    busy = lease_problem(run.checkpoints)
    if busy is not None:
        return busy
    held = [] if cfg.train.resume else _held(run)
    if not held:
        return None
    return (f"train.out_dir = {run.path!r} already holds a run ({', '.join(held)}): pass --resume to continue "
            f"it, --out NEW_DIR to start another, or delete the directory")


def resume_problem(cfg: RunConfig) -> str | None:
    """Why ``hsdp train --resume`` may not continue ``train.out_dir`` (``None``: it may, or it does not
    resume): the directory holds no checkpoint, most often a mistyped ``--out``. The message names the run
    directories beside it that hold checkpoints, and the fix.

    Only ``hsdp train`` starting the ranks itself asks this (before spawning any). Under torchrun a job
    script passes ``--resume`` on its first submission too, where no checkpoint means a fresh start
    (:func:`hsdp.apps.train.resume.resume`), so the ranks never refuse it."""
    run = RunDir(cfg.train.out_dir)
    if not cfg.train.resume or run.checkpoint_steps():
        return None
    state = "holds no checkpoint" if os.path.isdir(run.path) else "does not exist"
    fresh = ("choose another --out (or delete it) to start a new run" if _held(run)
             else "drop --resume to start a new run there")
    found = runs_beside(run.path)
    if not found:
        where = os.path.dirname(os.path.normpath(run.path)) or "."
        return (f"--resume: train.out_dir = {run.path!r} {state}, and no run directory beside it in {where!r} "
                f"holds checkpoints: check --out, or {fresh}")
    return (f"--resume: train.out_dir = {run.path!r} {state}; run directories with checkpoints nearby: "
            f"{', '.join(found)}: pass --out with the one to continue, or {fresh}")


MAX_LISTED = 8  # run directories named in resume_problem's message; more are counted


def runs_beside(path: str) -> list[str]:
    """The run directories holding checkpoints next to ``path`` (its siblings, and its parent when that is
    one: ``--out runs/x/checkpoints``), spelled like ``path``; the first :data:`MAX_LISTED` by name."""
    path = os.path.normpath(path)
    parent = os.path.dirname(path)
    found = [parent] if parent and _has_checkpoints(parent) else []
    try:
        names = sorted(os.listdir(parent or "."))
    except OSError:  # the parent does not exist either
        names = []
    found += [p for p in (os.path.join(parent, n) for n in names) if p != path and _has_checkpoints(p)]
    if len(found) > MAX_LISTED:
        return [*found[:MAX_LISTED], f"... ({len(found) - MAX_LISTED} more)"]
    return found


def _has_checkpoints(path: str) -> bool:
    try:
        return bool(RunDir(path).checkpoint_steps())
    except OSError:  # unreadable: not one to suggest
        return False


def _create(cfg: RunConfig, watchdog: Watchdog | None) -> None:
    """Rank 0: refuse a directory holding another run, else take its lease (renewed by ``watchdog``), create
    it and save the configuration."""
    problem = start_problem(cfg)
    if problem is not None:
        raise ValueError(problem)
    hold_lease(RunDir(cfg.train.out_dir).checkpoints, watchdog=watchdog)
    try:
        os.makedirs(cfg.train.out_dir, exist_ok=True)
        with open(os.path.join(cfg.train.out_dir, CONFIG_NAME), "w", encoding="utf-8") as f:
            f.write(to_toml(cfg))
    except OSError as e:
        raise ValueError(f"train.out_dir = {cfg.train.out_dir!r} cannot be written: {e}") from e


def prepare_run_dir(cfg: RunConfig, channel: RankChannel) -> RunDir:
    """Check the run directory, take its lease (held until :func:`release_run_dir`), create it and save the
    configuration (rank 0); a collective. Every rank raises the same ``ValueError`` (rank 0's message,
    unprefixed) when the run may not start, before anything is written."""
    on_rank0(channel.comm, "", lambda: _create(cfg, channel.mesh.watchdog))
    return RunDir(cfg.train.out_dir)


def release_run_dir(run: RunDir) -> None:
    """Give the run directory's lease back (on rank 0, which holds it): the job is done writing there."""
    release_lease(run.checkpoints)
