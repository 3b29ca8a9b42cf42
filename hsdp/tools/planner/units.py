"""Reading and printing the quantities a plan is made of: bytes, bandwidths, latencies, compute rates.

Every parser returns SI base units (bytes, bytes per second, seconds, FLOP/s) as floats, so the formulas
never see a unit suffix. Bandwidth accepts both the network spelling (bits: ``1gbit``, ``100mbit``, ``400Gb/s``)
and the accelerator spelling (bytes: ``450GB/s``, ``25GiB/s``): link rates are quoted in bits, NVLink in
bytes, and a silent 8x error is the classic planning mistake, so a bare number without a unit is refused.
"""

from __future__ import annotations

import re

_NUMBER_UNIT = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z/]*)\s*$")
_PREFIX = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "p": 1e15}
_BINARY = {"ki": 2.0**10, "mi": 2.0**20, "gi": 2.0**30, "ti": 2.0**40}
_TIME = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}


def _split(text: str | float | int, what: str, example: str) -> tuple[float, str]:
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
    if low in _PREFIX:
        return _PREFIX[low]
    raise ValueError(f"{what} {text!r}: unknown prefix {prefix!r}; use k, M, G, T (decimal) or Ki, Mi, Gi, Ti")


def parse_bytes(text: str | float | int) -> float:
    """``"80GiB"`` -> 85899345920.0, ``"40GB"`` -> 4e10; a bare number is bytes."""
    value, unit = _split(text, "size", "80GiB")
    if unit == "":
        return value
    if not unit.endswith("B") or unit.endswith("/s"):
        raise ValueError(f"size {text!r}: end the unit with 'B' (bytes), e.g. '80GiB' or '40GB'")
    return value * _scale(unit[:-1], str(text), "size")


def parse_bandwidth(text: str | float | int) -> float:
    """Bytes per second of ``"450GB/s"``, ``"25GiB/s"``, ``"1gbit"``, ``"400Gb/s"`` or ``"100mbit/s"``.

    ``B`` means bytes and ``b``/``bit`` bits (``400Gb/s`` is 50 GB/s); a bare number is refused because
    the two readings differ by 8x.
    """
    value, unit = _split(text, "bandwidth", "450GB/s")
    body = unit[:-2] if unit.endswith("/s") else unit
    if body.lower().endswith("bit"):
        return value * _scale(body[:-3], str(text), "bandwidth") / 8
    if body.endswith("b"):
        return value * _scale(body[:-1], str(text), "bandwidth") / 8
    if body.endswith("B") and unit.endswith("/s"):
        return value * _scale(body[:-1], str(text), "bandwidth")
    raise ValueError(f"bandwidth {text!r}: give bytes per second ('450GB/s') or bits ('1gbit', '400Gb/s')")


def parse_duration(text: str | float | int) -> float:
    """Seconds of ``"5us"``, ``"1.5ms"``, ``"0"``; a bare non-zero number is refused (us or ms?)."""
    value, unit = _split(text, "latency", "5us")
    if unit == "" and value == 0:
        return 0.0
    if unit.lower() not in _TIME:
        raise ValueError(f"latency {text!r}: use one of {', '.join(_TIME)} as the unit, e.g. '5us'")
    return value * _TIME[unit.lower()]


def parse_flops(text: str | float | int) -> float:
    """FLOP/s of ``"312TFLOPS"``, ``"312TFLOP/s"`` or ``"3.1e14"`` (a bare number is FLOP/s)."""
    value, unit = _split(text, "compute rate", "312TFLOPS")
    if unit == "":
        return value
    body = unit.upper().removesuffix("/S").removesuffix("S")
    if not body.endswith("FLOP"):
        raise ValueError(f"compute rate {text!r}: write FLOP/s with a prefix, e.g. '312TFLOPS'")
    return value * _scale(body[:-4], str(text), "compute rate")


def parse_count(text: str | float | int) -> float:
    """``"7b"`` -> 7e9, ``"350m"`` -> 3.5e8, ``"125M"`` -> 1.25e8 (model sizes)."""
    value, unit = _split(text, "count", "7b")
    mult = {"": 1.0, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}
    if unit.lower() not in mult:
        raise ValueError(f"count {text!r}: use k, m, b or t as the suffix, e.g. '7b'")
    return value * mult[unit.lower()]


def fmt_bytes(n: float) -> str:
    """Binary units, as memory is sold: ``fmt_bytes(2**33)`` -> ``"8.0 GiB"``."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def fmt_rate(bytes_per_s: float) -> str:
    """Decimal bytes per second: ``fmt_rate(5e10)`` -> ``"50 GB/s"``."""
    for unit, scale in (("TB/s", 1e12), ("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)):
        if bytes_per_s >= scale:
            return f"{bytes_per_s / scale:.3g} {unit}"
    return f"{bytes_per_s:.3g} B/s"


def fmt_seconds(s: float) -> str:
    """``fmt_seconds(0.0123)`` -> ``"12.3 ms"``."""
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.1f} ms"
    return f"{s * 1e6:.0f} us"


def fmt_count(n: float) -> str:
    """``fmt_count(6.7e9)`` -> ``"6.7B"``."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.0f}"
