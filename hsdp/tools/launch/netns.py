"""The emulated cluster network: one network namespace per node, joined by a bridge in a "switch" namespace.

Topology of a run (``R`` is the run's name, e.g. ``hsdp-3-4711-889123``)::

    ns R-n0: lo, hsdp-n0 10.213.X.1/24 ─veth─ hsdp-p0 ┐
    ns R-n1: lo, hsdp-n1 10.213.X.2/24 ─veth─ hsdp-p1 ┼ hsdp-br   (ns R-sw: the switch)
    ...                                                ┘

Why a switch namespace rather than a bridge in the root namespace: nothing of a run ever appears in the host's
own network stack (no interface, route, address or firewall rule), so a run cannot disturb the host and the
host's firewall cannot disturb a run; deleting the run's namespaces removes every link with them, and
interface names only need to be unique inside a namespace (the kernel's 15-character limit never bites).

Names encode the owning launcher, ``hsdp-<subnet>-<pid>-<start>``, where ``start`` is the launcher's start
time in clock ticks (from ``/proc``): a run whose launcher is gone, even by SIGKILL, is recognisable from the
names alone, and a recycled PID is not mistaken for the owner. Traffic between nodes only ever crosses the
node links, so the interface counters of ``hsdp-n<i>`` are exactly node ``i``'s inter-node traffic.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from hsdp.tools.launch.reaper import list_namespaces as reaper_list_namespaces
from hsdp.tools.launch.reaper import remove_namespaces
from hsdp.tools.launch.shaping import Shaping, shape_link

PREFIX = "hsdp"
SUBNET_PREFIX = "10.213"  # 10.213.X.0/24, X unique among live runs; private (RFC 1918), never routed out
BRIDGE = "hsdp-br"
_NAME = re.compile(rf"^{PREFIX}-(\d+)-(\d+)-(\d+)-(sw|n\d+)$")


class NetnsError(RuntimeError):
    """An ``ip``/``tc`` command failed; the message carries the command and its error output."""


@dataclass(frozen=True)
class Tools:
    """Absolute paths of the ``ip`` and ``tc`` programs (iproute2)."""

    ip: str
    tc: str


def find_tools(path: str | None = None) -> Tools | None:
    """``ip`` and ``tc`` as found on ``path`` (default: ``$PATH``), or ``None`` when either is missing."""
    ip, tc = shutil.which("ip", path=path), shutil.which("tc", path=path)
    return Tools(ip, tc) if ip and tc else None


def _run(argv: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(list(argv), capture_output=True, text=True, check=False)
    if check and proc.returncode != 0:
        raise NetnsError(f"{' '.join(argv)}: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


# ---------------------------------------------------------------------------------------------------------
# Names and addresses of a run.
# ---------------------------------------------------------------------------------------------------------
def process_start_ticks(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks after boot (``/proc/<pid>/stat`` field 22), ``None`` if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name (field 2) may contain spaces and parentheses: split after its closing one.
    return int(stat.rsplit(")", 1)[1].split()[19])


@dataclass(frozen=True)
class RunId:
    """Identity of one emulation run: its /24 index and its launcher (PID and start time)."""

    subnet: int
    owner_pid: int
    owner_start: int

    @property
    def name(self) -> str:
        """Common prefix of the run's namespace names."""
        return f"{PREFIX}-{self.subnet}-{self.owner_pid}-{self.owner_start}"

    def owner_alive(self) -> bool:
        """Whether the launcher that created the run still runs (same PID *and* same start time)."""
        return process_start_ticks(self.owner_pid) == self.owner_start

    @staticmethod
    def from_namespace(name: str) -> RunId | None:
        """The run a namespace belongs to, or ``None`` for namespaces hsdp did not create."""
        m = _NAME.match(name)
        return RunId(int(m.group(1)), int(m.group(2)), int(m.group(3))) if m else None


@dataclass(frozen=True)
class ClusterSpec:
    """An emulated cluster: ``nodes`` nodes whose links carry ``bandwidth_bit_s`` in each direction, with
    ``latency_s`` one-way node-to-node delay (0: none), under the names and subnet of ``run``."""

    nodes: int
    bandwidth_bit_s: int
    latency_s: float
    run: RunId

    def __post_init__(self) -> None:
        if not 1 <= self.nodes <= 250:
            raise ValueError(f"nodes={self.nodes}: an emulated cluster has 1 to 250 nodes (one /24)")
        if self.bandwidth_bit_s <= 0 or self.latency_s < 0:
            raise ValueError(f"bandwidth {self.bandwidth_bit_s} bit/s must be > 0, latency {self.latency_s} >= 0")

    @property
    def switch_namespace(self) -> str:
        return f"{self.run.name}-sw"

    @property
    def subnet(self) -> str:
        return f"{SUBNET_PREFIX}.{self.run.subnet}.0/24"

    def node(self, index: int) -> NodeLink:
        """Namespace, interface and address of node ``index``."""
        return NodeLink(index, f"{self.run.name}-n{index}", f"hsdp-n{index}",
                        f"{SUBNET_PREFIX}.{self.run.subnet}.{index + 1}")

    @property
    def master_addr(self) -> str:
        """Where node 0's torchrun agent serves the rendezvous."""
        return self.node(0).address


@dataclass(frozen=True)
class NodeLink:
    """Node ``index``: its namespace, its interface towards the switch and that interface's IPv4 address."""

    index: int
    namespace: str
    interface: str
    address: str

    @property
    def port(self) -> str:
        """The switch-side end of the node's link."""
        return f"hsdp-p{self.index}"

    def env(self) -> dict[str, str]:
        """Variables that pin the node's collectives to its link (else gloo may pick the loopback address)."""
        return {"GLOO_SOCKET_IFNAME": self.interface, "NCCL_SOCKET_IFNAME": self.interface}


@dataclass(frozen=True)
class LinkCounters:
    """Bytes a node's interface received and sent (kernel counters, Ethernet frames incl. headers)."""

    rx_bytes: int
    tx_bytes: int


# ---------------------------------------------------------------------------------------------------------
# Allocating a run: pick a free /24 under a lock so concurrent launchers never pick the same one.
# ---------------------------------------------------------------------------------------------------------
def list_namespaces(tools: Tools) -> list[str]:
    """Names of all named network namespaces (``ip netns list``)."""
    return reaper_list_namespaces(tools.ip)


def _used_subnets(tools: Tools) -> set[int]:
    used = {run.subnet for run in map(RunId.from_namespace, list_namespaces(tools)) if run}
    # Also skip a range the host itself uses: not needed for isolation (a run is sealed in its namespaces),
    # but it keeps `ip addr` on the host and in a run from showing the same addresses for different things.
    out = _run([tools.ip, "-j", "addr", "show"], check=False).stdout.strip()
    for link in json.loads(out) if out else []:
        for addr in link.get("addr_info", []):
            parts = str(addr.get("local", "")).split(".")
            if len(parts) == 4 and ".".join(parts[:2]) == SUBNET_PREFIX:
                used.add(int(parts[2]))
    return used


@contextlib.contextmanager
def allocated_run(tools: Tools) -> Iterator[RunId]:
    """A :class:`RunId` with a /24 no live run uses; hold the block until the switch namespace exists."""
    lock_path = os.path.join(tempfile.gettempdir(), f"{PREFIX}-netns.lock")
    with open(lock_path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
        used = _used_subnets(tools)
        free = next((i for i in range(256) if i not in used), None)
        if free is None:
            raise NetnsError(f"all 256 subnets {SUBNET_PREFIX}.X.0/24 are in use: run `hsdp launch --cleanup`")
        pid = os.getpid()
        start = process_start_ticks(pid)
        yield RunId(free, pid, start if start is not None else 0)


# ---------------------------------------------------------------------------------------------------------
# Creating, reading and removing the namespaces of a run.
# ---------------------------------------------------------------------------------------------------------
class EmulatedCluster:
    """The namespaces, links and shaping of one :class:`ClusterSpec`.

    ``create_switch()`` then ``create_nodes()`` build it (split so the caller can release the allocation
    lock once the switch namespace reserves the subnet); ``counters()`` reads each node's link;
    ``teardown()`` removes everything and may be called any number of times, also after a partial setup.
    """

    def __init__(self, tools: Tools, spec: ClusterSpec) -> None:
        self.tools = tools
        self.spec = spec
        self.latency_emulated = False

    def _ip(self, *args: str) -> None:
        _run([self.tools.ip, *args])

    def create_switch(self) -> None:
        """The switch namespace and its bridge (no address: a pure layer-2 switch)."""
        sw = self.spec.switch_namespace
        self._ip("netns", "add", sw)
        self._ip("-n", sw, "link", "add", BRIDGE, "type", "bridge")
        self._ip("-n", sw, "link", "set", BRIDGE, "addrgenmode", "none")  # silent: see _create_node
        self._ip("-n", sw, "link", "set", BRIDGE, "up")

    def create_nodes(self) -> None:
        """One namespace per node, linked to the switch by a veth pair shaped in both directions."""
        try_netem = True
        for i in range(self.spec.nodes):
            try_netem = self._create_node(self.spec.node(i), try_netem)

    def _create_node(self, node: NodeLink, try_netem: bool) -> bool:
        sw, ns = self.spec.switch_namespace, node.namespace
        self._ip("netns", "add", ns)
        self._ip("-n", ns, "link", "set", "lo", "up")  # ranks of one node talk over the loopback
        # Created inside the switch namespace with the peer moved straight into the node's: no interface
        # of the run exists in the host's namespace, not even for a moment.
        self._ip("-n", sw, "link", "add", node.port, "type", "veth", "peer", "name", node.interface, "netns", ns)
        # No IPv6 link-local addresses: without them the link stays silent (no neighbour discovery or MLD
        # chatter), so its counters hold the job's traffic and nothing else.
        self._ip("-n", sw, "link", "set", node.port, "addrgenmode", "none")
        self._ip("-n", sw, "link", "set", node.port, "master", BRIDGE, "up")
        self._ip("-n", ns, "link", "set", node.interface, "addrgenmode", "none")
        self._ip("-n", ns, "addr", "add", f"{node.address}/24", "dev", node.interface)
        self._ip("-n", ns, "link", "set", node.interface, "up")
        shaping = Shaping(self.spec.bandwidth_bit_s, self.spec.latency_s / 2)  # half the delay per hop
        up = shape_link(self.tools.tc, ns, node.interface, shaping, try_netem=try_netem)
        down = shape_link(self.tools.tc, sw, node.port, shaping, try_netem=up)
        self.latency_emulated = up and down
        return up  # the kernel lacks netem: do not try it again for every node

    def counters(self) -> list[LinkCounters]:
        """Per node, the bytes its interface received and sent since the link was created."""
        result = []
        for i in range(self.spec.nodes):
            node = self.spec.node(i)
            out = _run([self.tools.ip, "-n", node.namespace, "-s", "-j", "link", "show", "dev", node.interface])
            stats = json.loads(out.stdout)[0]["stats64"]
            result.append(LinkCounters(int(stats["rx"]["bytes"]), int(stats["tx"]["bytes"])))
        return result

    def teardown(self) -> list[str]:
        """Stop what still runs in the run's namespaces and delete them (and with them every link)."""
        return remove_run(self.tools, self.spec.run)


def remove_run(tools: Tools, run: RunId) -> list[str]:
    """Delete every namespace of ``run`` after stopping the processes in it; return the names removed.
    Idempotent (see :func:`hsdp.tools.launch.reaper.remove_namespaces`, which does the work)."""
    return remove_namespaces(tools.ip, run.name)


def cleanup_leftovers(tools: Tools) -> list[str]:
    """Remove the namespaces (and so the links and processes) of every run whose launcher is gone.

    Runs whose launcher is alive are left alone, so this is safe while other runs are in progress.
    Returns the namespace names removed.
    """
    dead = {run for run in map(RunId.from_namespace, list_namespaces(tools)) if run and not run.owner_alive()}
    return [ns for run in sorted(dead, key=lambda r: r.name) for ns in remove_run(tools, run)]
