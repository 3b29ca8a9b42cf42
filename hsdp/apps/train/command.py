"""The ``hsdp train`` command line: arguments, configuration, and where the ranks come from.

Under torchrun or ``hsdp launch`` (``RANK`` and ``WORLD_SIZE`` are set) this process is one rank and runs
the job. Otherwise ``hsdp train`` starts the ranks itself: ``parallel.nodes`` emulated nodes of
``parallel.nproc_per_node`` ranks on this machine (one torchrun agent per node, see
``hsdp.tools.launch.local``), each running ``python -m hsdp.apps.train`` with the same configuration.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING

from hsdp.tools.launch.emulated import USAGE_ERROR

if TYPE_CHECKING:
    from hsdp.apps.train.config import RunConfig
    from hsdp.apps.train.job import Report


EPILOG = """\
examples:
  hsdp train                                   tiny GPT on the Python stdlib, 2 emulated nodes x 2 ranks
  hsdp train --steps 50 --profile              a short run with a profiler trace
  hsdp train run.toml train.batch_size=16      a config file, then overrides (section.field=value)
  hsdp train --resume                          continue runs/train from its last checkpoint
  hsdp train model.kind=hf model.path=DIR      a local Hugging Face causal LM folder, with its tokenizer
  torchrun --nnodes 2 --nproc-per-node 8 ... -m hsdp.apps.train run.toml     on a real cluster
  hsdp launch --elastic --nodes 3 -- -m hsdp.apps.train parallel.elastic=true  replicas that leave and rejoin

Every field and its default: hsdp train --print-config
"""


class IntermixedParser(argparse.ArgumentParser):
    """A parser whose positionals (config file, overrides) may come before, between or after the flags,
    as in ``hsdp train run.toml --resume train.steps=9``; plain argparse stops collecting a ``nargs="*"``
    positional at the first flag and rejects the rest."""

    _inside = False

    def parse_known_args(self, args: list[str] | None = None, namespace: argparse.Namespace | None = None,
                         ) -> tuple[argparse.Namespace, list[str]]:
        if self._inside:  # parse_known_intermixed_args calls back into parse_known_args (Python <= 3.12)
            return super().parse_known_args(args, namespace)
        self._inside = True
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._inside = False


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``train`` on the ``hsdp`` parser's ``subparsers``."""
    p = subparsers.add_parser("train", help="train a GPT-style model with HSDP (config file + overrides)",
                              description="Train a language model with HSDP.", epilog=EPILOG,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.__class__ = IntermixedParser  # the subparsers action builds plain parsers; same layout, new parsing
    add_arguments(p)
    return p


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("items", nargs="*", metavar="[CONFIG.toml] [section.field=value ...]",
                   help="a TOML config file, then overrides applied in order")
    p.add_argument("--resume", action="store_true",
                   help="continue the run directory from its last checkpoint; refused when it holds none, "
                        "except under torchrun, where that is a fresh start (a job script's first submission)")
    p.add_argument("--profile", action="store_true", help="write torch.profiler traces of a few steps")
    p.add_argument("--out", metavar="DIR", help="run directory (train.out_dir)")
    p.add_argument("--steps", type=int, help="training steps (train.steps)")
    p.add_argument("--preset", help="model shape (model.preset): tiny, small, bench, gpt2-124m, ..., gpt-1b")
    p.add_argument("--data", metavar="SOURCE",
                   help="text file, folder, .jsonl, .parquet (file or folder) or datasets dir (data.source)")
    p.add_argument("--nodes", type=int, help="emulated nodes when starting the ranks itself (parallel.nodes)")
    p.add_argument("--nproc-per-node", type=int, help="ranks per node (parallel.nproc_per_node)")
    p.add_argument("--print-config", action="store_true", help="print the resolved configuration and exit")


def split_items(items: list[str]) -> tuple[str | None, list[str]]:
    """``(config file, overrides)``: a first item without ``=`` is the config file."""
    if items and "=" not in items[0]:
        path, rest = items[0], items[1:]
    else:
        path, rest = None, list(items)
    stray = [i for i in rest if "=" not in i]
    if stray:
        raise ValueError(f"{stray[0]!r} is not an override: write section.field=value (only the first "
                         f"argument may be a config file)")
    return path, rest


def overrides_from(args: argparse.Namespace) -> list[str]:
    """The shortcut flags as overrides (applied before the explicit ones, which therefore win)."""
    flags = [("train.resume", args.resume or None), ("train.profile", args.profile or None),
             ("train.out_dir", args.out), ("train.steps", args.steps), ("model.preset", args.preset),
             ("data.source", args.data), ("parallel.nodes", args.nodes),
             ("parallel.nproc_per_node", args.nproc_per_node)]
    out = []
    for key, value in flags:
        if value is not None:
            out.append(f"{key}={'true' if value is True else value}")
    return out


def under_torchrun() -> bool:
    """Whether this process is already one rank of a launched job."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _error(message: str) -> int:
    print(f"hsdp train: error: {message}", file=sys.stderr, flush=True)
    return USAGE_ERROR


def layout_problem(config: RunConfig) -> str | None:
    """Why the ranks ``hsdp train`` would start itself (``parallel.nodes`` x ``parallel.nproc_per_node``)
    cannot form the configured mesh; checked before spawning them, which would each fail alike."""
    from hsdp.engine.mesh_layout import validate_degree

    nodes, per_node, degree = config.parallel.nodes, config.parallel.nproc_per_node, config.parallel.sharding_degree
    world = f"the world is parallel.nodes x parallel.nproc_per_node = {nodes} x {per_node}"
    tp = config.parallel.tensor_parallel
    if isinstance(degree, tuple):
        if per_node % tp:
            return f"parallel.tensor_parallel = {tp} does not divide parallel.nproc_per_node = {per_node}"
        # With tensor parallelism a degree counts data-parallel positions of tp adjacent ranks each.
        positions = nodes * per_node // tp
        if sum(degree) != positions:
            groups = f" tensor-parallel groups of {tp}" if tp > 1 else " ranks"
            return (f"parallel.sharding_degree = {list(degree)} covers {sum(degree) * tp} ranks (one degree per "
                    f"replica, in rank order, counting{groups}), but {world} = {nodes * per_node}: make the degrees "
                    f"sum to {positions}")
        return weights_problem(config, list(degree))
    if tp > 1:
        readers = nodes * (per_node // tp)  # data-parallel ranks: a tensor-parallel group reads one batch
        shard = degree or per_node // tp
        return tp_layout_problem(per_node, degree, tp) or weights_problem(config, [shard] * (readers // shard))
    try:
        if degree:  # 0: the ranks per node, which always tiles the world
            validate_degree(nodes * per_node, degree)
    except ValueError as e:
        return f"{e} ({world})"
    shard = degree or per_node
    return weights_problem(config, [shard] * (nodes * per_node // shard))


def weights_problem(config: RunConfig, replica_sizes: list[int]) -> str | None:
    """Why a list of ``parallel.batch_weights`` does not fit replicas of ``replica_sizes`` data-parallel ranks:
    the wrong count, or a ``train.batch_size`` too small to give every rank a sequence."""
    from hsdp.apps.train.weighted_stream import batch_size_problem, per_rank_weights

    weights = config.parallel.batch_weights
    if isinstance(weights, str):
        return None
    try:
        return batch_size_problem(per_rank_weights(weights, replica_sizes), config.train.batch_size)
    except ValueError as e:
        return str(e)


def tp_layout_problem(per_node: int, degree: int, tp: int) -> str | None:
    """Why ``parallel.tensor_parallel`` = ``tp`` cannot lay out nodes of ``per_node`` ranks with shard groups of
    ``degree`` (0: ``per_node / tp``), naming the fields. Both kinds of group stay inside one node: a tensor-
    parallel group (its activation traffic is on the critical path) of adjacent ranks, and a shard group of
    ``degree`` such groups (every all-gather and reduce-scatter); only the replica hop crosses nodes."""
    if per_node % tp:
        fits = [d for d in range(1, per_node + 1) if per_node % d == 0]
        return (f"parallel.tensor_parallel = {tp} does not divide parallel.nproc_per_node = {per_node}: a "
                f"tensor-parallel group must lie inside one node; choose one of {fits}")
    groups = per_node // tp  # tensor-parallel groups per node: the most a shard group may hold
    if degree and degree * tp > per_node:
        return (f"parallel.sharding_degree = {degree} x parallel.tensor_parallel = {tp} is more than the "
                f"{per_node} ranks per node (parallel.nproc_per_node), so shard groups would cross nodes: set "
                f"parallel.sharding_degree to at most {groups} (0 means {groups})")
    if degree and groups % degree:
        fits = [d for d in range(1, groups + 1) if groups % d == 0]
        return (f"parallel.sharding_degree = {degree} does not divide the {groups} tensor-parallel groups of a "
                f"node (parallel.nproc_per_node / parallel.tensor_parallel = {per_node} / {tp}), so some shard "
                f"group would cross nodes: choose one of {fits} (0 means {groups})")
    return None


def input_problem(config: RunConfig) -> str | None:
    """Why the data source or the model cannot be read (a missing path, a folder without matching files, a
    model folder without config.json or tokenizer, a missing package), naming the fix: checked before
    spawning the ranks, which would each fail alike under a wall of tracebacks."""
    from hsdp.apps.train.lm import LANGUAGE_MODELS
    from hsdp.apps.train.sources import source_problem

    return source_problem(config.data) or LANGUAGE_MODELS[config.model.kind].problem(config.model)


def run_rank(config: RunConfig, report: Report | None = None) -> int:
    """Run the job as this rank, ending with ``report`` (default: ``hsdp train``'s); 2 (after one message
    from rank 0) when the run may not start, 143 when a SIGTERM stopped it after a checkpoint, 3
    (``QUORUM_LOST_EXIT_STATUS``) when the coordinator of an elastic job stopped it below its minimum."""
    import torch.distributed as dist

    from hsdp.apps.train.elastic_run import QUORUM_LOST_EXIT_STATUS
    from hsdp.apps.train.job import print_report, run_job
    from hsdp.engine.preemption import STOP_EXIT_STATUS
    from hsdp.engine.replicate.elastic.client import QuorumLost

    try:
        outcome = run_job(config, report=report or print_report)
    except ValueError as e:  # every rank raises the same agreed error: print it once
        return _error(str(e)) if os.environ.get("RANK", "0") == "0" else USAGE_ERROR
    except QuorumLost as e:  # before the first step (a replica joining as the job stops): nothing to save
        if os.environ.get("RANK", "0") == "0":
            print(f"hsdp train: {e}", file=sys.stderr, flush=True)
        return QUORUM_LOST_EXIT_STATUS
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if outcome.quorum_lost:
        return QUORUM_LOST_EXIT_STATUS
    return STOP_EXIT_STATUS if outcome.stopped else 0


def run(args: argparse.Namespace) -> int:
    """Execute a parsed ``hsdp train``; the exit status."""
    from hsdp.apps.train.config_io import resolve_config, to_toml
    from hsdp.apps.train.elastic_run import launch_problem
    from hsdp.apps.train.rundir import resume_problem, start_problem
    from hsdp.apps.train.wandb_sink import wandb_problem

    try:
        path, items = split_items(args.items)
        overrides = overrides_from(args) + items
        config = resolve_config(path, overrides)
        # Under torchrun each rank checks its run directory itself (and --resume may start fresh there); its
        # inputs before it joins the process group or writes anything.
        problem = launch_problem(config, under_torchrun()) or (
            (wandb_problem(config) or input_problem(config)) if under_torchrun() else (
                start_problem(config) or resume_problem(config) or layout_problem(config) or wandb_problem(config)
                or input_problem(config)))
    except ValueError as e:
        return _error(str(e))
    if args.print_config:
        print(to_toml(config), end="")
        return 0
    if problem is not None:  # before starting any rank; under torchrun every rank stops alike, rank 0 says why
        return _error(problem) if os.environ.get("RANK", "0") == "0" else USAGE_ERROR
    if under_torchrun():
        return run_rank(config)
    from hsdp.tools.launch import launch_local

    script = ["-m", "hsdp.apps.train", *([path] if path else []), *overrides]
    return launch_local(config.parallel.nodes, config.parallel.nproc_per_node, script)


def main(argv: list[str] | None = None) -> int:
    """``python -m hsdp.apps.train``: the same as ``hsdp train``."""
    parser = IntermixedParser(prog="python -m hsdp.apps.train", description="Train a language model with HSDP.",
                              epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))
