"""Fixtures shared by test modules (process-spawning helpers live in ``harness.py``)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch.distributed as dist

import hsdp


@pytest.fixture(scope="module")
def nccl_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[hsdp.HSDPMesh]:
    """For the CUDA-marked tests: a 1 x 1 mesh over a one-rank NCCL process group in this process
    (FileStore rendezvous: no ports), destroyed at the end of the module."""
    store = dist.FileStore(str(tmp_path_factory.mktemp("nccl") / "store"), 1)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LOCAL_RANK", os.environ.get("LOCAL_RANK", "0"))  # init_mesh sets this rank's device from it
        dist.init_process_group("nccl", store=store, rank=0, world_size=1)
        try:
            # No fault watchdog: it would install a parent-death handler on the pytest process itself.
            yield hsdp.init_mesh(1, fault_policy=None)
        finally:
            dist.destroy_process_group()
