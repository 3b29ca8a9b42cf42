"""Buffers kept identical across ranks during training, as DDP's ``broadcast_buffers`` does.

Buffers are replicated, not sharded: every rank holds the whole of each. Wrapping broadcasts them once from
rank 0; after that, a buffer that forward updates (BatchNorm's running statistics) drifts apart, since each
rank sees its own data. With syncing on, the root's pre_forward broadcasts every floating and integer
buffer from rank 0 of the world, one flat broadcast per dtype, when DDP would: before the first forward and
before each forward that follows a grad-mode forward whose backward syncs gradients (so once per step,
none between the micro-batches of accumulation, none after evaluation under ``torch.no_grad()``). Rank
0's statistics then win, exactly as under DDP.

Default (``broadcast_buffers=None``): on iff the model holds a module that updates running statistics in
forward (``BatchNorm*``, ``InstanceNorm*(track_running_stats=True)``, ``SyncBatchNorm``). DDP defaults to
always on, but that costs a world broadcast every step, which crosses the slow inter-node links; for the
common case (transformers, whose buffers are constants such as masks and rotary tables) it buys nothing.
``True`` syncs any model's buffers (e.g. a custom EMA buffer), ``False`` never does.
"""

from __future__ import annotations

from collections.abc import Collection

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase

from hsdp.engine.collectives import Comm


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


class BufferSync:
    """Broadcasts the buffers of one root module from rank 0 at the forwards DDP would."""

    def __init__(self, module: nn.Module, comm: Comm, enabled: bool | None = None) -> None:
        if enabled is not None and not isinstance(enabled, bool):
            raise ValueError(f"broadcast_buffers must be True, False or None (automatic), got {enabled!r}")
        self.module = module
        self.comm = comm
        self.enabled = updates_running_stats(module) if enabled is None else enabled
        self._due = True  # DDP syncs before the first forward

    def pre_forward(self) -> None:
        if self.enabled and self._due and self.comm.size("world") > 1:
            self.broadcast()

    def post_forward(self, gradient_sync: bool) -> None:
        """Record whether the next forward syncs: only after a grad-mode forward with gradient sync."""
        self._due = torch.is_grad_enabled() and gradient_sync

    def broadcast(self) -> None:
        """Overwrite every floating and integer buffer with rank 0's (one flat broadcast per dtype)."""
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
                self.comm.broadcast(flat, 0, "world")
                offset = 0
                for b in buffers:
                    b.copy_(flat[offset: offset + b.numel()].view_as(b))
                    offset += b.numel()
