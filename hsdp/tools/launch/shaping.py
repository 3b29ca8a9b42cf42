"""Shaping one direction of an emulated link with tc: a token bucket (tbf) for the rate, netem for delay.

Each node link is shaped on *egress* at both of its ends: on the node's interface (node -> switch) and on
the switch port (switch -> node). Egress is where Linux queues, so no ingress redirection (ifb) is needed,
and the two directions are limited independently, like a full-duplex NIC.

Latency: the ``--inter-node-latency`` is the one-way node-to-node delay. A packet crosses two shaped egress
points (the sender's interface, then the receiver's switch port), so each adds half. netem is the only qdisc
that delays; many slim kernels ship without it, which :func:`shape_link` reports as a note rather than an
error: a bandwidth-only emulation is still the main thing HSDP experiments need.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass

# Queue room at the rate limit, as time: enough for TCP to keep the link busy (tens of ms covers the
# bandwidth-delay product of these emulated links) without bufferbloat worth the name.
_QUEUE_S = 0.05
# Bucket depth, as time at the line rate: deep enough for ~4 ms bursts (timer slack on a busy 2-core
# machine would otherwise cap the rate below the setting), never under a few full-size frames.
_BURST_S = 0.004
_MIN_BURST_BYTES = 16 * 1024


@dataclass(frozen=True)
class Shaping:
    """How one link direction is limited: ``rate_bit_s`` bits per second and ``delay_s`` extra delay."""

    rate_bit_s: int
    delay_s: float = 0.0


class ShapingError(RuntimeError):
    """tc refused a qdisc; the message carries tc's own error."""


def tbf_args(rate_bit_s: int) -> list[str]:
    """tc arguments of a token bucket holding ``rate_bit_s`` (``burst`` and ``latency`` sized here)."""
    rate_bytes = rate_bit_s / 8
    burst = max(_MIN_BURST_BYTES, int(rate_bytes * _BURST_S))
    return ["tbf", "rate", f"{rate_bit_s}bit", "burst", str(burst), "latency", f"{int(_QUEUE_S * 1e6)}us"]


def _tc(tc: str, namespace: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([tc, "-n", namespace, *args], capture_output=True, text=True, check=False)


def _check(proc: subprocess.CompletedProcess[str], what: str) -> None:
    if proc.returncode != 0:
        raise ShapingError(f"{what}: {' '.join(proc.args)}: {proc.stderr.strip() or proc.stdout.strip()}")


def _netem_then_tbf(tc: str, namespace: str, device: str, shaping: Shaping) -> subprocess.CompletedProcess[str]:
    # netem at the root delays; the tbf below it limits the rate (the recipe of tc-netem(8)).
    delay_us = max(1, round(shaping.delay_s * 1e6))
    root = _tc(tc, namespace, "qdisc", "replace", "dev", device, "root", "handle", "1:",
               "netem", "delay", f"{delay_us}us", "limit", "100000")
    if root.returncode != 0:
        return root
    child = _tc(tc, namespace, "qdisc", "replace", "dev", device, "parent", "1:1", "handle", "10:",
                *tbf_args(shaping.rate_bit_s))
    _check(child, f"rate limit under netem on {device}")
    return child


def shape_link(tc: str, namespace: str, device: str, shaping: Shaping, *, try_netem: bool = True) -> bool:
    """Install ``shaping`` as the egress qdisc of ``device`` inside ``namespace``.

    Returns whether the delay is emulated: ``False`` when ``shaping.delay_s`` is 0, when ``try_netem`` is
    off, or when the kernel has no netem (then only the rate is limited; the caller prints the note).
    Raises :class:`ShapingError` when even the rate limit cannot be installed.
    """
    if shaping.delay_s > 0 and try_netem:
        if _netem_then_tbf(tc, namespace, device, shaping).returncode == 0:
            return True
        # No netem here: drop any half-installed root before falling back to the rate limit alone.
        _tc(tc, namespace, "qdisc", "del", "dev", device, "root")
    proc = _tc(tc, namespace, "qdisc", "replace", "dev", device, "root", *tbf_args(shaping.rate_bit_s))
    _check(proc, f"rate limit on {device}")
    return False


def netem_missing_note(delay_s: float) -> str:
    """The one-line note printed when the latency cannot be emulated."""
    return (f"note: this kernel has no netem qdisc, so the inter-node latency ({delay_s * 1e3:g} ms) is not "
            f"emulated; the bandwidth limit still applies")
