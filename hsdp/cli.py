"""The ``hsdp`` command line."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hsdp", description="Hybrid Sharded Data Parallel training")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("version", help="print the version")
    args = parser.parse_args(argv)
    if args.command == "version":
        from hsdp import __version__
        print(__version__)
    return 0


if __name__ == "__main__":
    sys.exit(main())
