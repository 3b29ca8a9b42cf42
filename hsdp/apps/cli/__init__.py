"""The ``hsdp`` command line: one parser whose subcommands dispatch to the tools and applications.

Each subcommand's arguments live in a module of this package (``launch``, ``coordinator``, ``plan``, ``tune``,
``bench``, ``runs``, ``env``) or, for ``hsdp train``, with the job (:mod:`hsdp.apps.train.command`). Building the
parser imports no torch, so ``hsdp --help``, ``hsdp version`` and ``hsdp plan`` answer at once; a subcommand that needs
torch imports it when it runs.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from hsdp.apps.cli import bench, coordinator, env, launch, plan, runs, tune

Command = Callable[[argparse.Namespace], int]


def _version(args: argparse.Namespace) -> int:
    from hsdp import __version__

    print(__version__)
    return 0


def _add_version(sub: argparse._SubParsersAction) -> None:
    sub.add_parser("version", help="print the version").set_defaults(func=_version)


def _train(args: argparse.Namespace) -> int:
    from hsdp.apps.train.command import run

    return run(args)


def _add_train(sub: argparse._SubParsersAction) -> None:
    # The arguments live with the job (hsdp.apps.train.command); argparse is all that module imports.
    from hsdp.apps.train.command import add_parser

    add_parser(sub).set_defaults(func=_train)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hsdp", description="Hybrid Sharded Data Parallel training")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_version(sub)
    launch.add_demo(sub)
    launch.add_launch(sub)
    coordinator.add_coordinator(sub)
    runs.add_export(sub)
    _add_train(sub)
    runs.add_report(sub)
    plan.add_plan(sub)
    tune.add_tune(sub)
    bench.add_bench(sub)
    env.add_env(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the ``hsdp`` command line on ``argv`` (default: the process's arguments); the exit status."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # the benchmark parses its own arguments
        return bench.main(argv[1:])
    args = build_parser().parse_args(argv)
    func: Command = args.func
    return func(args)
