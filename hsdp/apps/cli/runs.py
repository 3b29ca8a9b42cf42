"""``hsdp export`` and ``hsdp report``: the commands that read what a run left behind (its checkpoints, its
metrics). Each runs in one process; torch is imported only when one runs."""

from __future__ import annotations

import argparse
import sys


def add_export(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``export`` on ``subparsers``."""
    p = subparsers.add_parser("export", help="write a checkpoint's model weights to one .safetensors file",
                              description="Consolidate the model weights of an hsdp (or DCP) checkpoint into a "
                                          "file that safetensors readers and model.load_state_dict accept. "
                                          "Runs in one process.")
    p.add_argument("checkpoint", help="a run directory (its latest valid checkpoint) or one step_* directory")
    p.add_argument("--to", required=True, metavar="OUT.safetensors", help="the file to write")
    p.set_defaults(func=run_export)
    return p


def run_export(args: argparse.Namespace) -> int:
    """Execute a parsed ``hsdp export``: 0, or 2 with the reason on a bad path or a broken checkpoint."""
    from hsdp.checkpoint import export_safetensors

    try:
        tied = export_safetensors(args.checkpoint, args.to)
    except ValueError as e:  # a bad path or a broken checkpoint: say which, no traceback
        print(f"hsdp export: {e}", file=sys.stderr)
        return 2
    aliases = "".join(f"\n  {alias} -> {name} (tied, stored once)" for alias, name in tied.items())
    print(f"wrote {args.to}{aliases}")
    return 0


def add_report(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``report`` on ``subparsers``."""
    p = subparsers.add_parser("report", help="PNG plots of an hsdp train run (loss, throughput, communication)",
                              description="Write loss.png, throughput.png and communication.png into "
                                          "RUN_DIR/report.")
    p.add_argument("run_dir", metavar="RUN_DIR", help="an hsdp train run directory (e.g. runs/train)")
    p.set_defaults(func=run_report)
    return p


def run_report(args: argparse.Namespace) -> int:
    """Execute a parsed ``hsdp report``: 0 after printing the files written, 2 with the reason otherwise."""
    from hsdp.apps.train.report import write_report

    try:
        paths = write_report(args.run_dir)
    except ValueError as e:
        print(f"hsdp report: error: {e}", file=sys.stderr)
        return 2
    print("\n".join(paths))
    return 0
