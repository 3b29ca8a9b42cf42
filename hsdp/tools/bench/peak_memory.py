"""Peak tensor memory of one training step: the number FSDP users quote, measured the same way for every system.

On CUDA this is ``torch.cuda.max_memory_allocated`` over the step. CPUs have no allocator statistics, and
peak RSS mixes tensors with the interpreter, libraries and glibc's per-thread arenas (it moved by +-40 MiB
between identical runs here), so on CPU the step runs under PyTorch's ``MemTracker``: it counts the bytes
of every live tensor storage, op by op, including storages resized in place (how FSDP2 and hsdp free
unsharded parameters). What it cannot see is memory a collective backend allocates on its own threads;
that is the same backend for every system compared.

The tracker slows the step down (a Python call per op), so it measures an extra step after the timed ones.
A step is given as its parts (one per micro-batch, then the optimizer step): MemTracker's per-module
statistics refuse a second forward of the root, so they are cleared between parts; the peak is kept.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn


def measure_step_peak(parts: Sequence[Callable[[], Any]], model: nn.Module, optimizer: torch.optim.Optimizer,
                      device: torch.device) -> tuple[list[Any], int]:
    """Run the parts of one step in order; return their results and the peak bytes of live tensors on
    ``device`` over all of them.

    The peak includes everything alive when the step starts: parameters, gradients and optimizer state.
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        out = [part() for part in parts]
        torch.cuda.synchronize(device)
        return out, torch.cuda.max_memory_allocated(device)
    # Imported here: a private module of torch.distributed, used for measurement only.
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    out = []
    with tracker:
        for part in parts:
            tracker.reset_mod_stats()
            out.append(part())
    peak = tracker.get_tracker_snapshot("peak").get(device, {})
    return out, int(peak.get("Total", 0))
