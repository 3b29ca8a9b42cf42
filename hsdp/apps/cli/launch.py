"""``hsdp launch`` and ``hsdp demo``: the commands that start a job on emulated nodes of this machine.

The launching itself is :mod:`hsdp.tools.launch`; this module holds the arguments and imports only argparse
until a command runs.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from hsdp.apps.cli.helptext import RATE_UNITS, HelpFormatter

if TYPE_CHECKING:  # the launcher's modules are imported when the command runs
    from hsdp.tools.launch.elastic import ElasticOptions

ELASTIC_RESTARTS = 3  # hsdp.tools.launch.elastic.DEFAULT_RESTARTS, spelled here so --help imports nothing

LAUNCH_EPILOG = """\
examples:
  hsdp launch --nodes 2 --nproc-per-node 2 -- train.py --epochs 1
  hsdp launch --inter-node-bandwidth 50mbit --stats-json traffic.json -- -m my.module
  hsdp launch --nodes 2 --nproc-per-node 2 --node-cpus 1.0,0.5 -- train.py
  hsdp launch --nproc-per-node 4,2 -- train.py      # 2 nodes: ranks 0-3 on node 0, 4-5 on node 1
  hsdp launch --elastic --nodes 3 --nproc-per-node 2 -- train.py   # 3 replicas, each restarted on failure
  hsdp launch --cleanup

With root and iproute2, every node is a network namespace behind a shaped link and the run ends with a
table of the bytes each node sent and received over it. Otherwise the nodes run as local processes on
loopback (a one-line warning says why; --require-emulation makes that an error). --node-cpus caps each
node's agent and ranks at a CPU budget (a cgroup v1 cpu group per node, root needed), in either mode.
--nproc-per-node with one count per node emulates nodes of different sizes: ranks are numbered node-major
(LOCAL_WORLD_SIZE is the node's count, WORLD_SIZE the sum); the list's length is the node count.

--elastic makes every node one replica of an elastic job (hsdp.init_mesh(elastic=True)): its own torchrun
job (--standalone --nnodes 1 --max-restarts K; WORLD_SIZE is the node's ranks) whose ranks get
HSDP_COORDINATOR, HSDP_REPLICA_ID (the node index) and HSDP_ELASTIC_JOB, plus an `hsdp coordinator` on
node 0 that this launch starts first and stops last. A node whose rank dies is restarted by its torchrun and
rejoins while the others go on; the launch ends when every node has ended, with the first failed node's
status (0 when none failed past its restarts). Nodes of different rank counts (--nproc-per-node 2,1,1) are
replicas of different shard degrees: the coordinator is told each node's count (--nproc-per-replica).
"""


def add_launch(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``launch`` on ``subparsers`` (of the ``hsdp`` parser)."""
    p = subparsers.add_parser("launch", help="run a torchrun job on an emulated multi-node cluster",
                              description="Run SCRIPT under torchrun on N emulated nodes with shaped links.",
                              epilog=LAUNCH_EPILOG, formatter_class=HelpFormatter)
    p.add_argument("--nodes", type=int, default=None,
                   help="emulated nodes, one torchrun agent each (default: 2, or the length of a "
                        "--nproc-per-node list, which it must then equal)")
    p.add_argument("--nproc-per-node", default="1", metavar="N[,N...]",
                   help="ranks per node: one count for every node, or one per node, comma-separated (e.g. 4,2: "
                        "the list's length is the node count)")
    p.add_argument("--inter-node-bandwidth", default="1gbit",
                   help=f"rate of each node's link, each direction: {RATE_UNITS}")
    p.add_argument("--inter-node-latency", default="0",
                   help="one-way node-to-node delay, e.g. 1ms or 500us; needs the kernel's netem")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--require-emulation", action="store_true",
                      help="fail instead of falling back to loopback when the network cannot be emulated")
    mode.add_argument("--no-emulation", action="store_true",
                      help="run the nodes on loopback on purpose (a baseline without shaping or counters)")
    p.add_argument("--node-cpus", metavar="CPUS",
                   help="CPU budget of each node's agent and ranks, comma-separated floats (e.g. 1.0,0.5) or one "
                        "value for every node; a cgroup v1 cpu group per node (needs root)")
    p.add_argument("--stats-json", metavar="FILE", help="also write the per-node traffic report as JSON")
    p.add_argument("--elastic", action="store_true",
                   help="every node one replica of an elastic job (its own torchrun job), with a coordinator")
    p.add_argument("--max-restarts", type=int, default=None, metavar="K",
                   help=f"with --elastic: torchrun restarts of each node before it counts as failed (default: "
                        f"{ELASTIC_RESTARTS})")
    p.add_argument("--min-replicas", type=int, default=None, metavar="M",
                   help="with --elastic: live nodes needed to go on (default: a majority)")
    p.add_argument("--heartbeat-timeout", type=float, default=None, metavar="S",
                   help="with --elastic: seconds of heartbeat silence after which the coordinator drops a node "
                        "(default: hsdp coordinator's; raise it on a machine too busy to beat in time)")
    p.add_argument("--cleanup", action="store_true",
                   help="remove namespaces, links and processes left by runs whose launcher died, then exit")
    p.add_argument("script_args", nargs=argparse.REMAINDER, metavar="-- SCRIPT [ARGS...]",
                   help="the training script (or -m module) and its arguments")
    p.set_defaults(func=run_launch)
    return p


def run_launch(args: argparse.Namespace) -> int:
    """Execute a parsed ``hsdp launch``; the process exit status (2 for bad arguments)."""
    from hsdp.tools.launch.cpu_groups import parse_node_cpus
    from hsdp.tools.launch.emulated import USAGE_ERROR, LaunchOptions, cleanup, launch
    from hsdp.tools.launch.layout import parse_nproc_per_node, resolve_nodes

    if args.cleanup:
        return cleanup()
    script = list(args.script_args)
    if script[:1] == ["--"]:
        script = script[1:]
    try:
        node_cpus = parse_node_cpus(args.node_cpus) if args.node_cpus is not None else None
        nproc_per_node = parse_nproc_per_node(args.nproc_per_node)
        nodes = resolve_nodes(args.nodes, nproc_per_node)
        options = LaunchOptions(tuple(script), nodes=nodes, nproc_per_node=nproc_per_node,
                                bandwidth=args.inter_node_bandwidth, latency=args.inter_node_latency,
                                require_emulation=args.require_emulation, no_emulation=args.no_emulation,
                                stats_json=args.stats_json, node_cpus=node_cpus, elastic=_elastic(args))
    except ValueError as e:  # a bad rate, duration, count, CPU budget or no script: a usage error, not a traceback
        print(f"hsdp launch: error: {e}\nusage: hsdp launch [options] -- SCRIPT [ARGS...]", file=sys.stderr)
        return USAGE_ERROR
    return launch(options)


def _elastic(args: argparse.Namespace) -> ElasticOptions | None:
    """The elastic options of ``args`` (``None`` without ``--elastic``); ``ValueError`` for an elastic-only
    option without it."""
    from hsdp.tools.launch.elastic import ElasticOptions

    if not args.elastic:
        given = [flag for flag, value in (("--max-restarts", args.max_restarts), ("--min-replicas", args.min_replicas),
                                          ("--heartbeat-timeout", args.heartbeat_timeout)) if value is not None]
        if given:
            raise ValueError(f"{' and '.join(given)} only apply to an elastic job: add --elastic (without it one "
                             f"rank's failure ends the whole job, and no node is restarted)")
        return None
    restarts = ELASTIC_RESTARTS if args.max_restarts is None else args.max_restarts
    return ElasticOptions(max_restarts=restarts, min_replicas=args.min_replicas,
                          heartbeat_timeout=args.heartbeat_timeout)


def add_demo(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``demo`` on ``subparsers``."""
    p = subparsers.add_parser("demo", help="train a tiny GPT with HSDP on emulated nodes of this machine",
                              formatter_class=HelpFormatter,
                              description="hsdp train with the demo's preset: one torchrun agent per emulated "
                                          "node (loopback), a temporary run directory, a summary of what "
                                          "sharding saves.")
    p.add_argument("--nodes", type=int, default=2, help="emulated nodes (default: 2)")
    p.add_argument("--nproc-per-node", type=int, default=2, help="ranks per node = shard degree (default: 2)")
    p.add_argument("--steps", type=int, default=None, help="training steps (default: the demo preset's, 100)")
    p.set_defaults(func=run_demo)
    return p


def run_demo(args: argparse.Namespace) -> int:
    """Execute a parsed ``hsdp demo``: the demo's exit status."""
    from hsdp.apps.demo import launch

    return launch(args.nodes, args.nproc_per_node, args.steps)
