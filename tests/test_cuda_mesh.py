"""A rank of a 2 x 4 mesh on one device, over torch's fake process group (``tests/programs/fake_mesh.py``).

The fake group moves no data, so these tests check what does not depend on values: each parameter's shard
shape (hsdp's padded dim-0 chunks, the same as FSDP2's on the same mesh), no host read but the one hsdp
intends per step, and, on CUDA, peak memory against FSDP2's ``fully_shard`` on the same 2-D ``DeviceMesh``,
model and batch. A fake process group must be the default group of its own process (the suite may hold a
real one), so each test runs the program in a subprocess.

The CPU test runs in the normal suite (shapes and host reads, on ranks 0, 5 and 7: the first, a middle one
of the second replica, and the last, whose chunk of a 3-row layer is empty); the CUDA one is marked ``cuda``
and run by ``benchmarks/gpu_check.sh``, which collects the memory numbers from ``$HSDP_GPU_CHECK_DIR``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
PROGRAM = ROOT / "tests" / "programs" / "fake_mesh.py"
# hsdp's peak may exceed FSDP2's by this factor at most (layouts differ in padding and flags, not in kind).
PEAK_RATIO_LIMIT = 1.10
NO_CUDA = not torch.cuda.is_available() or not dist.is_nccl_available()


def _run(args: list[str], timeout: float) -> list[dict[str, Any]]:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)  # the program is rank r of a fake world, whatever launched the suite
    proc = subprocess.run([sys.executable, "-W", "ignore", str(PROGRAM), *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-12000:]}"
    lines = [line for line in proc.stdout.splitlines() if line.startswith("FAKE_MESH_RESULT ")]
    assert len(lines) == 1, proc.stdout[-4000:]
    return json.loads(lines[0].removeprefix("FAKE_MESH_RESULT "))


def _check_ranks(results: list[dict[str, Any]], ranks: list[int]) -> None:
    assert [r["rank"] for r in results] == ranks
    for r in results:
        assert r["params_checked"] > 0, r
        assert r["intended_reads"] <= r["steps_under_check"], r  # at most hsdp's one read per step


def test_a_fake_2x4_mesh_rank_on_cpu_has_padded_chunk_shapes_and_one_host_read_per_step() -> None:
    ranks = [0, 5, 7]
    _check_ranks(_run(["--device", "cpu", "--ranks", *map(str, ranks)], timeout=240), ranks)


@pytest.mark.cuda
@pytest.mark.skipif(NO_CUDA, reason="needs a CUDA device and NCCL")
def test_a_fake_2x4_mesh_rank_on_cuda_syncs_only_as_intended_and_peaks_like_fsdp2() -> None:
    # ~68M parameters in 8 blocks of 1024 x 4099 (4099 rows: padded chunks); a batch small enough that
    # parameters, gradients, optimizer state and communication buffers, not activations, make the peak.
    ranks = [0, 7]
    model = ["--dim", "1024", "--hidden", "4099", "--depth", "8", "--batch", "256"]
    results = _run(["--device", "cuda", "--ranks", *map(str, ranks), "--memory", *model], timeout=100)
    _check_ranks(results, ranks)
    peak = results[0]["peak_bytes"]
    ratio = peak["hsdp"] / peak["fsdp2"]
    summary = {"mesh": "2x4 (fake process group, rank 0)", "model": " ".join(model), "steps": 3,
               "hsdp_peak_mib": round(peak["hsdp"] / 2**20, 1), "fsdp2_peak_mib": round(peak["fsdp2"] / 2**20, 1),
               "ratio": round(ratio, 4), "limit": PEAK_RATIO_LIMIT}
    print("FAKE_MESH_MEMORY " + json.dumps(summary))
    out = os.environ.get("HSDP_GPU_CHECK_DIR")
    if out:  # benchmarks/gpu_check.sh puts this into its result file
        Path(out, "fake_mesh_memory.json").write_text(json.dumps(summary, indent=2) + "\n")
    assert ratio <= PEAK_RATIO_LIMIT, summary
