"""Run a function on N gloo ranks in fresh processes (forked from a server that imported torch once), with a hard
timeout (a hang fails, never stalls CI)."""

from __future__ import annotations

import os
import pickle
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Ranks start from a fork server that imported torch and hsdp once per test session, not from a fresh
# interpreter each (importing torch is most of a rank's start-up, and the suite starts a few hundred ranks on 2
# cores). What a spawned process would inherit from the test at the time of the call, the environment, is
# passed along explicitly (the fork server's own is from its start); the working directory and sys.path travel
# with multiprocessing's preparation data as for spawn.
_CONTEXT = mp.get_context("forkserver")
_CONTEXT.set_forkserver_preload(["torch", "torch.distributed", "torch.distributed.tensor", "numpy", "hsdp",
                                 "hsdp.engine.model", "hsdp.checkpoint", "harness",
                                 "transformers.models.llama.modeling_llama", "lightning.pytorch", "lightning.fabric",
                                 "accelerate", "transformers.trainer"])


def _worker(rank: int, fn: Callable[..., Any], world_size: int, tmp: str, args: tuple, env: dict,
            base_env: dict[str, str]) -> None:
    os.environ.clear()
    os.environ.update(base_env)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank), **env})
    torch.set_num_threads(1)
    out = os.path.join(tmp, f"result_{rank}.pkl")
    try:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=90))
        result = ("ok", fn(rank, world_size, *args))
    except BaseException:  # report, do not hang the others silently
        result = ("error", traceback.format_exc())
    with open(out, "wb") as f:
        pickle.dump(result, f)
    if dist.is_initialized():
        dist.destroy_process_group()


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 240,
                    env: dict[str, str] | None = None) -> list[Any]:
    """``[fn(rank, world_size, *args) for rank]``, each in its own process; raises with every rank's error."""
    with tempfile.TemporaryDirectory() as tmp:
        procs = [_CONTEXT.Process(target=_worker, args=(r, fn, world_size, tmp, args, env or {}, dict(os.environ)),
                                  daemon=True)
                 for r in range(world_size)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        alive = [p for p in procs if p.is_alive()]
        for p in alive:
            p.kill()
            p.join()
        results, errors = [], []
        for rank in range(world_size):
            path = os.path.join(tmp, f"result_{rank}.pkl")
            if not os.path.exists(path):
                errors.append(f"rank {rank}: no result (exit code {procs[rank].exitcode}; hung or crashed)")
                continue
            with open(path, "rb") as f:
                status, value = pickle.load(f)
            if status == "error":
                errors.append(f"rank {rank}:\n{value}")
            results.append(value)
        if alive or errors:
            raise AssertionError(f"distributed run failed (timeout {timeout}s):\n" + "\n".join(errors))
        return results
