"""The seed tutorial's example runs under torchrun on 4 CPU ranks (2 replicas x 2 shards) and learns."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "seed_tutorial.py"
TIMEOUT_S = 120


def _run_example(*args: str) -> subprocess.CompletedProcess[str]:
    # One thread per rank: 4 ranks on a small CI machine otherwise oversubscribe its cores many times over.
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    # `python -m torch.distributed.run` is torchrun without relying on the console script being on PATH;
    # --standalone picks a free rendezvous port, so parallel test runs do not collide.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
           str(SCRIPT), *args]
    try:
        return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{' '.join(cmd)} did not finish in {TIMEOUT_S}s:\n{e.stdout}\n{e.stderr}")


def _loss(output: str, which: str) -> float:
    # Not anchored to a line start: another rank's unflushed text could precede it on a shared pipe.
    found = re.findall(rf"{which} average loss: ([0-9.eE+-]+)", output)
    assert len(found) == 1, f"expected one '{which} average loss' line (rank 0 only):\n{output}"
    return float(found[0])


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_seed_tutorial_trains_under_torchrun() -> None:
    proc = _run_example()
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"exit code {proc.returncode}:\n{output}"
    first, last = _loss(output, "first"), _loss(output, "last")
    assert last < first, f"loss did not fall: first {first}, last {last}"
    # Every rank trains (4 ranks report their place in the 2 x 2 mesh).
    assert len(re.findall(r"Rank \d: replica \d of 2, shard \d of 2", output)) == 4, output
