"""``hsdp coordinator``: the service the replicas of an elastic job meet on (``hsdp.init_mesh(elastic=True)``).

The serving itself is :mod:`hsdp.tools.coordinator.service`; this module holds the arguments and imports only
argparse until the command runs.
"""

from __future__ import annotations

import argparse
import sys

from hsdp.apps.cli.helptext import HelpFormatter

COORDINATOR_EPILOG = """\
examples:
  hsdp coordinator --port 29400 --replicas 4               # on one host, then on each replica group's host:
  HSDP_COORDINATOR=host0:29400 HSDP_REPLICA_ID=0 torchrun --nproc-per-node 8 --max-restarts 3 train.py
  hsdp coordinator --port 0 --replicas 3 --min-replicas 1  # a free port, printed

Each replica group (typically a node) is its own torchrun job whose ranks read HSDP_COORDINATOR (host:port),
HSDP_REPLICA_ID (0..replicas-1, unique per group) and HSDP_ELASTIC_JOB (the --job name). A replica that
dies costs the others one discarded step; restarted (torchrun --max-restarts), it rejoins and is healed from
a live replica. Below --min-replicas live replicas the job stops: the coordinator exits 5 s later, with
status 3 if some replicas were still alive, 0 if none was left. Once the last replicas finished training the
job is complete: a replica arriving later is told so and exits 0; the coordinator exits 0 after --linger.
Prints the address to export, one line per membership change (a replica left or joined, a discarded step)
and a summary at exit (also on Ctrl-C or SIGTERM: status 0). The coordinator is a single point of failure:
run it where it outlives the replicas.
"""


def add_coordinator(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``coordinator`` on ``subparsers`` (of the ``hsdp`` parser)."""
    p = subparsers.add_parser("coordinator", help="serve the membership and commit decisions of an elastic job",
                              description="Host the store the replicas of an elastic job meet on and decide,\n"
                                          "step by step, which replicas train together and whether each step\n"
                                          "commits.",
                              epilog=COORDINATOR_EPILOG, formatter_class=HelpFormatter)
    p.add_argument("--port", type=int, required=True, metavar="P",
                   help="TCP port of the store (0: a free one, printed)")
    p.add_argument("--host", default="0.0.0.0",
                   help="how the printed address names this machine (the store listens on every interface; "
                        "0.0.0.0 prints the host name)")
    p.add_argument("--replicas", type=int, required=True, metavar="N",
                   help="replica groups of the job, with ids 0..N-1 (HSDP_REPLICA_ID)")
    p.add_argument("--min-replicas", type=int, default=None, metavar="M",
                   help="live replicas needed to go on, 1..N (default: a majority, N // 2 + 1)")
    p.add_argument("--job", default="default", metavar="NAME",
                   help="the job's name, which the replicas read from HSDP_ELASTIC_JOB")
    p.add_argument("--heartbeat-timeout", type=float, default=3.0, metavar="S",
                   help="seconds of heartbeat silence after which a replica is dropped (above the replicas' "
                        "heartbeat interval, 0.25 s by default)")
    p.add_argument("--start-grace", type=float, default=10.0, metavar="S",
                   help="seconds to wait at the start for every replica before starting with the minimum")
    p.add_argument("--linger", type=float, default=5.0, metavar="S",
                   help="seconds to serve on once the job completed (its last replicas finished), telling a "
                        "replica that arrives late that the job is over (inf: until stopped)")
    p.add_argument("--nproc-per-replica", default=None, metavar="N,N,...",
                   help="each replica id's rank count, for replicas of different shard degrees (e.g. 2,1,1: "
                        "gradients are averaged over the pieces of the members' degrees, a joiner is healed from "
                        "a replica of any degree); default: every replica has the same count")
    p.set_defaults(func=run_coordinator)
    return p


def run_coordinator(args: argparse.Namespace) -> int:
    """Execute a parsed ``hsdp coordinator``; the exit status (2 for bad arguments, 0 once stopped)."""
    from hsdp.tools.coordinator.config import CoordinatorConfig

    try:
        counts = None if args.nproc_per_replica is None else _counts(args.nproc_per_replica)
        config = CoordinatorConfig(port=args.port, replicas=args.replicas, host=args.host,
                                   min_replicas=args.min_replicas, job=args.job,
                                   heartbeat_timeout=args.heartbeat_timeout, start_grace=args.start_grace,
                                   linger=args.linger, nproc_per_replica=counts)
    except ValueError as e:
        print(f"hsdp coordinator: error: {e}\nusage: hsdp coordinator --port PORT --replicas N [options]",
              file=sys.stderr)
        return 2
    from hsdp.tools.coordinator.service import serve

    return serve(config)


def _counts(text: str) -> tuple[int, ...]:
    """``2,1,1`` -> ``(2, 1, 1)``; ``ValueError`` naming the form."""
    try:
        return tuple(int(n) for n in text.split(","))
    except ValueError:
        raise ValueError(f"--nproc-per-replica {text!r}: give comma-separated rank counts, e.g. 2,1,1") from None
