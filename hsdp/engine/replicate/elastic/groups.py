"""The replicate groups of an elastic job: one process group per quorum epoch and position in a replica.

The replicas of an elastic job are separate torchrun jobs (a restart of one never restarts another), so no
``torch.distributed`` world spans them and ``new_group`` cannot build their groups. Each rank builds its own
position's group directly on torch's process-group classes, over the coordinator's store under the prefix
``hsdp/<job>/pg/<epoch>/<position>/`` (the shard rank, and the tp rank under tensor parallelism): its group rank is
the replica's index in the quorum, its size the member count. A new epoch (a member left or joined) builds a new
group under a new prefix, never touching the replica's own (intra-node) groups; the old one is aborted, so a
collective a dead peer left hanging ends instead of waiting for its timeout, and kept a while
(``ElasticLayer._retire``: destroying a gloo group waits for its collectives, which a stopped peer holds until the
timeout).

Gloo groups time out after ``hop_timeout`` (a stopped peer's collective fails then; a killed peer's closed
sockets fail at once); NCCL groups get the same timeout.
"""

from __future__ import annotations

import contextlib
from datetime import timedelta

import torch
import torch.distributed as dist

from hsdp.engine.replicate.elastic.protocol import key


def build_group(store: dist.Store, job: str, epoch: int | str, position: str, rank: int, size: int,
                device_type: str, timeout: float) -> dist.ProcessGroup:
    """The group of quorum epoch ``epoch`` for the position ``position`` in a replica (``ElasticLayer.position``):
    group rank ``rank`` of ``size``.
    Blocks until every member constructed it (gloo connects every pair through the store)."""
    prefix = dist.PrefixStore(key(job, "pg", epoch, position) + "/", store)
    group = dist.ProcessGroup(prefix, rank, size)
    limit = timedelta(seconds=timeout)
    if device_type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = limit
        backend = dist.ProcessGroupNCCL(prefix, rank, size, options)
        kind = dist.ProcessGroup.BackendType.NCCL
    else:
        backend = dist.ProcessGroupGloo(prefix, rank, size, limit)
        kind = dist.ProcessGroup.BackendType.GLOO
    group._set_default_backend(kind)
    group._register_backend(torch.device(device_type), kind, backend)
    return group


def abort_group(group: dist.ProcessGroup | None) -> None:
    """End a replaced group: its in-flight collectives fail now instead of at their timeout."""
    if group is None:
        return
    with contextlib.suppress(RuntimeError):  # already broken (a dead peer): nothing left to end
        group.abort()
