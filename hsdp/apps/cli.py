"""The ``hsdp`` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

Command = Callable[[argparse.Namespace], int]


def _version(args: argparse.Namespace) -> int:
    from hsdp import __version__

    print(__version__)
    return 0


def _demo(args: argparse.Namespace) -> int:
    # Imported here: `hsdp version` should not pay for importing torch.
    from hsdp.tools.launch import launch_local

    return launch_local(args.nodes, args.nproc_per_node, ["-m", "hsdp.apps.demo", "--steps", str(args.steps)])


def _launch(args: argparse.Namespace) -> int:
    from hsdp.tools.launch.command import run

    return run(args)


def _add_launch(sub: argparse._SubParsersAction) -> None:
    # The arguments live with the launcher (hsdp.tools.launch.command); argparse is all that module imports.
    from hsdp.tools.launch.command import add_parser

    add_parser(sub).set_defaults(func=_launch)


def _export(args: argparse.Namespace) -> int:
    from hsdp.checkpoint import export_safetensors

    try:
        tied = export_safetensors(args.checkpoint, args.to)
    except ValueError as e:  # a bad path or a broken checkpoint: say which, no traceback
        print(f"hsdp export: {e}", file=sys.stderr)
        return 2
    aliases = "".join(f"\n  {alias} -> {name} (tied, stored once)" for alias, name in tied.items())
    print(f"wrote {args.to}{aliases}")
    return 0


def _add_export(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="write a checkpoint's model weights to one .safetensors file",
                       description="Consolidate the model weights of an hsdp (or DCP) checkpoint into a file that "
                                   "safetensors readers and model.load_state_dict accept. Runs in one process.")
    p.add_argument("checkpoint", help="a run directory (its latest valid checkpoint) or one step_* directory")
    p.add_argument("--to", required=True, metavar="OUT.safetensors", help="the file to write")
    p.set_defaults(func=_export)


def _train(args: argparse.Namespace) -> int:
    from hsdp.apps.train.command import run

    return run(args)


def _add_train(sub: argparse._SubParsersAction) -> None:
    # The arguments live with the job (hsdp.apps.train.command); argparse is all that module imports.
    from hsdp.apps.train.command import add_parser

    add_parser(sub).set_defaults(func=_train)


def _report(args: argparse.Namespace) -> int:
    from hsdp.apps.train.report import write_report

    try:
        paths = write_report(args.run_dir)
    except ValueError as e:
        print(f"hsdp report: error: {e}", file=sys.stderr)
        return 2
    print("\n".join(paths))
    return 0


def _add_report(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("report", help="PNG plots of an hsdp train run (loss, throughput, communication)",
                       description="Write loss.png, throughput.png and communication.png into RUN_DIR/report.")
    p.add_argument("run_dir", metavar="RUN_DIR", help="an hsdp train run directory (e.g. runs/train)")
    p.set_defaults(func=_report)


def _plan(args: argparse.Namespace) -> int:
    from hsdp.tools.planner.command import run

    return run(args)


def _add_plan(sub: argparse._SubParsersAction) -> None:
    # The arguments live with the planner (hsdp.tools.planner.command), which imports no torch.distributed.
    from hsdp.tools.planner.command import add_parser

    add_parser(sub).set_defaults(func=_plan)


def _tune(args: argparse.Namespace) -> int:
    from hsdp.tools.planner.tune_command import run

    return run(args)


def _add_tune(sub: argparse._SubParsersAction) -> None:
    from hsdp.tools.planner.tune_command import add_parser

    add_parser(sub).set_defaults(func=_tune)


def _add_version(sub: argparse._SubParsersAction) -> None:
    sub.add_parser("version", help="print the version").set_defaults(func=_version)


def _add_bench(sub: argparse._SubParsersAction) -> None:
    # Listed for `hsdp --help`; main() hands every argument after `bench` to the benchmark's own parser.
    sub.add_parser("bench", help="hsdp against FSDP2 (HSDP, full shard) and DDP on the same work "
                                 "(see `hsdp bench --help`)", add_help=False)


def _add_demo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="train a tiny GPT with HSDP on emulated nodes of this machine",
                       description="Start one torchrun agent per emulated node (loopback) and run hsdp.apps.demo.")
    p.add_argument("--nodes", type=int, default=2, help="emulated nodes (default: 2)")
    p.add_argument("--nproc-per-node", type=int, default=2, help="ranks per node = shard degree (default: 2)")
    p.add_argument("--steps", type=int, default=100, help="training steps (default: 100)")
    p.set_defaults(func=_demo)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hsdp", description="Hybrid Sharded Data Parallel training")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_version(sub)
    _add_demo(sub)
    _add_launch(sub)
    _add_export(sub)
    _add_train(sub)
    _add_report(sub)
    _add_plan(sub)
    _add_tune(sub)
    _add_bench(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:
        from hsdp.tools.bench.driver import main as bench_main

        return bench_main(argv[1:])
    args = build_parser().parse_args(argv)
    func: Command = args.func
    return func(args)


if __name__ == "__main__":
    sys.exit(main())
