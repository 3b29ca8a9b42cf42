"""The device streams one wrapped model's collectives run on (FSDP2's all-gather / reduce-scatter / all-reduce
streams), and the rule that keeps their buffers safe.

On CUDA the compute stream would otherwise serialise behind communication: NCCL runs each collective on its
own internal stream, but that stream first waits for the stream the collective is *issued* from, and a
``wait()`` makes the *current* stream wait for it. So every collective is issued from a side stream:

* ``all_gather``: the copy-in of the shard (a cast under mixed precision, a copy otherwise, so that the
  collective never reads the live shard a plain optimizer may edit in place) and the all-gather. It waits
  for the compute stream first (the shard's last update); the compute stream waits for the gather only in
  ``wait_for_unshard``, right before the unit's forward or backward needs the parameters.
* ``reduce_scatter``: the reduce-scatter of a unit's gradients, after the compute stream copied them in. The
  stream waits for the collective itself, so its event marks the collective's end.
* ``replica_hop``: the inter-node hop; it waits for its own reduce-scatter, not for the compute stream, so it
  is chained right behind it while the backward of earlier units goes on; it also adds micro-batches'
  partial sums and casts the reduced shard to the gradients' dtype, unit by unit. The compute stream waits
  for the hops at the end of backward, synchronised or not.

The buffer rule: a buffer a side stream touches is allocated on the compute stream and referenced until the
compute stream has waited for its last use, with two exceptions:

* the reduce-scatter input (a whole unit of gradients) is dropped when the *next* unit's reduction starts,
  after the compute stream waited for this one's reduce-scatter (FSDP2's ``reduce_scatter_state``): at most
  two are held, however far the host runs ahead of the device;
* a shard-sized buffer the hop stream replaces (the reduce-scatter output once cast or summed, a partial
  sum, a residual loaded from a checkpoint) is handed to ``record_stream`` (:meth:`Streams.release_after`):
  the allocator reuses its block only once the hop stream got past its last use.

A buffer the hop stream allocates (a cast, a residual) is used by the compute stream only after it waited
for the hop; its block goes back to the hop stream's pool, whose next use is ordered after the compute
stream through the next reduce-scatter. ``tests/stream_model.py`` checks all of this on CPU against a model
of the allocator and of stream order.

On CPUs (gloo) there is one stream: every method here is a no-op and the runtime behaves as if it did not
exist; a wait there blocks the host instead, so the hop stream's job (wait for a reduce-scatter, then issue
the hop) falls to a host thread, the mesh's hop worker (``hsdp/engine/hop_worker.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

_SIDE_STREAMS = ("all_gather", "reduce_scatter", "replica_hop")


class Streams:
    """The side streams of one model on ``device`` (none unless it is a CUDA device)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.enabled = device.type == "cuda"
        self._streams: dict[str, torch.cuda.Stream] = {}
        if self.enabled:
            # The gathers and reduce-scatters are on the critical path of the next unit: high priority.
            self._streams = {name: torch.cuda.Stream(device, priority=0 if name == "replica_hop" else -1)
                             for name in _SIDE_STREAMS}

    @contextlib.contextmanager
    def on(self, name: str, after_compute: bool = True) -> Iterator[None]:
        """Run the enclosed kernels and collective issues on side stream ``name``; first make it wait for
        everything issued so far on the compute stream unless ``after_compute=False`` (the hop, which waits
        for its reduce-scatter instead). A no-op without CUDA."""
        if not self.enabled:
            yield
            return
        stream = self._streams[name]
        if after_compute:
            stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            yield

    def record(self, name: str) -> torch.cuda.Event | None:
        """An event at the end of the work issued so far on side stream ``name`` (``None`` without CUDA).
        Waiting for a collective's handle orders a stream after the collective only; this also covers the
        kernels the side stream ran around it (a copy-in, a cast, or the whole collective on a group of one,
        which ``Comm`` does as a local copy)."""
        if not self.enabled:
            return None
        return self._streams[name].record_event()

    def wait(self, event: torch.cuda.Event | None) -> None:
        """Make the current stream wait for ``event`` (from :meth:`record`); a no-op for ``None``."""
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def release_after(self, tensor: torch.Tensor, name: str) -> None:
        """``tensor`` (allocated on the compute stream) is about to be dropped while side stream ``name`` is
        ordered after its last use but the compute stream is not: keep the allocator from reusing its block
        before that stream gets there."""
        if self.enabled and tensor.device.type == "cuda":
            tensor.record_stream(self._streams[name])
