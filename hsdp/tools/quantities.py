"""Quantities of measure as people type them and as the tools print them: sizes, rates, durations, FLOP/s.

Every parser returns SI base units (bytes, bytes or bits per second, seconds, FLOP/s), so formulas never see
a unit suffix, and refuses what it cannot read without guessing, naming the spelling it wants. One
vocabulary everywhere: a size (``--gpu-memory``) needs its unit (``80GiB``, ``40GB``): a bare ``80`` is
refused, as 80 bytes is never meant and GiB versus GB differ by 7%. A rate (``hsdp plan``'s bandwidths,
``hsdp launch``'s link, ``hsdp tune``, ``hsdp bench``) is read by :func:`parse_bandwidth` in either spelling:

* bits, as network links are quoted and as tc spells them: ``1gbit``, ``100mbit``, ``400Gb/s``;
* bytes, as accelerator links are quoted: ``450GB/s``, ``25GiB/s``.

A bare number is refused because the two readings differ by 8x, and so is ``mbps``-style spelling: tc reads
``bps`` as *bytes* per second where most people mean bits. :func:`parse_tc_rate` is the same reading in the
integer bits per second that ``tc`` is given.
"""

from __future__ import annotations

import re

_NUMBER_UNIT = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z/]*)\s*$")
_DECIMAL = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "p": 1e15}
_BINARY = {"ki": 2.0**10, "mi": 2.0**20, "gi": 2.0**30, "ti": 2.0**40}
# tc's spellings (sec, msec, usec) and the short ones; the message names only the short ones.
_SECONDS = {"s": 1.0, "sec": 1.0, "ms": 1e-3, "msec": 1e-3, "us": 1e-6, "usec": 1e-6, "ns": 1e-9,
            "min": 60.0, "h": 3600.0, "d": 86400.0}  # the long ones for failure and checkpoint intervals
_BINARY_SIZES = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))
_DECIMAL_SIZES = (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3))
_RATE_PREFIXES = (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3))


# ---------------------------------------------------------------------------------------------------------
# Reading.
# ---------------------------------------------------------------------------------------------------------
def _split(text: str | float | int, what: str, example: str) -> tuple[float, str]:
    """(number, unit as typed) of ``"1.5 GiB"``; a number passed as a number has no unit."""
    if isinstance(text, (int, float)):
        return float(text), ""
    match = _NUMBER_UNIT.match(text)
    if match is None:
        raise ValueError(f"cannot read {what} {text!r}: write a number and a unit, e.g. {example!r}")
    return float(match.group(1)), match.group(2)


def _scale(prefix: str, text: str, what: str) -> float:
    low = prefix.lower()
    if low in _BINARY:
        return _BINARY[low]
    if low in _DECIMAL:
        return _DECIMAL[low]
    raise ValueError(f"{what} {text!r}: unknown prefix {prefix!r}; use k, M, G, T (decimal) or Ki, Mi, Gi, Ti")


def parse_bandwidth(text: str | float | int) -> float:
    """Bytes per second of ``"450GB/s"``, ``"25GiB/s"``, ``"1gbit"``, ``"400Gb/s"`` or ``"100mbit/s"``;
    must be positive.

    ``B`` means bytes and ``b``/``bit`` bits (``400Gb/s`` is 50 GB/s); a bare number and tc's ``bps``
    (bytes to tc, bits to most readers) are refused, naming the spellings that work.
    """
    value, unit = _split(text, "rate", "1gbit")
    body = unit[:-2] if unit.endswith("/s") else unit
    if body.lower().endswith("bps"):
        raise ValueError(f"rate {text!r}: 'bps' is bytes per second to tc and bits to most readers; write "
                         f"'{value:g}{body[:-3]}bit' for bits or '{value:g}{body[:-3].upper()}B/s' for bytes "
                         f"per second")
    if body.lower().endswith("bit"):
        rate = value * _scale(body[:-3], str(text), "rate") / 8
    elif body.endswith("b"):
        rate = value * _scale(body[:-1], str(text), "rate") / 8
    elif body.endswith("B") and unit.endswith("/s"):
        rate = value * _scale(body[:-1], str(text), "rate")
    else:
        raise ValueError(f"rate {text!r}: give bits per second ('1gbit', '400Gb/s') or bytes per second "
                         f"('1GB/s', '450GB/s')")
    if rate <= 0:
        raise ValueError(f"rate {text!r} must be positive")
    return rate


def parse_tc_rate(text: str) -> int:
    """Bits per second, as ``tc`` takes them, of any rate :func:`parse_bandwidth` reads (``"50mbit"`` ->
    50_000_000, ``"1GB/s"`` -> 8_000_000_000)."""
    return round(parse_bandwidth(text) * 8)


def parse_bytes(text: str) -> float:
    """``"80GiB"`` -> 85899345920.0, ``"40GB"`` -> 4e10. A bare number is refused, naming ``GiB`` and
    ``GB``: ``80`` is never meant as bytes, and the two readings differ by 7%."""
    value, unit = _split(text, "size", "80GiB")
    if unit == "":
        raise ValueError(f"size {text!r} has no unit: write '{value:g}GiB' (binary, as GPU memory is quoted) or "
                         f"'{value:g}GB' (decimal)")
    if not unit.endswith("B") or unit.endswith("/s"):
        raise ValueError(f"size {text!r}: end the unit with 'B' (bytes), e.g. '80GiB' or '40GB'")
    return value * _scale(unit[:-1], str(text), "size")


def parse_duration(text: str | float | int) -> float:
    """Seconds of ``"1ms"``, ``"500us"``, ``"1.5s"`` (tc's ``sec``, ``msec``, ``usec`` too); ``"0"`` means
    none, any other bare number is refused (us or ms?)."""
    value, unit = _split(text, "duration", "1ms")
    if unit == "" and value == 0:
        return 0.0
    if unit.lower() not in _SECONDS:
        raise ValueError(f"duration {text!r}: unknown unit {unit!r}; use one of d, h, min, s, ms, us, ns, e.g. '5us'")
    return value * _SECONDS[unit.lower()]


def parse_flops(text: str | float | int) -> float:
    """FLOP/s of ``"312TFLOPS"``, ``"312TFLOP/s"`` or ``"3.1e14"`` (a bare number is FLOP/s)."""
    value, unit = _split(text, "compute rate", "312TFLOPS")
    if unit == "":
        return value
    body = unit.upper().removesuffix("/S").removesuffix("S")
    if not body.endswith("FLOP"):
        raise ValueError(f"compute rate {text!r}: write FLOP/s with a prefix, e.g. '312TFLOPS'")
    return value * _scale(body[:-4], str(text), "compute rate")


# ---------------------------------------------------------------------------------------------------------
# Printing.
# ---------------------------------------------------------------------------------------------------------
def format_bytes(n: float, *, decimal: bool = False) -> str:
    """Binary units, as memory is sold (``2**33`` -> ``"8.0 GiB"``); ``decimal`` for bytes that crossed a
    link, in the units its rate is quoted in (``12_345_678`` -> ``"12.3 MB"``)."""
    for unit, scale in _DECIMAL_SIZES if decimal else _BINARY_SIZES:
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def format_rate(rate: float, *, bits: bool = False) -> str:
    """Bytes per second in decimal units (``5e10`` -> ``"50 GB/s"``); with ``bits``, ``rate`` is bits per
    second, written as tc spells it and :func:`parse_tc_rate` reads it back (``5e7`` -> ``"50mbit"``)."""
    prefix, scale = next(((p, s) for p, s in _RATE_PREFIXES if rate >= s), ("", 1.0))
    number = f"{rate / scale:.3g}"
    return f"{number}{prefix.lower()}bit" if bits else f"{number} {prefix}B/s"


def format_seconds(s: float) -> str:
    """``0.0123`` -> ``"12.3 ms"``."""
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.1f} ms"
    return f"{s * 1e6:.0f} us"


def format_count(n: float) -> str:
    """``6.7e9`` -> ``"6.7B"`` (parameter counts)."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.0f}"
