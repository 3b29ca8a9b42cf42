"""The processes torchrun started: Lightning launches nothing and takes ranks from the process group; this
rank's device.

Lightning's own environments derive the world from its ``devices`` and ``num_nodes`` flags and, unless
they find a launcher's variables, start the processes themselves. An hsdp job is always started outside
(``torchrun``, ``hsdp launch``, a scheduler, a test harness that has already called
``init_process_group``), so the strategy carries this environment: ranks and world size come from the
process group when it exists, else from torchrun's variables, and ``devices``/``num_nodes`` are not
consulted.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import ClusterEnvironment

from hsdp.engine.mesh import HSDPMesh

_TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class TorchrunEnvironment(ClusterEnvironment):
    """A ``ClusterEnvironment`` over processes started outside Lightning (``creates_processes_externally``)."""

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:
        return os.environ.get("MASTER_ADDR", "127.0.0.1")

    @property
    def main_port(self) -> int:
        return int(os.environ.get("MASTER_PORT", "0"))

    @staticmethod
    def detect() -> bool:
        return dist.is_initialized() or all(k in os.environ for k in ("RANK", "WORLD_SIZE"))

    def world_size(self) -> int:
        return dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))

    def set_world_size(self, size: int) -> None:
        pass  # the launcher decided it; Lightning's guess from `devices` x `num_nodes` does not apply

    def global_rank(self) -> int:
        return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))

    def set_global_rank(self, rank: int) -> None:
        pass  # as set_world_size

    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", "0"))

    def node_rank(self) -> int:
        # torchrun's GROUP_RANK is the node's index; NODE_RANK is what other launchers (and Lightning) set.
        return int(os.environ.get("GROUP_RANK", os.environ.get("NODE_RANK", "0")))


def init_process_group(device_type: str, timeout: timedelta) -> None:
    """Join the job's default process group unless the caller already did: NCCL for a CUDA accelerator,
    gloo for the CPU (the backend decides where hsdp's mesh lives). ``ValueError`` naming the launcher when
    torchrun's variables are missing, raised before any connection is tried."""
    if dist.is_initialized():
        return
    missing = [k for k in _TORCHRUN_VARIABLES if k not in os.environ]
    if missing:
        raise ValueError(f"HSDPStrategy runs in processes started outside Lightning, and the torchrun variables "
                         f"{missing} are missing: launch with `torchrun --nproc-per-node G script.py` (or "
                         f"`hsdp launch`), or call torch.distributed.init_process_group() before fit/launch")
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo", timeout=timeout)


def rank_device(mesh: HSDPMesh | None, accelerator_type: str, local_rank: int) -> torch.device:
    """This rank's device: the mesh's once it exists, else the one Lightning's accelerator will use."""
    if mesh is not None:
        return mesh.device
    return torch.device("cuda", local_rank) if accelerator_type == "cuda" else torch.device("cpu")
