"""One node's torchrun agent whose rendezvous store outlives every other agent.

``python -m hsdp.tools.launch.agent ARGS`` is ``python -m torch.distributed.run ARGS`` (same parser, same
agent, same exit status) plus an orderly exit, so that a successful job ends without a traceback.

Why: with the static rendezvous, node 0's agent hosts the store and every agent ends with torchrun's exit
barrier on it. That barrier is one-phase: an agent adds itself to a counter (the last one also sets a key),
then waits for the key in a further round trip. Node 0's agent may see the key, return and exit, taking the
store's server with it, while another agent's round trip is still to come or in flight; that agent then
logs "Error waiting on exit barrier ... Failed to recv" with a C++ traceback, although every rank succeeded
(a known torchrun race, pytorch/pytorch#69520). A loaded machine makes it common: the late agent needs only
to lose the CPU for the few milliseconds node 0 takes to exit.

The fix keeps the server until nobody needs it:

* node 0 opens the store's server before torchrun does; torchrun's own store is multi-tenant, so it joins
  that server instead of starting one, and the reference held here keeps the server alive when torchrun
  drops its own;
* every other agent, once torchrun returns, checks out with one counter increment: its last store call;
* node 0, once torchrun returns, waits (bounded) for every check-out before it exits. The server answers
  an agent's increment before it can answer node 0's next read of the counter, so no reply is lost.

A failed job skips all of this: whoever launched the agents stops them, and waiting would only delay that.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from datetime import timedelta
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported when an agent runs, not when the launcher builds its command
    from torch.distributed import TCPStore

CHECKED_OUT_KEY = "hsdp/agent/checked_out"  # outside torchrun's run-id prefix and the ranks' keys
CHECK_OUT_TIMEOUT_S = 30.0  # the other agents are past the exit barrier already: seconds at the most
_POLL_S = 0.01


def _store(args: argparse.Namespace, host: bool) -> TCPStore:
    from torch.distributed import TCPStore

    # multi_tenant on the host: torchrun's static rendezvous opens its store with multi_tenant=True on the
    # same port, which shares a live server of this process instead of binding the port again.
    return TCPStore(args.master_addr, args.master_port, None, host, timedelta(seconds=CHECK_OUT_TIMEOUT_S),
                    wait_for_workers=False, multi_tenant=host)


def _other_agents(args: argparse.Namespace) -> int:
    """How many agents besides this one share the static rendezvous (0: nothing to order)."""
    from torch.distributed.run import parse_min_max_nnodes

    if args.standalone or args.rdzv_backend != "static" or args.rdzv_endpoint or args.master_port is None:
        return 0  # another rendezvous, or a port torchrun chooses: its store is not ours to hold
    return parse_min_max_nnodes(args.nnodes)[1] - 1


def _wait_for_check_outs(store: TCPStore, expected: int) -> None:
    deadline = time.monotonic() + CHECK_OUT_TIMEOUT_S
    while store.add(CHECKED_OUT_KEY, 0) < expected:
        if time.monotonic() > deadline:
            print(f"hsdp agent: only {store.add(CHECKED_OUT_KEY, 0)} of {expected} other agents checked out "
                  f"within {CHECK_OUT_TIMEOUT_S:.0f} s; exiting anyway", file=sys.stderr, flush=True)
            return
        time.sleep(_POLL_S)


def _check_out(args: argparse.Namespace) -> None:
    # The host can only be gone if it failed after all (killed, say): its error is the one to show, not ours.
    with contextlib.suppress(Exception):
        _store(args, host=False).add(CHECKED_OUT_KEY, 1)


def main(argv: list[str] | None = None) -> None:
    """Run torchrun's agent with ``argv`` (``sys.argv[1:]`` by default); raise as torchrun does on failure."""
    from torch.distributed.run import main as torchrun_main
    from torch.distributed.run import parse_args

    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    others = _other_agents(args)
    host = others > 0 and args.node_rank == 0
    store = _store(args, host=True) if host else None
    torchrun_main(argv)  # raises on failure: no ordering then, see the module docstring
    if store is not None:
        _wait_for_check_outs(store, others)
    elif others > 0:
        _check_out(args)


if __name__ == "__main__":
    main()
