"""A model of CUDA's stream semantics on the CPU, to check hsdp's GPU runtime where no GPU is.

``StreamModel`` stands in for the device: ``ModelStreams`` replaces ``hsdp.engine.runtime.streams.Streams``
(so the runtime takes every side-stream branch it takes on CUDA), and a ``TorchDispatchMode`` sees every
kernel, each one enqueued on the stream the runtime made current. It keeps what the CUDA caching allocator
and the stream rules would do, in the spirit of PyTorch's CUDA sanitizer (``torch.cuda._sanitizer``):

* order: a vector clock per stream; ``wait_stream``, ``record``/``wait`` of events and collective waits merge
  clocks. Access ``(stream s, kernel n)`` happens before stream ``u``'s next kernel iff ``u`` knows ``s``'s ``n``;
* races: a kernel reading a buffer another stream wrote, or writing one another stream read or wrote,
  without being ordered after that access, is reported;
* allocation streams: a buffer belongs to the stream current when it was allocated (its first kernel
  output, or an ``UntypedStorage.resize_`` to a non-zero size). Freed (last reference gone, or resized to 0),
  the block goes back to that stream's pool, and the allocator may hand it to that stream's next allocation
  at once: if at that allocation some other stream's access of the block is not ordered before it, the block
  could be overwritten while in use, which is reported (a buffer used by a side stream after its last
  compute-stream reference). ``record_stream`` (``Streams.release_after``) instead pins the block until the
  device gets there; the model assumes the worst device, one that never catches up on its own, so a pinned
  block stays pinned until :meth:`StreamModel.synchronize` (the host waiting for the device);
* collectives (``c10d`` kernels) run on a stream of their own, ordered after the issuing stream, that the
  stream calling the handle's ``wait()`` waits for (NCCL's semantics); their first tensor argument is
  written, the others are read.

What it does not see: the sizes of blocks (any freed block of a stream may be reused by that stream's next
allocation), and kernels issued outside the mode (none in the tests: everything runs inside it).
"""

from __future__ import annotations

import contextlib
import itertools
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from hsdp.engine import collectives
from hsdp.engine.runtime import state as runtime_state
from hsdp.engine.runtime.streams import Streams

COMPUTE = "compute"
Clock = dict[str, int]


@dataclass
class _Block:
    """One storage as the model sees it."""

    ref: StorageWeakRef
    stream: str  # allocation stream
    what: str  # the kernel that allocated it
    nbytes: int
    accessed: Clock = field(default_factory=dict)  # stream -> its last kernel that touched the block
    last_op: dict[str, str] = field(default_factory=dict)  # stream -> that kernel's name
    last_write: tuple[str, int, str] | None = None
    reads: dict[str, tuple[int, str]] = field(default_factory=dict)  # since the last write
    recorded: set[str] = field(default_factory=set)  # record_stream
    tags: set[str] = field(default_factory=set)


class StreamModel(TorchDispatchMode):
    """See the module docstring. Use as ``with StreamModel() as model:`` around wrapping and training;
    ``model.problems`` lists what a GPU could get wrong."""

    def __init__(self) -> None:
        super().__init__()
        self.clocks: dict[str, Clock] = {COMPUTE: {COMPUTE: 0}}
        self.current: list[str] = [COMPUTE]
        self.blocks: dict[int, _Block] = {}
        self.pools: dict[str, list[_Block]] = {}
        self.pinned: list[_Block] = []
        self.problems: list[str] = []
        self.last_collective: str | None = None
        self._collectives = itertools.count()
        self._patches = contextlib.ExitStack()
        self.peak_tagged: dict[str, int] = {}

    # -- streams and events -----------------------------------------------------------------------------
    def stream(self) -> str:
        return self.current[-1]

    def _tick(self, stream: str) -> int:
        clock = self.clocks.setdefault(stream, {stream: 0})
        clock[stream] = clock.get(stream, 0) + 1
        return clock[stream]

    def merge(self, into: str, clock: Clock) -> None:
        mine = self.clocks.setdefault(into, {into: 0})
        for s, n in clock.items():
            if mine.get(s, 0) < n:
                mine[s] = n

    def ordered(self, stream: str, n: int, after_on: str) -> bool:
        return stream == after_on or self.clocks.get(after_on, {}).get(stream, 0) >= n

    def event(self, stream: str) -> Clock:
        return dict(self.clocks.setdefault(stream, {stream: 0}))

    def synchronize(self) -> None:
        """The host waited for the whole device: every stream knows every other's work; pins are released."""
        everything: Clock = {}
        for clock in self.clocks.values():
            for s, n in clock.items():
                everything[s] = max(everything.get(s, 0), n)
        for s in self.clocks:
            self.merge(s, everything)
        for block in self.pinned:
            self._pool(block)
        self.pinned.clear()

    # -- blocks -------------------------------------------------------------------------------------------
    def _block(self, t: torch.Tensor, allocating: bool, what: str) -> _Block | None:
        if isinstance(t, DTensor):
            t = t._local_tensor
        try:
            storage = t.untyped_storage()
        except Exception:  # no storage (meta, sparse)
            return None
        if t.device.type == "meta" or storage.nbytes() == 0:
            return None
        key = storage._cdata
        block = self.blocks.get(key)
        if block is not None and not block.ref.expired():
            return block
        if block is not None:
            self._free(block)
        if not allocating and self.stream().startswith("collective#"):
            return None  # the backend's own buffer (gloo copies its result out of one in wait())
        stream = self.stream() if allocating else COMPUTE  # made outside the mode: by the host, ordered first
        if allocating:
            self._allocating(stream)
        block = _Block(StorageWeakRef(storage), stream, what, storage.nbytes())
        self.blocks[key] = block
        return block

    def _allocating(self, stream: str) -> None:
        """A new allocation on ``stream``: it may reuse any block in that stream's pool."""
        self.collect()
        pool = self.pools.get(stream, [])
        for block in pool:
            late = [f"{s} ({block.last_op[s]})" for s, n in block.accessed.items() if not self.ordered(s, n, stream)]
            if late:
                self.problems.append(
                    f"a block allocated on {block.stream} by {block.what} ({block.nbytes} B) was freed while "
                    f"{', '.join(sorted(late))} may still use it: {stream}'s next allocation may reuse it "
                    f"(hold it until {stream} waited, or record_stream it)")
        pool.clear()

    def collect(self) -> None:
        """Free the blocks whose storage died since the last look."""
        for key, block in list(self.blocks.items()):
            if block.ref.expired():
                del self.blocks[key]
                self._free(block)

    def _free(self, block: _Block) -> None:
        if block.recorded - {block.stream}:
            self.pinned.append(block)
        else:
            self._pool(block)

    def _pool(self, block: _Block) -> None:
        self.pools.setdefault(block.stream, []).append(block)

    def resized(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        """``UntypedStorage.resize_``: to 0 frees the block, to more allocates a new one on the current stream."""
        block = self.blocks.pop(storage._cdata, None)
        if block is not None:
            self._free(block)
        if nbytes > 0:
            self._allocating(self.stream())
            self.blocks[storage._cdata] = _Block(StorageWeakRef(storage), self.stream(), "resize_", nbytes)

    def _access(self, block: _Block, stream: str, n: int, write: bool, what: str) -> None:
        if block.last_write is not None:
            s, m, by = block.last_write
            if not self.ordered(s, m, stream):
                self.problems.append(f"{what} on {stream} {'writes' if write else 'reads'} a block {by} on {s} "
                                     f"wrote, unordered (allocated by {block.what})")
        if write:
            for s, (m, by) in block.reads.items():
                if not self.ordered(s, m, stream):
                    self.problems.append(f"{what} on {stream} writes a block {by} on {s} reads, unordered "
                                         f"(allocated by {block.what})")
            block.reads = {}
            block.last_write = (stream, n, what)
        else:
            block.reads[stream] = (n, what)
        block.accessed[stream] = n
        block.last_op[stream] = what if stream == COMPUTE else f"{what} at {_hsdp_frame()}"

    # -- the dispatch mode --------------------------------------------------------------------------------
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        what = str(func.overloadpacket.__name__)
        schema = func._schema
        collective = func.namespace == "c10d"
        stream = self.stream()
        if collective:  # NCCL: a stream of its own, ordered after the issuing one
            stream = f"collective#{next(self._collectives)}"
            self.clocks[stream] = self.event(self.stream())
            self.last_collective = stream
        is_view = all(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns) \
            and bool(schema.returns)
        inputs: list[tuple[torch.Tensor, bool]] = []
        for i, arg in enumerate(schema.arguments):
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            write = (i == 0) if collective else bool(arg.alias_info is not None and arg.alias_info.is_write)
            inputs += [(t, write) for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]
        out = func(*args, **kwargs)
        if is_view:
            return out
        n = self._tick(stream)
        seen: set[int] = set()
        for t, write in inputs:
            block = self._block(t, allocating=False, what=what)
            if block is not None:
                seen.add(id(block))
                self._access(block, stream, n, write, what)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                block = self._block(t, allocating=True, what=what)
                if block is not None and id(block) not in seen:
                    seen.add(id(block))
                    self._access(block, stream, n, True, what)
        if collective and "reduce_scatter" in what and len(inputs) > 1:
            self.tag(inputs[1][0], "rs_input")
        return out

    # -- hsdp's hooks ----------------------------------------------------------------------------------
    def __enter__(self) -> StreamModel:
        model = self
        real_resize = torch.UntypedStorage.resize_

        def resize_(storage: torch.UntypedStorage, nbytes: int) -> Any:
            result = real_resize(storage, nbytes)
            model.resized(storage, nbytes)
            return result

        real_init = collectives.Handle.__init__

        def handle_init(handle: collectives.Handle, work: Any = None, *args: Any, **kwargs: Any) -> None:
            real_init(handle, work, *args, **kwargs)
            if work is not None and model.last_collective is not None:
                handle._work = _Work(work, model, model.last_collective)

        patches = self._patches
        mp = patches.enter_context(_patched())
        mp(torch.UntypedStorage, "resize_", resize_)
        mp(collectives.Handle, "__init__", handle_init)
        mp(runtime_state, "Streams", lambda device: ModelStreams(device, model))
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self._patches.close()

    def tagged_alive(self, tag: str) -> int:
        """Blocks tagged ``tag`` that the allocator cannot hand out now: alive, or pinned."""
        self.collect()
        return sum(tag in b.tags for b in self.blocks.values()) + sum(tag in b.tags for b in self.pinned)

    def tag(self, t: torch.Tensor, tag: str) -> None:
        block = self._block(t, allocating=False, what="tag")
        if block is not None:
            block.tags.add(tag)
            self.peak_tagged[tag] = max(self.peak_tagged.get(tag, 0), self.tagged_alive(tag))


def _hsdp_frame() -> str:
    """Where in hsdp the current kernel was issued (its innermost hsdp frame)."""
    for frame in reversed(traceback.extract_stack()):
        if "/hsdp/" in frame.filename:
            return f"{frame.filename.rsplit('/hsdp/', 1)[-1]}:{frame.lineno}"
    return "?"


@contextlib.contextmanager
def _patched() -> Iterator[Any]:
    undo: list[tuple[Any, str, Any]] = []

    def patch(owner: Any, name: str, value: Any) -> None:
        undo.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    try:
        yield patch
    finally:
        for owner, name, value in reversed(undo):
            setattr(owner, name, value)


class _Work:
    """A collective's work as the model sees it: what the backend runs inside ``wait()`` (gloo copies its
    result out there) is the collective's own work; then the waiting stream is ordered after it."""

    def __init__(self, work: Any, model: StreamModel, stream: str) -> None:
        self._work, self._model, self._stream = work, model, stream

    def wait(self) -> Any:
        model = self._model
        waiting = model.stream()
        model.current.append(self._stream)
        try:
            result = self._work.wait()
        finally:
            model.current.pop()
        model.merge(waiting, model.clocks[self._stream])
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


class ModelStreams(Streams):
    """``Streams`` on the model's device: side streams that only order, as CUDA's do."""

    def __init__(self, device: torch.device, model: StreamModel) -> None:
        super().__init__(device)
        self.enabled = True  # take every side-stream branch of the runtime
        self.model = model

    @contextlib.contextmanager
    def on(self, name: str, after_compute: bool = True) -> Iterator[None]:
        model = self.model
        if after_compute:
            model.merge(name, model.event(model.stream()))
        model.current.append(name)
        try:
            yield
        finally:
            model.current.pop()

    def record(self, name: str) -> Clock:  # type: ignore[override]
        return self.model.event(name)

    def wait(self, event: Any) -> None:
        if event is not None:
            self.model.merge(self.model.stream(), event)

    def release_after(self, tensor: torch.Tensor, name: str) -> None:
        block = self.model._block(tensor, allocating=False, what="record_stream")
        if block is not None:
            block.recorded.add(name)
