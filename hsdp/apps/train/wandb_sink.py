"""Weights & Biases logging for ``hsdp train`` (``log.wandb = true``; ``pip install 'hsdp[wandb]'``).

Rank 0 alone opens a W&B run and logs each step's record as ``train/<field>`` at that step (the same
records as ``metrics.jsonl``, see :mod:`hsdp.apps.train.metrics`), with the whole configuration as the run's
config. The run is named after the run directory; its id is kept in the run directory (``wandb_id``), so a
``--resume`` continues the same W&B run rather than starting another. The steps redone after a resume
(from the checkpoint to where the interruption came) are bitwise the same as before, and W&B keeps the
first logging of a step.

Whether wandb is installed is checked before any rank starts (:func:`wandb_problem`): a missing package
must not surface as one rank's ImportError while the others wait in a collective.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import secrets
from typing import Any

from hsdp.apps.train.config import RunConfig
from hsdp.apps.train.metrics import RecordSink

INSTALL = "pip install 'hsdp[wandb]'"
ID_NAME = "wandb_id"  # the W&B run id of this run directory, reused by --resume


def wandb_problem(cfg: RunConfig) -> str | None:
    """Why the configured W&B logging cannot start (``None``: it can, or it is off): wandb not installed."""
    if not cfg.log.wandb or importlib.util.find_spec("wandb") is not None:
        return None
    return f"log.wandb = true needs the wandb package: {INSTALL} (or set log.wandb = false)"


def _run_id(run_dir: str, resume: bool) -> str:
    """The W&B run id: the one saved in ``run_dir`` when resuming, else a new one (saved)."""
    path = os.path.join(run_dir, ID_NAME)
    if resume and os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            return f.read().strip()
    run_id = secrets.token_hex(6)  # W&B ids: letters and digits, unique within the project
    with open(path, "w", encoding="utf-8") as f:
        f.write(run_id + "\n")
    return run_id


class WandbSink:
    """One W&B run receiving the records of rank 0's :class:`~hsdp.apps.train.metrics.MetricsWriter`.

    Local files go to ``$WANDB_DIR`` when set, else into the run directory (``<run>/wandb/``), so an
    offline run travels with the rest of the run."""

    def __init__(self, cfg: RunConfig, run_dir: str) -> None:
        import wandb

        self.run = wandb.init(project=cfg.log.wandb_project, name=os.path.basename(os.path.abspath(run_dir)),
                              mode=cfg.log.wandb_mode, dir=os.environ.get("WANDB_DIR") or run_dir,
                              config=dataclasses.asdict(cfg), id=_run_id(run_dir, cfg.train.resume),
                              resume="allow")

    def write(self, record: dict[str, Any]) -> None:
        if record["step"] < self.run.step:  # resumed online: W&B already holds this step (and would warn)
            return
        values = {f"train/{k}": v for k, v in record.items() if k != "step" and v is not None}
        self.run.log(values, step=record["step"])

    def close(self) -> None:
        self.run.finish()


def record_sinks(cfg: RunConfig, run_dir: str) -> list[RecordSink]:
    """The extra record sinks ``cfg`` asks for (rank 0 only): a :class:`WandbSink` with ``log.wandb``."""
    return [WandbSink(cfg, run_dir)] if cfg.log.wandb else []
