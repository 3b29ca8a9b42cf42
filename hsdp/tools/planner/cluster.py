"""What the planner knows about a cluster: nodes, ranks per node, memory, links and compute per rank.

These are also the constants ``hsdp tune`` calibrates: the achieved compute rate, the effective bandwidths
and the per-step latencies of both kinds of links. Everything is in SI base units (bytes, bytes/s, s,
FLOP/s); :mod:`hsdp.tools.quantities` reads the human spellings and :mod:`hsdp.tools.planner.presets` holds common
GPUs and interconnects.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hsdp.tools.quantities import format_bytes, format_rate


@dataclass(frozen=True)
class ClusterSpec:
    """``nodes`` x ``gpus_per_node`` ranks.

    Semantics of the link numbers (what the formulas assume):
      * ``intra_bandwidth``: bytes/s one rank sends to its ring neighbour inside a node, each direction
        (NVLink: about 450 GB/s on H100);
      * ``inter_bandwidth``: bytes/s one *node* sends to other nodes, each direction, all its NICs together
        (8 x 400 Gb/s = 400 GB/s; one 1 Gbit/s link = 125 MB/s). Rings of every group that leave the node
        share it;
      * ``*_latency``: cost of one ring step on that kind of link; ``collective_overhead``: fixed cost of
        every collective call (launch, synchronisation, Python on the CPU);
      * ``compute_rate``: FLOP/s one rank achieves on the model (peak x utilisation), and
        ``optimizer_s_per_element`` the optimizer step's seconds per parameter element it owns;
      * ``host_s_per_intra_byte`` / ``host_s_per_inter_byte``: compute time lost per byte a rank sends
        inside its node / to another node, which overlap cannot hide: 0 on GPUs (DMA engines move the
        bytes), nanoseconds on CPU ranks whose cores also run the copies and the TCP stack (more per byte
        over a 1500-byte-MTU link than over loopback's 64 KiB);
      * ``reduce_scatter_factor``: wire bytes of a reduce-scatter relative to a ring one: 1 for NCCL and for
        hsdp on gloo (its Comm reduce-scatters with an all-to-all there), 2 for gloo's own reduce-scatter,
        which is an all-reduce (FSDP2 on CPUs; measured on the emulated cluster: 1.50 x buffer over a node
        boundary at 4 ranks, where a ring would send 0.75 x).

    ``gpu_memory`` is bytes per rank (``math.inf``: no limit). ``ValueError`` names the field to fix.
    """

    nodes: int
    gpus_per_node: int
    gpu_memory: float
    intra_bandwidth: float
    inter_bandwidth: float
    compute_rate: float
    intra_latency: float = 5e-6
    inter_latency: float = 10e-6
    collective_overhead: float = 20e-6
    optimizer_s_per_element: float = 1e-11
    host_s_per_intra_byte: float = 0.0
    host_s_per_inter_byte: float = 0.0
    reduce_scatter_factor: float = 1.0
    name: str = ""

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.gpus_per_node < 1:
            raise ValueError(f"nodes={self.nodes} and gpus_per_node={self.gpus_per_node} must be at least 1")
        for field_name in ("gpu_memory", "intra_bandwidth", "inter_bandwidth", "compute_rate"):
            value = getattr(self, field_name)
            if not value > 0:
                raise ValueError(f"ClusterSpec.{field_name} must be positive, got {value!r}: pass it with a "
                                 f"unit, e.g. --gpu-memory 80GiB, --inter-node-bandwidth 50GB/s")
        for field_name in ("intra_latency", "inter_latency", "collective_overhead", "optimizer_s_per_element",
                           "host_s_per_intra_byte", "host_s_per_inter_byte"):
            if getattr(self, field_name) < 0 or math.isnan(getattr(self, field_name)):
                raise ValueError(f"ClusterSpec.{field_name} must be zero or positive")
        if self.reduce_scatter_factor not in (1.0, 2.0):
            raise ValueError("reduce_scatter_factor is 1 (ring, NCCL) or 2 (gloo: reduce-scatter as all-reduce)")

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    def describe(self) -> str:
        mem = "unlimited" if math.isinf(self.gpu_memory) else format_bytes(self.gpu_memory)
        return (f"{self.nodes} nodes x {self.gpus_per_node} ranks, {mem}/rank, "
                f"intra {format_rate(self.intra_bandwidth)}, inter {format_rate(self.inter_bandwidth)}/node, "
                f"{self.compute_rate / 1e12:.3g} TFLOP/s/rank")


def valid_degrees(world_size: int) -> list[int]:
    """Every shard degree the engine accepts: the divisors of the world size."""
    return [d for d in range(1, world_size + 1) if world_size % d == 0]
