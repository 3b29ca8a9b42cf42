"""``hsdp export`` and ``hsdp report``: the commands that read what a run left behind (its checkpoints, its
metrics). Each runs in one process; torch is imported only when one runs."""

from __future__ import annotations

import argparse
import sys


def add_export(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``export`` on ``subparsers``."""
    p = subparsers.add_parser("export", help="write a checkpoint's model weights to one .safetensors file or a "
                                             "Hugging Face folder",
                              description="Consolidate the model weights of an hsdp (or DCP) checkpoint. "
                                          "--to OUT.safetensors: one file that "
                                          "model.load_state_dict(safetensors.torch.load_file(OUT)) accepts "
                                          "(tied weights written under every name). --to hf DIR: a Hugging "
                                          "Face folder (config.json, sharded safetensors, index) that "
                                          "from_pretrained(DIR) loads, for model.kind = 'hf-gpt2' and 'hf' runs "
                                          "(an 'hf' run's folder also gets its model folder's tokenizer). "
                                          "Missing output directories are created. Runs in one process.")
    p.add_argument("checkpoint", help="an hsdp train run directory (e.g. runs/train), its checkpoints "
                                      "directory, or one step_* directory; a run means its latest valid "
                                      "checkpoint")
    p.add_argument("--to", required=True, nargs="+", metavar="OUT", help="OUT.safetensors, or: hf DIR")
    p.add_argument("--max-shard-size", default="5GB", metavar="SIZE",
                   help="with --to hf: the largest safetensors shard, e.g. 5GB or 500MiB (default: %(default)s)")
    p.set_defaults(func=run_export)
    return p


def run_export(args: argparse.Namespace) -> int:
    """Execute a parsed ``hsdp export``: 0, or 2 with the reason in one line on a bad path, a bad ``--to`` or
    a broken checkpoint."""
    try:
        return _export(args)
    except (ValueError, OSError) as e:  # a bad path, an unwritable --to or a broken checkpoint: no traceback
        print(f"hsdp export: error: {e}", file=sys.stderr)
        return 2


def _export(args: argparse.Namespace) -> int:
    target = list(args.to)
    if target[0] == "hf":
        if len(target) != 2:
            raise ValueError("--to hf needs the folder to write: --to hf DIR")
        from hsdp.apps.train.hf_export import export_hf
        from hsdp.tools.quantities import parse_bytes

        files = export_hf(args.checkpoint, target[1], max_shard_bytes=int(parse_bytes(args.max_shard_size)))
        shards = sum(f.endswith(".safetensors") for f in files)
        copied = len(files) - shards - 2  # a model.kind = 'hf' run: its folder's tokenizer and other files
        print(f"wrote {target[1]} (Hugging Face folder: {shards} weight shard(s), config.json, index"
              + (f", {copied} file(s) of the model folder: tokenizer, ...)" if copied else ")"))
        return 0
    if len(target) != 1:
        raise ValueError(f"--to {' '.join(target)}: pass one OUT.safetensors file, or hf DIR")
    from hsdp.checkpoint import export_safetensors

    tied = export_safetensors(args.checkpoint, target[0])
    aliases = "".join(f"\n  {alias} = {name} (tied, written under both names)" for alias, name in tied.items())
    print(f"wrote {target[0]}{aliases}")
    return 0


def add_report(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``report`` on ``subparsers``."""
    p = subparsers.add_parser("report",
                              help="PNG plots of a train run (loss, throughput, communication, lr, grad norm, memory)",
                              description="Write loss.png, throughput.png, communication.png and training.png into "
                                          "RUN_DIR/report (and membership.png for an elastic run: the replicas "
                                          "of each step).")
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
