"""A watchdog process that removes a run's namespaces once its launcher is gone, however it went.

The launcher's own ``finally`` and signal handlers cover errors, Ctrl-C and SIGTERM, but nothing in a process
survives SIGKILL. So each emulated run starts this small process first: it blocks reading a pipe whose only
writer is the launcher. The kernel closes that pipe when the launcher exits for any reason, the read returns
end-of-file, and the reaper removes the run (stopping what still runs inside its namespaces). After a normal
exit the launcher has already torn everything down and the reaper finds nothing to do.

``hsdp launch --cleanup`` remains for what even this cannot catch (the whole machine or container going down).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from hsdp.launch.netns import RunId, Tools, remove_run


class Reaper:
    """Handle on a running reaper; :meth:`release` lets it exit after the launcher's own cleanup."""

    def __init__(self, run: RunId, tools: Tools) -> None:
        package_root = str(Path(__file__).resolve().parents[2])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))}
        # Own session: Ctrl-C in the terminal reaches the launcher's process group, not the reaper, which must
        # outlive the launcher to do its job. The pipe's write end stays in the launcher only (Popen keeps it
        # close-on-exec), so the agents the launcher starts later cannot hold it open.
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "hsdp.launch.reaper", run.name, tools.ip, tools.tc],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, env=env, start_new_session=True,
        )

    def release(self, timeout_s: float = 15.0) -> None:
        """Close the pipe (the reaper then removes anything left of the run) and wait for it to exit."""
        if self._proc.stdin is not None and not self._proc.stdin.closed:
            self._proc.stdin.close()
        try:
            self._proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


def _parse_run(name: str) -> RunId:
    run = RunId.from_namespace(f"{name}-sw")
    if run is None:
        raise SystemExit(f"hsdp reaper: {name!r} is not an hsdp run name")
    return run


def main(argv: list[str] | None = None) -> int:
    """``python -m hsdp.launch.reaper RUN_NAME IP TC``: wait for end-of-file on stdin, then remove the run."""
    name, ip, tc = argv if argv is not None else sys.argv[1:]
    run = _parse_run(name)
    # Ctrl-C of the launcher's terminal or a SIGHUP as the terminal closes must not stop the one process
    # that cleans up after the launcher.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    while sys.stdin.buffer.read(65536):
        pass
    removed = remove_run(Tools(ip, tc), run)
    if removed:
        print(f"hsdp reaper: launcher gone, removed {', '.join(removed)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
