"""Removing a run's namespaces and the processes inside them, also from a watchdog that outlives the launcher.

The launcher's own ``finally`` and signal handlers cover errors, Ctrl-C and SIGTERM, but nothing in a process
survives SIGKILL. So each emulated run first starts this file as a small process (:class:`Reaper`): it blocks
reading a pipe whose only writer is the launcher. The kernel closes that pipe when the launcher exits for any
reason, the read returns end-of-file, and the reaper removes the run: its namespaces, the processes in them
and its scratch directory of torchrun logs. After a normal exit the launcher has already torn everything down
and the reaper finds nothing to do.

This module imports nothing but the standard library and is started by its file path, not as
``-m hsdp.tools.launch.reaper``: importing the ``hsdp`` package would load torch, seconds of start-up and hundreds
of MB held for the whole run by a process that only waits.

``hsdp launch --cleanup`` remains for what even this cannot catch (the machine or container going down).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

_KILL_GRACE_S = 3.0


def list_namespaces(ip: str) -> list[str]:
    """Names of all named network namespaces (``ip netns list``)."""
    out = subprocess.run([ip, "-j", "netns", "list"], capture_output=True, text=True, check=False).stdout.strip()
    return [entry["name"] for entry in json.loads(out)] if out else []


def _pids_in(ip: str, namespace: str) -> list[int]:
    out = subprocess.run([ip, "netns", "pids", namespace], capture_output=True, text=True, check=False).stdout
    return [int(p) for p in out.split() if p.isdigit()]


def _stop_processes(ip: str, namespaces: Sequence[str]) -> None:
    # Only processes inside the run's own namespaces: every one of them was started by the run's launcher.
    for sig in (signal.SIGTERM, signal.SIGKILL):
        deadline = time.monotonic() + (_KILL_GRACE_S if sig == signal.SIGTERM else 0.0)
        pids = [p for ns in namespaces for p in _pids_in(ip, ns)]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        while pids and time.monotonic() < deadline:
            time.sleep(0.05)
            pids = [p for ns in namespaces for p in _pids_in(ip, ns)]
        if not pids:
            return


def remove_namespaces(ip: str, run_name: str) -> list[str]:
    """Delete every namespace of the run ``run_name`` (``<run_name>-sw``, ``<run_name>-n<i>``) after stopping
    the processes in them; return the names removed.

    Idempotent: namespaces already gone are skipped. Nodes go first and the switch last, so the subnet stays
    reserved until the run is completely gone.
    """
    pattern = re.compile(rf"^{re.escape(run_name)}-(sw|n\d+)$")
    mine = sorted((ns for ns in list_namespaces(ip) if pattern.match(ns)), key=lambda ns: ns.endswith("-sw"))
    _stop_processes(ip, mine)
    return [ns for ns in mine
            if subprocess.run([ip, "netns", "del", ns], capture_output=True, check=False).returncode == 0]


class Reaper:
    """The watchdog of one run; :meth:`release` ends it once the launcher has cleaned up itself."""

    def __init__(self, run_name: str, ip: str, scratch_dir: str) -> None:
        # Own session: Ctrl-C in the terminal reaches the launcher's process group, not the reaper, which must
        # outlive the launcher to do its job. The pipe's write end stays in the launcher only (Popen keeps it
        # close-on-exec), so the agents the launcher starts later cannot hold it open.
        self._proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), run_name, ip, scratch_dir],
                                      stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, start_new_session=True)

    def release(self, timeout_s: float = 15.0) -> None:
        """Close the pipe (the reaper then removes anything left of the run) and wait for it to exit."""
        if self._proc.stdin is not None and not self._proc.stdin.closed:
            self._proc.stdin.close()
        try:
            self._proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


def main(argv: list[str] | None = None) -> int:
    """``python reaper.py RUN_NAME IP SCRATCH_DIR``: wait for end-of-file on stdin, then remove the run's
    namespaces and its scratch directory (torchrun's per-rank logs)."""
    run_name, ip, scratch_dir = argv if argv is not None else sys.argv[1:]
    # Ctrl-C of the launcher's terminal or a SIGHUP as the terminal closes must not stop the one process
    # that cleans up after the launcher.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    while sys.stdin.buffer.read(65536):
        pass
    removed = remove_namespaces(ip, run_name)
    shutil.rmtree(scratch_dir, ignore_errors=True)
    if removed:
        print(f"hsdp reaper: launcher gone, removed {', '.join(removed)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
