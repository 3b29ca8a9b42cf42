"""The part of the Trainer's and Fabric's HSDP strategies that is the same for both: the existing processes,
hsdp's mesh, the data-parallel sampler and Lightning's small collectives.

Lightning's Trainer and Fabric take strategies of two unrelated base classes (``lightning.pytorch`` and
``lightning.fabric`` ``ParallelStrategy``); this mixin comes first in each strategy's bases.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch
from lightning.fabric.utilities.distributed import _sync_ddp_if_available
from lightning_utilities.core.rank_zero import rank_zero_only

from hsdp.data.sampler import data_parallel_rank, data_parallel_size
from hsdp.engine.collectives import Comm
from hsdp.engine.mesh import HSDPMesh
from hsdp.engine.policy import MixedPrecision
from hsdp.integrations.lightning.environment import init_process_group, rank_device
from hsdp.integrations.lightning.options import HSDPOptions, build_mesh
from hsdp.integrations.lightning.precision import HSDPPrecisionBase


class HSDPStrategyBase:
    """Environment, mesh, sampler and collectives of an HSDP strategy (a mixin: see the module doc)."""

    options: HSDPOptions
    _mesh: HSDPMesh | None
    accelerator: Any
    global_rank: int
    local_rank: int

    @property
    def mesh(self) -> HSDPMesh:
        """hsdp's mesh, built when Lightning sets up the processes (``fabric.launch()``, ``trainer.fit``)."""
        if self._mesh is None:
            raise RuntimeError("the hsdp mesh is built when the processes are set up: call fabric.launch() (or "
                               "trainer.fit/validate/...) first")
        return self._mesh

    @property
    def root_device(self) -> torch.device:
        kind = getattr(self.accelerator, "name", lambda: "cpu")()  # Lightning's accelerators: "cpu", "cuda", ...
        return rank_device(self._mesh, kind, self.local_rank)

    def _configure_launcher(self) -> None:
        self._launcher = None  # torchrun (or the caller) started every process: Lightning launches none

    def set_world_ranks(self) -> None:
        _set_rank_zero(self.global_rank)  # the Trainer's connector calls it when it is built

    def _setup_hsdp_environment(self) -> None:
        """Join the process group (unless the caller has) and build hsdp's mesh on it, once: the Trainer sets up
        again for each ``fit``/``validate``/..., and the wrapped model stays on the first mesh."""
        init_process_group(self.root_device.type, self.options.timeout)
        if self._mesh is None:
            self._mesh = build_mesh(self.options)
        _set_rank_zero(self.global_rank)

    def _policy(self, plugin: HSDPPrecisionBase) -> MixedPrecision | None:
        """An explicit ``mixed_precision=`` wins over the ``precision=`` flag."""
        return self.options.mixed_precision or plugin.policy

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Every (replica, shard) position reads distinct data; the ranks of a tensor-parallel group read one batch."""
        return {"num_replicas": data_parallel_size(self.mesh), "rank": data_parallel_rank(self.mesh)}

    # -- Lightning's own collectives (metrics, decisions, paths): the world group, outside hsdp's accounting
    def _all_reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        if not isinstance(tensor, torch.Tensor):
            return tensor
        return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)

    # Through hsdp's Comm (the one caller of collectives), so the hang ledger sees them; a Comm of their own keeps
    # them out of the model's comm_stats(). Before the mesh exists there is no process group to wait on.
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if self._mesh is not None:
            self._control().barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if self._mesh is None:
            return obj
        return broadcast_object(self._control(), obj, src)

    def _control(self) -> Comm:
        comm = getattr(self, "_control_comm", None)
        if comm is None or comm.mesh is not self._mesh:
            comm = self._control_comm = Comm(self.mesh)
        return comm


def broadcast_object(comm: Comm, obj: Any, src: int = 0) -> Any:
    """``obj`` of global rank ``src``, pickled (Lightning's decisions, paths and states; trusted, as
    ``dist.broadcast_object_list`` trusts them)."""
    data = pickle.dumps(obj) if comm.mesh.rank == src else None
    return pickle.loads(comm.broadcast_bytes(data, src_group_rank=src))


def _set_rank_zero(rank: int) -> None:
    # Lightning's rank_zero_only helpers (one object in lightning.fabric, lightning.pytorch and
    # lightning_utilities) print and log on rank 0 only; its own strategies set the rank here.
    rank_zero_only.rank = rank  # type: ignore[attr-defined]
