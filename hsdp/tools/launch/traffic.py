"""The per-node inter-node traffic report of an emulated run: a table for people, JSON for benchmarks.

The numbers are the kernel's byte counters of each node's link, read before the agents start and after they
all exit: everything the node sent to or received from other nodes during the job, whatever program sent it
(torchrun's rendezvous, gloo, NCCL, a peer's library). Traffic between ranks of the same node stays on that
node's loopback and is not in them. They count Ethernet frames, so they include the TCP/IP/Ethernet headers:
a few percent above the payload bytes a collective moves.

Each row also names the node's global ranks (``0-3``), so a heterogeneous layout (``--nproc-per-node 4,2``)
reads off the table. The JSON keeps the format of uniform runs: ``nproc_per_node`` is the single count when
every node runs as many ranks, and the list of per-node counts otherwise; ``world_size`` is their sum.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rich.console import Console
from rich.table import Table

from hsdp.tools.launch.layout import NodeLayout
from hsdp.tools.launch.netns import ClusterSpec, LinkCounters
from hsdp.tools.quantities import format_bytes, format_rate


@dataclass(frozen=True)
class NodeTraffic:
    """Bytes node ``node`` sent to and received from the other nodes during the job."""

    node: int
    address: str
    interface: str
    sent_bytes: int
    received_bytes: int


@dataclass(frozen=True)
class TrafficReport:
    """Outcome of one launch: the setting, the exit status, the wall time and (when emulated) the traffic.

    ``nproc_per_node`` is the ranks of every node, or one count per node when they differ
    (:attr:`NodeLayout.nproc_per_node`). ``nodes`` is empty when the run fell back to loopback, where
    inter-node bytes cannot be told apart.
    """

    emulated: bool
    num_nodes: int
    nproc_per_node: int | tuple[int, ...]
    exit_code: int
    elapsed_s: float
    bandwidth_bit_s: int | None = None
    latency_s: float | None = None
    latency_emulated: bool = False
    nodes: tuple[NodeTraffic, ...] = field(default_factory=tuple)

    @property
    def total_inter_node_bytes(self) -> int:
        """Bytes that crossed from one node to another (each counted once, on the sending side)."""
        return sum(n.sent_bytes for n in self.nodes)

    @property
    def layout(self) -> NodeLayout:
        """The ranks of each node."""
        return NodeLayout.of(self.nproc_per_node, self.num_nodes)


def node_traffic(spec: ClusterSpec, before: Sequence[LinkCounters], after: Sequence[LinkCounters]) -> tuple[
        NodeTraffic, ...]:
    """Per node, the counter increase between ``before`` and ``after`` (sent = tx, received = rx)."""
    return tuple(
        NodeTraffic(i, spec.node(i).address, spec.node(i).interface, a.tx_bytes - b.tx_bytes, a.rx_bytes - b.rx_bytes)
        for i, (b, a) in enumerate(zip(before, after))
    )


def traffic_table(report: TrafficReport) -> Table:
    """A rich table with one row per node and a total row."""
    setting = format_rate(report.bandwidth_bit_s, bits=True) if report.bandwidth_bit_s else "?"
    if report.latency_s:
        setting += f", {report.latency_s * 1e3:g} ms" + ("" if report.latency_emulated else " (not emulated)")
    table = Table(title=f"Inter-node traffic ({setting} links, {report.elapsed_s:.1f} s)")
    for name in ("node", "ranks", "address", "sent", "received", "sent (bytes)", "received (bytes)"):
        table.add_column(name, justify="left" if name in ("node", "ranks", "address") else "right")
    layout = report.layout
    for n in report.nodes:
        table.add_row(str(n.node), layout.rank_span(n.node), n.address, format_bytes(n.sent_bytes, decimal=True),
                      format_bytes(n.received_bytes, decimal=True),
                      str(n.sent_bytes), str(n.received_bytes))
    received = sum(n.received_bytes for n in report.nodes)
    total = report.total_inter_node_bytes
    table.add_row("total", str(layout.world_size), "", format_bytes(total, decimal=True),
                  format_bytes(received, decimal=True), str(total), str(received), style="bold")
    return table


def print_report(report: TrafficReport, console: Console | None = None) -> None:
    """Print the table, or one line saying why there is none (loopback fallback; plus the ranks of each node
    when they differ)."""
    console = console or Console()
    if not report.emulated:
        console.print("no inter-node traffic table: the nodes ran on the loopback, where inter-node and "
                      "intra-node bytes are indistinguishable")
        if not report.layout.uniform:
            console.print(f"ranks per node: {report.layout.describe()}")
        return
    console.print(traffic_table(report))


def write_json(report: TrafficReport, path: str | Path) -> None:
    """Write ``report`` as JSON (the dataclass fields, plus ``world_size`` and ``total_inter_node_bytes``) to
    ``path``; ``nproc_per_node`` is a number for uniform nodes, a list of per-node counts otherwise."""
    data = asdict(report)
    data["world_size"] = report.layout.world_size
    data["total_inter_node_bytes"] = report.total_inter_node_bytes
    Path(path).write_text(json.dumps(data, indent=2) + "\n")
