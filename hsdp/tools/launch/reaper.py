"""Removing a run's namespaces and cpu groups and the processes inside them, also from a watchdog that outlives
the launcher.

The launcher's own ``finally`` and signal handlers cover errors, Ctrl-C and SIGTERM, but nothing in a process
survives SIGKILL. So each emulated run (and each loopback run with ``--node-cpus``) first starts this file as a
small process (:class:`Reaper`): it blocks reading a pipe whose only writer is the launcher. The kernel closes
that pipe when the launcher exits for any reason, the read returns end-of-file, and the reaper removes the run:
its namespaces, its cpu groups, the processes in either and its scratch directory of torchrun logs. After a
normal exit the launcher has already torn everything down and the reaper finds nothing to do.

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
from collections.abc import Callable, Sequence

_KILL_GRACE_S = 3.0
_RMDIR_WAIT_S = 5.0  # a killed process leaves its cgroup a moment after it is signalled
_CPU_GROUP = re.compile(r"^hsdp-\d+-\d+-\d+-n\d+$")  # hsdp.tools.launch.netns.RunId's names, nodes only


def list_namespaces(ip: str) -> list[str]:
    """Names of all named network namespaces (``ip netns list``)."""
    out = subprocess.run([ip, "-j", "netns", "list"], capture_output=True, text=True, check=False).stdout.strip()
    return [entry["name"] for entry in json.loads(out)] if out else []


def _pids_in(ip: str, namespace: str) -> list[int]:
    out = subprocess.run([ip, "netns", "pids", namespace], capture_output=True, text=True, check=False).stdout
    return [int(p) for p in out.split() if p.isdigit()]


def _stop_processes(ip: str, namespaces: Sequence[str]) -> None:
    # Only processes inside the run's own namespaces: every one of them was started by the run's launcher.
    _stop(lambda: [p for ns in namespaces for p in _pids_in(ip, ns)])


def _stop(live_pids: Callable[[], list[int]]) -> None:
    """SIGTERM what ``live_pids()`` lists, SIGKILL what is still listed after a grace period."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        deadline = time.monotonic() + (_KILL_GRACE_S if sig == signal.SIGTERM else 0.0)
        pids = live_pids()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        while pids and time.monotonic() < deadline:
            time.sleep(0.05)
            pids = live_pids()
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


def list_cpu_groups(root: str) -> list[str]:
    """Names of the hsdp runs' cpu groups directly under the cgroup v1 cpu controller's ``root``."""
    try:
        return sorted(name for name in os.listdir(root) if _CPU_GROUP.match(name))
    except OSError:  # no controller there: nothing of ours either
        return []


def _pids_in_group(path: str) -> list[int]:
    try:
        with open(os.path.join(path, "cgroup.procs")) as f:
            return [int(p) for p in f.read().split()]
    except OSError:  # removed meanwhile
        return []


def _rmdir_group(path: str) -> bool:
    deadline = time.monotonic() + _RMDIR_WAIT_S
    while True:
        try:
            os.rmdir(path)
            return True
        except FileNotFoundError:
            return False
        except OSError:  # EBUSY: a process is still on its way out
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)


def remove_cpu_groups(root: str, run_name: str) -> list[str]:
    """Delete the cpu groups of the run ``run_name`` (``<root>/<run_name>-n<i>``) after stopping the processes
    still in them (a loopback run's workers, which no namespace holds); return the names removed.

    Idempotent: groups already gone are skipped."""
    pattern = re.compile(rf"^{re.escape(run_name)}-n\d+$")
    paths = [os.path.join(root, name) for name in list_cpu_groups(root) if pattern.match(name)]
    # Only processes in the run's own groups: the launcher put its agents there, their workers inherited it.
    _stop(lambda: [p for path in paths for p in _pids_in_group(path)])
    return [os.path.basename(path) for path in paths if _rmdir_group(path)]


class Reaper:
    """The watchdog of one run; :meth:`release` ends it once the launcher has cleaned up itself."""

    def __init__(self, run_name: str, ip: str | None, scratch_dir: str, cpu_root: str | None = None) -> None:
        # Own session: Ctrl-C in the terminal reaches the launcher's process group, not the reaper, which must
        # outlive the launcher to do its job. The pipe's write end stays in the launcher only (Popen keeps it
        # close-on-exec), so the agents the launcher starts later cannot hold it open. An empty `ip` or
        # `cpu_root`: the run has no namespaces or no cpu groups.
        argv = [sys.executable, os.path.abspath(__file__), run_name, ip or "", scratch_dir, cpu_root or ""]
        self._proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, start_new_session=True)

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
    """``python reaper.py RUN_NAME IP SCRATCH_DIR [CPU_ROOT]``: wait for end-of-file on stdin, then remove the
    run's namespaces (unless ``IP`` is empty), its cpu groups under ``CPU_ROOT`` (if given and not empty) and
    its scratch directory (torchrun's per-rank logs)."""
    run_name, ip, scratch_dir, *rest = argv if argv is not None else sys.argv[1:]
    cpu_root = rest[0] if rest else ""
    # Ctrl-C of the launcher's terminal or a SIGHUP as the terminal closes must not stop the one process
    # that cleans up after the launcher.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    while sys.stdin.buffer.read(65536):
        pass
    removed = remove_namespaces(ip, run_name) if ip else []
    removed += remove_cpu_groups(cpu_root, run_name) if cpu_root else []
    shutil.rmtree(scratch_dir, ignore_errors=True)
    if removed:
        print(f"hsdp reaper: launcher gone, removed {', '.join(removed)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
