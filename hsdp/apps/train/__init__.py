"""``hsdp train``: a complete training job for GPT-style models on hsdp, driven by a typed config.

::

    hsdp train                                  # tiny GPT, Python stdlib text, 2 emulated nodes x 2 ranks
    hsdp train run.toml train.steps=1000        # TOML config, then section.field=value overrides
    hsdp train model.kind=hf model.path=DIR     # a local Hugging Face causal LM folder, its own tokenizer
    torchrun --nnodes N --nproc-per-node G -m hsdp.apps.train run.toml

From Python (on every rank of a launched job)::

    from hsdp.apps.train import resolve_config, run_job
    run_job(resolve_config("run.toml", ["train.steps=100"]))

Modules: ``config`` (the typed sections), ``config_io`` (TOML and overrides), ``sources`` (the documents of
each kind of data source, checked before any rank starts), ``corpus`` (tokenizers and the token stream),
``lm`` (one adapter per model kind: build, logits, loss), ``hf_folder`` (``model.kind = "hf"``: a local
Hugging Face causal-LM folder), ``hf_export`` (``hsdp export --to hf``), ``optimizer`` (AdamW and schedule),
``trainer`` (the ``Trainer``: steps, evaluation, checkpoints), ``result`` (a session's records),
``metrics``, ``wandb_sink`` (Weights & Biases, ``log.wandb``), ``progress``, ``rank_warnings``, ``resume``,
``profiling``, ``summary``, ``job`` (one rank's run), ``command`` (the command line), ``report`` (``hsdp
report``'s plots; ``report_membership``: an elastic run's members per step).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hsdp.apps.train.config import DataConfig, ModelConfig, OptimConfig, ParallelConfig, RunConfig, TrainConfig
from hsdp.apps.train.config_io import build_config, resolve_config, to_toml

if TYPE_CHECKING:
    from hsdp.apps.train.job import JobOutcome, run_job


def __getattr__(name: str) -> Any:
    # The job needs torch; the command line's parser and the configuration do not (`hsdp --help` stays fast).
    if name in ("JobOutcome", "run_job"):
        from hsdp.apps.train import job

        return getattr(job, name)
    raise AttributeError(f"module 'hsdp.apps.train' has no attribute {name!r}")

__all__ = [
    "DataConfig",
    "JobOutcome",
    "ModelConfig",
    "OptimConfig",
    "ParallelConfig",
    "RunConfig",
    "TrainConfig",
    "build_config",
    "resolve_config",
    "run_job",
    "to_toml",
]
