"""Parsing the link parameters of ``hsdp launch``: rates like ``1gbit`` and durations like ``1ms``.

Rates use tc's own spelling (``bit``, ``kbit``, ``mbit``, ``gbit``, ``tbit``: decimal multiples of bits per
second), so what the user types is what ``tc`` would understand. tc's ``bps`` means *bytes* per second, a
classic source of 8x mistakes, so it is refused with a message naming the ``bit`` spelling instead.
"""

from __future__ import annotations

import re

_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
_TIME_UNITS = {"s": 1.0, "sec": 1.0, "ms": 1e-3, "msec": 1e-3, "us": 1e-6, "usec": 1e-6}
_NUMBER_UNIT = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def _split(text: str, what: str) -> tuple[float, str]:
    match = _NUMBER_UNIT.match(text)
    if match is None:
        raise ValueError(f"cannot read {what} {text!r}: expected a number and a unit, e.g. '1gbit' or '1ms'")
    return float(match.group(1)), match.group(2).lower()


def parse_rate(text: str) -> int:
    """Bits per second of a tc-style rate (``"50mbit"`` -> 50_000_000); must be positive.

    ``ValueError`` names the accepted units. ``bps``-style units are refused because tc reads them as bytes.
    """
    value, unit = _split(text, "rate")
    if unit.endswith("bps"):
        raise ValueError(f"rate {text!r}: tc reads 'bps' as bytes per second; write bits, e.g. "
                         f"'{value:g}{unit[:-3]}bit' (or multiply by 8)")
    if unit not in _RATE_UNITS:
        raise ValueError(f"rate {text!r}: unknown unit {unit!r}; use one of {', '.join(_RATE_UNITS)}")
    bits = round(value * _RATE_UNITS[unit])
    if bits <= 0:
        raise ValueError(f"rate {text!r} must be positive")
    return bits


def parse_duration(text: str) -> float:
    """Seconds of a tc-style duration (``"1ms"`` -> 0.001); ``"0"`` is allowed and means none."""
    value, unit = _split(text, "duration")
    if unit == "" and value == 0:
        return 0.0
    if unit not in _TIME_UNITS:
        raise ValueError(f"duration {text!r}: unknown unit {unit!r}; use one of {', '.join(_TIME_UNITS)}")
    return value * _TIME_UNITS[unit]


def format_rate(bits_per_s: int) -> str:
    """The largest tc unit that shows ``bits_per_s`` without a fraction (``50_000_000`` -> ``"50mbit"``)."""
    for unit, scale in sorted(_RATE_UNITS.items(), key=lambda kv: -kv[1]):
        if bits_per_s % scale == 0:
            return f"{bits_per_s // scale}{unit}"
    return f"{bits_per_s}bit"


def format_bytes(count: int) -> str:
    """Human-readable decimal size (``12_345_678`` -> ``"12.35 MB"``), matching how link rates are quoted."""
    size = float(count)
    for unit in ("B", "kB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{count} B" if unit == "B" else f"{size:.2f} {unit}"
        size /= 1000
    return f"{size:.2f} GB"
