"""The only caller of torch.distributed collectives in hsdp.

Routing every collective through :class:`Comm` is what lets hsdp count bytes per hop, time them, compress
the inter-node hop, and verify in tests that all-gather and reduce-scatter never leave the shard group.

Groups are named by their role: ``"shard"`` (intra-node), ``"replicate"`` (inter-node), ``"world"``, and on a
3-D mesh ``"tp"`` (tensor parallelism, intra-node; hsdp uses it only for small control values such as norms).
A group of one rank costs nothing: the collective degenerates to a local copy or a no-op.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import threading
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch.profiler import record_function

from hsdp.engine.averaging import split_average
from hsdp.engine.comm_stats import CommStats, OpStats
from hsdp.engine.handles import Chained, Handle, completion_event
from hsdp.engine.mesh import HSDPMesh

__all__ = ["GROUPS", "Chained", "Comm", "Handle", "profiler_region"]

GROUPS = ("shard", "replicate", "world", "tp")


def _divide(output: torch.Tensor, divisor: float) -> None:
    output.div_(divisor)


def _sum_chunks(received: torch.Tensor, output: torch.Tensor, n: int, divisor: float) -> None:
    """The local half of a reduce-scatter done as an all-to-all: ``received`` holds every rank's copy of this
    rank's chunk, in rank order (the same order on every rank, so results are deterministic); the sum is
    then divided by ``divisor`` (``n`` for an average, ``1`` for a sum, ``post`` for an fp16 average)."""
    torch.sum(received.view(n, -1), dim=0, out=output.view(-1))
    if divisor != 1:
        output.div_(divisor)


def profiler_region(op: str, group: str, label: str = "") -> str:
    """The ``torch.profiler`` region name of one collective: ``hsdp::<op>[<group>] <label>``."""
    return f"hsdp::{op}[{group}] {label}" if label else f"hsdp::{op}[{group}]"


class Comm:
    """Collectives on the groups of one :class:`HSDPMesh`, with accounting."""

    def __init__(self, mesh: HSDPMesh) -> None:
        self.mesh = mesh
        self.stats = CommStats()
        # "replicate" is the replicate layer's (mesh.replicas): fixed on a grid, one per holder tuple on a
        # heterogeneous mesh (its hops run on views, replica_view; a plain "replicate" collective there is a bug,
        # see _group), the current quorum's on an elastic one (asked at each use: it changes between steps).
        self._layer = mesh.replicas
        self._groups = {"shard": mesh.shard_group, "world": None, "tp": mesh.tp_group}
        self._sizes = {"shard": mesh.sharding_degree, "world": mesh.world_size, "tp": mesh.tp_degree}
        self._replicate: tuple[int, ...] | None = None  # a view's holder tuple (its group: the layer's)
        # Every collective is entered in the watchdog's ledger (hang detection, see faults/ledger.py).
        self._watchdog = mesh.watchdog
        self._gloo = dist.get_backend() == "gloo"  # inter-node reduce-scatter as all-to-all + sum (reduce_scatter)
        self._cuda = mesh.device.type == "cuda"  # time collectives with CUDA events (see OpStats)
        self._ledger = None if mesh.watchdog is None else mesh.watchdog.ledger
        # On the hop worker: the ledger entry its collectives book to (reserved in program order, see chain).
        self._worker_local = threading.local()
        self._views: dict[tuple[int, ...], Comm] = {}

    @contextlib.contextmanager
    def helper(self, name: str) -> Iterator[None]:
        """A public collective helper (``hsdp.full_state_dict``): first every rank must arrive (a store
        counter, bounded by the fault policy; a rank-0-only call raises ``ValueError`` naming the ranks that
        did not call it), then its collectives are entered under ``name`` (see :meth:`phase`)."""
        if self._watchdog is not None and self.mesh.world_size > 1 and self._watchdog.policy.detect_hangs:
            self._watchdog.arrive(name)
        with self.phase(name):
            yield

    def phase(self, name: str) -> contextlib.AbstractContextManager[None]:
        """Collectives issued inside belong to the public helper ``name`` (``"hsdp.full_state_dict"``): a hang
        report then says which helper some ranks did not call."""
        return contextlib.nullcontext() if self._ledger is None else self._ledger.phase(name)

    def busy(self, what: str) -> contextlib.AbstractContextManager[None]:
        """Work on this rank alone that the others wait for in a collective (rank 0 writing a manifest):
        not reported as a hang however long it takes (see faults/ledger.py, [Note: busy regions])."""
        return contextlib.nullcontext() if self._ledger is None else self._ledger.busy(what)

    def size(self, group: str) -> int:
        if group != "replicate":
            return self._sizes[group]
        if self._replicate is not None:
            return len(self._replicate)
        self._layer.await_step()  # the step's replicas (an elastic quorum is waited for here, once per step)
        return self._layer.count

    def _group(self, group: str) -> dist.ProcessGroup | None:
        if group != "replicate":
            return self._groups[group]
        if self._replicate is not None:
            # Looked up per collective: an elastic layer's groups are its step's quorum epoch's (a dict lookup).
            self._layer.await_step()
            return self._layer.group(self._replicate)
        self._layer.await_step()
        pg = self._layer.replicate_group
        if pg is None and self.size("replicate") > 1:
            # None would mean the world: never silently widen an inter-node collective.
            raise RuntimeError("a 'replicate' collective on a heterogeneous mesh must go through "
                               "Comm.replica_view(holders) (an hsdp bug)")
        return pg

    def chain(self, issue: Callable[[], None], label: str, blocked_on: Handle | None = None) -> Chained:
        """Run ``issue`` on the mesh's hop worker after everything chained before (see ``hop_worker.py``):
        it may wait for earlier collectives and issue inter-node (``"replicate"``) ones, nothing else.
        Call from the main thread, in the same order on every rank. Its collectives count as one entry of
        the hang ledger, reserved now (so sequence numbers stay the same call on every rank) and named
        ``replica_hop[replicate] <label>``. ``Chained.wait()`` re-raises what ``issue`` raised; the time it
        blocks counts as waiting for ``blocked_on``."""
        entry = None
        if self._ledger is not None:
            entry = self._ledger.enter(profiler_region("replica_hop", "replicate", label), None)

        def run() -> None:
            local = self._worker_local
            local.entry, local.booked = entry, False
            try:
                issue()
            finally:
                if entry is not None and not local.booked:
                    self._ledger.done(entry)  # nothing was issued (a group of one, a deferred sync)
                local.entry = None

        return Chained(self.mesh.hop_worker.submit(run), blocked_on)

    def replica_view(self, holders: tuple[int, ...]) -> Comm:
        """This ``Comm`` with ``"replicate"`` meaning the replicate layer's group of ``holders`` (one rank per
        replica, this rank among them): how a heterogeneous mesh's hops reduce each piece with the hops'
        own code. Shares the accounting, the ledger and the hop worker; cached per holder tuple. On a grid
        the view of this rank's own position is the ``"replicate"`` group itself."""
        view = self._views.get(holders)
        if view is None:
            view = copy.copy(self)
            view._replicate = holders
            self._views[holders] = view
        return view

    def _pg(self, group: str) -> dist.ProcessGroup | None:
        """The process group to issue on. Inter-node collectives of the main thread first wait until the hop
        worker has issued what was chained before: the group's collectives keep program order everywhere."""
        if group == "replicate":
            self.mesh.hop_worker.drain()
        return self._group(group)

    def _group_rank(self, group: str) -> int:
        """This rank's rank in ``group`` (not ``dist.get_rank(pg)``: an elastic job's groups are not registered
        with torch, ``elastic/groups.py``)."""
        pg = self._group(group)
        return pg.rank() if pg is not None else dist.get_rank()

    def _record(self, group: str, op: str, nbytes: int, wire_factor: float) -> OpStats:
        return self.stats.record(group, op, nbytes, int(nbytes * wire_factor))

    # -- the collectives -------------------------------------------------------------------------------
    def all_gather(self, output: torch.Tensor, input: torch.Tensor, group: str = "shard",
                   async_op: bool = False, *, label: str = "") -> Handle:
        """``output`` (``n * input.numel()``) receives every rank's ``input`` in rank order. ``label``
        (e.g. the unit's name) names the region in profiler traces: ``hsdp::all_gather[shard] <label>``."""
        n = self.size(group)
        if n == 1:
            output.copy_(input.view(output.shape))
            return Handle()
        nbytes = output.numel() * output.element_size()
        stats = self._record(group, "all_gather", nbytes, (n - 1) / n)
        region = profiler_region("all_gather", group, label)
        with record_function(region):
            work = dist.all_gather_single(output, input, group=self._pg(group), async_op=True)
            return self._finish(work, stats, group, async_op, region)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, group: str = "shard",
                       op: dist.ReduceOp.RedOpType = dist.ReduceOp.AVG, async_op: bool = False, *,
                       label: str = "") -> Handle:
        """``output`` receives this rank's chunk of the element-wise reduction of every rank's ``input``.
        ``label`` names the profiler region (see :meth:`all_gather`).

        An fp16 ``AVG`` is split around a ``SUM`` (:func:`divide_factors`, against overflow and underflow):
        ``input`` is then divided *in place* before the collective (callers pass a temporary), the output
        once the handle is waited.

        Across nodes on gloo (the ``replicate`` group), an all-to-all and a local sum: gloo has no reduce-scatter
        of its own (``reduce_scatter_single`` all-reduces the whole input and keeps one chunk, twice the bytes),
        while the all-to-all sends each rank only the chunk it reduces, the (n-1)/n x input of a ring
        reduce-scatter, at the cost of a receive buffer the size of the input. Inside a node the bytes are
        cheap and the buffer (a whole unit's gradients) is not: there gloo's own runs. NCCL's is a ring.
        """
        n = self.size(group)
        if n == 1:
            output.copy_(input.view(output.shape))
            return Handle()
        nbytes = input.numel() * input.element_size()
        stats = self._record(group, "reduce_scatter", nbytes, (n - 1) / n)
        region = profiler_region("reduce_scatter", group, label)
        with record_function(region):
            wire_op, post = split_average(input, op, n)
            if self._gloo and group == "replicate" and wire_op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
                received = torch.empty_like(input)
                work = dist.all_to_all_single(received, input, group=self._pg(group), async_op=True)
                divisor = n if wire_op == dist.ReduceOp.AVG else post
                return self._finish(work, stats, group, async_op, region,
                                    functools.partial(_sum_chunks, received, output, n, divisor))
            work = dist.reduce_scatter_single(output, input, op=wire_op, group=self._pg(group), async_op=True)
            return self._finish(work, stats, group, async_op, region,
                                None if post == 1 else functools.partial(_divide, output, post))

    def all_reduce(self, tensor: torch.Tensor, group: str = "replicate",
                   op: dist.ReduceOp.RedOpType = dist.ReduceOp.AVG, async_op: bool = False, *,
                   label: str = "") -> Handle:
        """Reduce ``tensor`` in place over the group. ``label`` names the profiler region (see
        :meth:`all_gather`). An fp16 ``AVG`` is a pre-divided ``SUM`` post-divided once the handle is waited
        (:func:`divide_factors`); until then ``tensor`` holds neither input nor result."""
        n = self.size(group)
        if n == 1:
            return Handle()
        nbytes = tensor.numel() * tensor.element_size()
        stats = self._record(group, "all_reduce", nbytes, 2 * (n - 1) / n)
        region = profiler_region("all_reduce", group, label)
        with record_function(region):
            wire_op, post = split_average(tensor, op, n)
            work = dist.all_reduce(tensor, op=wire_op, group=self._pg(group), async_op=True)
            return self._finish(work, stats, group, async_op, region,
                                None if post == 1 else functools.partial(_divide, tensor, post))

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, output_sizes: list[int],
                   input_sizes: list[int], group: str = "shard", async_op: bool = False, *,
                   label: str = "") -> Handle:
        """1D ``input`` is cut in ``input_sizes`` pieces, piece ``i`` going to group rank ``i``; 1D ``output``
        receives ``output_sizes[i]`` elements from rank ``i``, in rank order (sizes may differ and be 0).
        ``wire_bytes`` counts only the pieces that leave this rank."""
        n = self.size(group)
        if n == 1:
            output.copy_(input)
            return Handle()
        me = self._group_rank(group)
        size = input.element_size()
        sent = (sum(input_sizes) - input_sizes[me]) * size  # the piece for this rank stays here
        stats = self.stats.record(group, "all_to_all", input.numel() * size, sent)
        region = profiler_region("all_to_all", group, label)
        with record_function(region):
            work = dist.all_to_all_single(output, input, output_sizes, input_sizes, group=self._pg(group),
                                          async_op=True)
            return self._finish(work, stats, group, async_op, region)

    def broadcast(self, tensor: torch.Tensor, src_group_rank: int = 0, group: str = "world",
                  to: Sequence[int] | None = None) -> None:
        """Overwrite ``tensor`` with its value on the group's rank ``src_group_rank``. ``to``: only these group
        ranks receive it, point to point from the source, which sends it once per receiver; the group's other
        ranks take no part (they return at once). For state that only some ranks lack (a heal's joiners): a
        broadcast would also send it to every rank that holds it already."""
        n = self.size(group)
        if n == 1:
            return
        if to is not None:
            self._send_copies(tensor, src_group_rank, to, group)
            return
        stats = self._record(group, "broadcast", tensor.numel() * tensor.element_size(), 1.0)
        pg = self._pg(group)
        region = profiler_region("broadcast", group)
        with record_function(region):
            # By group rank: an elastic job's replicate groups have no global ranks (elastic/groups.py).
            work = dist.broadcast(tensor, src=src_group_rank, async_op=True) if pg is None else \
                dist.broadcast(tensor, group=pg, group_src=src_group_rank, async_op=True)
        self._finish(work, stats, group, async_op=False, region=region)

    def _send_copies(self, tensor: torch.Tensor, src: int, to: Sequence[int], group: str) -> None:
        """:meth:`broadcast` to the ranks ``to`` only. Booked on the source as ``send_copies`` (wire bytes: one
        copy per receiver), on a receiver as ``receive_copy`` (no wire bytes: it sends nothing)."""
        me = self._group_rank(group)
        receivers = [r for r in dict.fromkeys(to) if r != src]
        if me != src and me not in receivers:
            return
        nbytes = tensor.numel() * tensor.element_size()
        op = "send_copies" if me == src else "receive_copy"
        stats = self._record(group, op, nbytes, len(receivers) if me == src else 0.0)
        pg = self._pg(group)
        region = profiler_region(op, group)
        with record_function(region):
            # By group rank: an elastic job's replicate groups have no global ranks (elastic/groups.py).
            if me == src:
                works = [dist.isend(tensor, group=pg, group_dst=r) for r in receivers]
            else:
                works = [dist.irecv(tensor, group=pg, group_src=src)]
        for work in works:
            self._finish(work, stats, group, async_op=False, region=region)

    def barrier(self, group: str = "world") -> None:
        """Return once every rank of the group has called it: e.g. so that a timed region starts together
        everywhere. Booked as ``barrier`` with no bytes."""
        if self.size(group) == 1:
            return
        stats = self._record(group, "barrier", 0, 0.0)
        region = profiler_region("barrier", group)
        with record_function(region):
            work = dist.barrier(group=self._pg(group), async_op=True)
        self._finish(work, stats, group, async_op=False, region=region)

    def _finish(self, work: dist.Work, stats: OpStats, group: str, async_op: bool, region: str = "",
                on_done: Callable[[], None] | None = None) -> Handle:
        retire = None
        if self._ledger is not None:
            entry = getattr(self._worker_local, "entry", None)
            if entry is None:
                entry = self._ledger.enter(region, work)
            else:  # on the hop worker: book to the entry chain() reserved
                entry.work, self._worker_local.booked = work, True
            retire = functools.partial(self._ledger.done_when, entry)
        handle = Handle(work, stats, on_done=on_done, region=region, retire=retire, cuda_timed=self._cuda,
                        completion=completion_event if self._cuda else None, interrupt=self._interrupt(group))
        if not async_op:
            handle.wait()
        return handle

    def _interrupt(self, group: str) -> Callable[[], str] | None:
        """What a wait in ``group`` asks, between slices, whether to give up (see ``Handle``): the elastic layer's
        coordinator notice, on a gloo replicate group only. A gloo wait blocks its thread until the collective
        ends (a stopped peer: the group's timeout), and a sliced wait leaves the collective running. On NCCL,
        ``Work.wait(timeout)`` blocks the host instead of the stream and, once ``timeout`` has passed since the
        collective was *enqueued*, marks it failed and aborts the communicator: a healthy hop queued behind
        backward work would end the step. There the wait is plain (the stream waits, the host goes on) and the
        epoch's watch thread aborts the communicator on the coordinator's notice (``elastic/layer.py``)."""
        interrupted = self._layer.interrupt() if group == "replicate" else None
        if interrupted is None or not _waits_on_host(self._group(group), self.mesh.device):
            return None
        return interrupted

    # -- small control messages (checkpointing: agreeing on an error, sharing a resolved path; measurements)
    def all_gather_bytes(self, data: bytes, group: str = "world") -> list[bytes]:
        """Every group rank's ``data``, in group-rank order: two all-gathers (lengths, padded payloads)."""
        n = self.size(group)
        if n == 1:
            return [data]
        device = self.mesh.device
        lengths = torch.empty(n, dtype=torch.int64, device=device)
        self.all_gather(lengths, torch.tensor([len(data)], dtype=torch.int64, device=device), group)
        sizes = lengths.tolist()
        longest = max(sizes)
        if longest == 0:
            return [b""] * n
        gathered = torch.empty(n * longest, dtype=torch.uint8, device=device)
        self.all_gather(gathered, _padded_bytes(data, longest, device), group)
        rows = gathered.view(n, longest).cpu()
        return [rows[i, : sizes[i]].numpy().tobytes() for i in range(n)]

    def all_gather_floats(self, values: Sequence[float], group: str = "world") -> list[list[float]]:
        """Every group rank's ``values``, in group-rank order (every rank passes as many): for measurements
        such as step times or byte counts, sent as float64 (integers are exact below 2**53)."""
        n = self.size(group)
        mine = torch.tensor(values, dtype=torch.float64, device=self.mesh.device)
        everyone = torch.empty(n * mine.numel(), dtype=torch.float64, device=self.mesh.device)
        self.all_gather(everyone, mine, group)
        return everyone.view(n, mine.numel()).tolist()

    def broadcast_bytes(self, data: bytes | None, src_group_rank: int = 0, group: str = "world",
                        to: Sequence[int] | None = None) -> bytes:
        """``data`` of the group's rank ``src_group_rank`` (ignored elsewhere; pass ``None`` there). ``to``: as
        :meth:`broadcast`'s (a rank in neither gets ``b""``)."""
        if self.size(group) == 1:
            return data or b""
        device = self.mesh.device
        length = torch.tensor([len(data or b"")], dtype=torch.int64, device=device)
        self.broadcast(length, src_group_rank, group, to)
        size = int(length.item())
        if size == 0:
            return b""
        payload = _padded_bytes(data or b"", size, device)
        self.broadcast(payload, src_group_rank, group, to)
        return payload.cpu().numpy().tobytes()


def _waits_on_host(pg: dist.ProcessGroup | None, device: torch.device) -> bool:
    """Whether ``pg``'s collectives on ``device`` run on gloo, whose ``Work.wait(timeout)`` only gives up waiting
    (NCCL's aborts the communicator; another backend's is not known to be safe)."""
    group, gloo = pg if pg is not None else dist.group.WORLD, getattr(dist, "ProcessGroupGloo", None)
    try:
        return gloo is not None and isinstance(group._get_backend(device), gloo)
    except RuntimeError:  # no backend for that device
        return False


def _padded_bytes(data: bytes, size: int, device: torch.device) -> torch.Tensor:
    out = torch.zeros(size, dtype=torch.uint8, device=device)
    if data:
        buffer = bytearray(data)
        view = torch.frombuffer(buffer, dtype=torch.uint8)
        out[: len(data)] = view  # a copy (to the device too)
        # The view exports the bytearray's memory: drop it first, or freeing the bytearray raises SystemError.
        del view
    return out
