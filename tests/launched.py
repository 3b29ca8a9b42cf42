"""Run ``hsdp launch`` as a user would, in a subprocess, and find what it left behind.

Every process the launch starts inherits ``TEST_MARKER``: after the launch ended, a process whose environment
still carries the marker is one it failed to end (a killed process's ``/proc`` entry may linger a moment, so
the check waits up to 10 s for them to go)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def launch_env(marker: str, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This environment with the repository importable, ``TEST_MARKER`` and ``extra``."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "TEST_MARKER": marker, **(extra or {})}


def alive_with(marker: str) -> list[int]:
    """Processes whose environment carries ``TEST_MARKER=marker``."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if f"TEST_MARKER={marker}".encode() in f.read().split(b"\0"):
                        found.append(int(entry))
            except OSError:
                continue
    return found


def run_launch(flags: Sequence[str], script: Sequence[str], env: Mapping[str, str],
               timeout: float) -> tuple[int, str, list[int]]:
    """``hsdp launch FLAGS -- SCRIPT``: its status, its output (stdout and stderr) and the processes it left.
    A launch past ``timeout`` seconds is killed and fails the test with its output."""
    marker = uuid.uuid4().hex
    proc = subprocess.Popen([sys.executable, "-m", "hsdp", "launch", *flags, "--", *script], cwd=ROOT,
                            env=launch_env(marker, env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        output, _ = proc.communicate()
        pytest.fail(f"hsdp launch {' '.join(flags)} did not finish in {timeout:g} s:\n{why_failed(output)}")
    deadline = time.monotonic() + 10
    while alive_with(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    return proc.returncode, output, alive_with(marker)


# What a rank says when hsdp's fault handling ends it, and what an uncaught error prints.
_CAUSE = re.compile(r"aborting: |Traceback \(most recent call last\)|^\S*Error: |exited with status|exitcode", re.M)


def why_failed(output: str, tail: int = 6000) -> str:
    """A failed launch's output for an assertion message: every line naming a cause (a rank's ``aborting:``, a
    traceback's start, an error, a node's exit status), which may lie far above the end, then the last ``tail``
    characters. A multi-node launch prints thousands of lines; the cause is often not in the tail."""
    lines = output.splitlines()
    causes = [f"{i}: {line}" for i, line in enumerate(lines) if _CAUSE.search(line)][:60]
    return "lines naming a cause:\n" + "\n".join(causes) + f"\n--- the last {tail} characters ---\n" + output[-tail:]
