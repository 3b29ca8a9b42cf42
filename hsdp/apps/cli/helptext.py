"""What every ``hsdp`` subcommand's ``--help`` says the same way: each option's default, and how a rate is
spelled.

Imports only argparse, so building the parser stays torch-free.
"""

from __future__ import annotations

import argparse

# The spellings hsdp.tools.quantities.parse_bandwidth reads, for every option that takes a rate (tests check
# that each example here parses). A bare number and 'mbps' are refused: bits and bytes differ by 8x.
RATE_UNITS = "bits per second (1gbit, 10gbit, 400Gb/s) or bytes per second (1GB/s, 25GiB/s)"


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps descriptions and epilogs as written (their examples are laid out by hand) and ends each option's
    help with ``(default: X)``, unless the help already says what the default is (it contains "default")
    or there is none to show (``None``, a flag's ``False``, a positional)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        hidden = default is None or default is False or default is argparse.SUPPRESS or not action.option_strings
        if hidden or "default" in text:
            return text
        shown = "%(default)s" if default != "" else "none"  # '' reads as nothing at all
        return f"{text} (default: {shown})"
