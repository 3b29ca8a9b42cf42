"""Buffers kept identical across ranks during training, as DDP's ``broadcast_buffers`` does.

Buffers are replicated, not sharded: every rank holds the whole of each. Wrapping broadcasts them once from
rank 0; after that, a buffer that forward updates (BatchNorm's running statistics) drifts apart, since each
rank sees its own data. With syncing on, every floating and integer buffer is broadcast from the
lowest-numbered rank of the data-parallel job, one flat broadcast per dtype, once per optimizer step: at the end
of a backward that syncs gradients (none between the micro-batches of accumulation, none after evaluation
under ``torch.no_grad()``), and before a forward when a grad-mode forward with gradient sync had no such
backward since (and before the first forward). That rank's statistics then win, with exactly the values DDP
broadcasts before its next forward; broadcast at the end of the step instead, they are equal on every rank
after each step, so ``check_replicas`` can compare them and an evaluation after training sees one model.

The lowest-numbered rank is rank 0 of the world on a grid or on replicas of different degrees. An elastic
replica's world is its own job, and which replicas take part in a step is the step's quorum: at the end of
the backward each replica broadcasts from its rank 0 inside it, then every rank receives its position's
buffers from the lowest-numbered live replica over its replicate group (every rank takes part in both, as in
a hop: no rank of a replica waits in one group while another is in the other). A broadcast before a forward
stays inside the replica (the quorum is not known yet: a joiner and the members would disagree on it); so
after a discarded step the replicas start the next forward with the statistics their own discarded forward
left, until that step's end. A joining replica receives the buffers in its heal (``optim/elastic_heal.py``).

Default (``broadcast_buffers=None``): on iff the model holds a module that updates running statistics in
forward (``BatchNorm*``, ``InstanceNorm*(track_running_stats=True)``, ``SyncBatchNorm``). DDP defaults to
always on, but that costs a world broadcast every step, which crosses the slow inter-node links; for the
common case (transformers, whose buffers are constants such as masks and rotary tables) it buys nothing.
``True`` syncs any model's buffers (e.g. a custom EMA buffer), ``False`` never does.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase

from hsdp.engine.collectives import Comm
from hsdp.engine.runtime.piece_broadcast import broadcast_whole


def updates_running_stats(module: nn.Module) -> bool:
    """Whether ``module`` holds a normalisation layer that updates its buffers in forward."""
    return any(isinstance(m, _NormBase) and m.track_running_stats for m in module.modules())


def move_buffers(module: nn.Module, device: torch.device, skip: Collection[int] = ()) -> None:
    """Put every buffer of ``module`` on ``device`` (the mesh's), at wrap time: buffers are replicated, so
    each is moved whole. Meta buffers stay on meta (``hsdp.materialize`` fills them); ids in ``skip`` (a
    nested wrapper's, moved when it was wrapped) are left alone. A buffer registered in several modules
    stays one tensor."""
    moved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # keeps the originals alive: ids stay unique
    for m in module.modules():
        for name, b in m._buffers.items():
            if b is None or b.is_meta or id(b) in skip or b.device == device:
                continue
            if id(b) not in moved:
                moved[id(b)] = (b, b.to(device))
            m._buffers[name] = moved[id(b)][1]


def comparable_buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every allocated buffer of ``module`` by name (a buffer registered twice once), for ``check_replicas``:
    buffers are replicated, so every rank must hold the same bits."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, b in module.named_buffers():
        if not b.is_meta and id(b) not in seen and b.element_size() in (1, 2, 4, 8):
            seen.add(id(b))
            out[name] = b
    return out


class BufferSync:
    """Broadcasts the buffers of one root module from the job's lowest-numbered rank once per step (above)."""

    def __init__(self, module: nn.Module, comm: Comm, enabled: bool | None = None) -> None:
        if enabled is not None and not isinstance(enabled, bool):
            raise ValueError(f"broadcast_buffers must be True, False or None (automatic), got {enabled!r}")
        self.module = module
        self.comm = comm
        self.enabled = updates_running_stats(module) if enabled is None else enabled
        self._due = True  # DDP syncs before the first forward

    @property
    def due(self) -> bool:
        """Whether the buffers are to be broadcast now (at a forward, or at the end of a backward)."""
        return self.enabled and self._due and (self.comm.size("world") > 1 or self.comm.mesh.replicas.outside_world)

    def post_forward(self, gradient_sync: bool) -> None:
        """Record whether the buffers are due: after a grad-mode forward with gradient sync only."""
        self._due = torch.is_grad_enabled() and gradient_sync

    def pre_forward(self) -> None:
        """Before a forward, when due: from rank 0 of the job's world (an elastic replica's own job only: which
        replicas take part is decided by the step's quorum, known later in the step)."""
        if self.due:
            self.broadcast(lambda flat: self.comm.broadcast(flat, 0, "world"))
            self._due = False

    def after_backward(self) -> None:
        """At the end of a backward that synced the step's gradients, when due: from the job's lowest-numbered
        rank (raises where an elastic member was lost meanwhile: the step is discarded, the buffers stay due)."""
        if self.due:
            self.broadcast(self._from_lowest_rank)
            self._due = False

    def broadcast(self, send: Callable[[torch.Tensor], None]) -> None:
        """Overwrite every floating and integer buffer with what ``send`` leaves in one flat per dtype (it
        broadcasts the flat in place)."""
        groups: dict[torch.dtype, list[torch.Tensor]] = {}
        for b in self.module.buffers():  # looked up each time: modules may reassign their buffers
            if b.is_floating_point() or (not b.is_complex() and b.dtype != torch.bool):
                groups.setdefault(b.dtype, []).append(b)
        device = self.comm.mesh.device
        # A graph may have saved a buffer (BatchNorm in eval mode): refilling it must not fail its backward.
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(
                tuple(b for bs in groups.values() for b in bs)):
            for buffers in groups.values():
                flat = torch.cat([b.reshape(-1).to(device) for b in buffers])
                send(flat)
                offset = 0
                for b in buffers:
                    b.copy_(flat[offset: offset + b.numel()].view_as(b))
                    offset += b.numel()

    def _from_lowest_rank(self, flat: torch.Tensor) -> None:
        self.comm.broadcast(flat, 0, "world")
        layer = self.comm.mesh.replicas
        if layer.outside_world:  # the world was the replica's own job: now across replicas, from the lowest
            layer.await_step()
            broadcast_whole(self.comm, flat, layer.lowest_member)
