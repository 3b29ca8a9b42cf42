"""The inter-node hop: how a unit's reduce-scattered gradient shard is averaged across replicas.

A hop *replaces* the replica all-reduce (FSDP2's all-reduce hook runs after its own all-reduce, and FSDP1
forbids hooks for hybrid sharding). The buffer a hop receives is 1-D: the shard's gradients, then one
"has gradient" flag per parameter (see ``runtime/reduction.py``); when the returned handle is waited,
the buffer must hold the average over the replicate group, flags included.

The hop owns what crosses nodes, dtype included: it is the one setting for the inter-node wire format
(``MixedPrecision`` covers compute and the intra-node reduce-scatter). Built-ins: :class:`AllReduceHop`
(plain, optionally in another dtype; ``AllReduceHop(torch.bfloat16)`` halves inter-node bytes) and
:class:`Int8ErrorFeedbackHop` (per-block int8 with error feedback, about a quarter of the fp32 bytes, lossy
but convergent). A hop that keeps state across steps (the int8 hop's residuals) exposes it through
``state_dict``/``load_state_dict``; ``ShardedOptimizer.state_dict`` saves it per parameter, so it
reshards with the checkpoint (``runtime/hop_state.py``).

With ``shard_optimizer_across_replicas`` the hop reduce-scatters instead (``start_scatter``): each replica
keeps the average of its slice only (``runtime/replica_slice.py``). Both built-ins do both: :class:`AllReduceHop`
in its wire dtype, :class:`Int8ErrorFeedbackHop` as an all-to-all of int8 blocks with error feedback per row; a
hop without ``start_scatter`` is refused for that mode when the model is wrapped.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist

from hsdp.engine.collectives import Comm, Handle
from hsdp.engine.handles import Chained


def _label(key: str) -> str:
    """Profiler label of a unit's hop: its module name (``key``), ``root`` for the root unit."""
    return key or "root"


class ReplicaHop(Protocol):
    """What a unit's gradient shard goes through across nodes. ``key`` names the unit (its module's name)."""

    def start(self, buffer: torch.Tensor, n_flags: int, comm: Comm, key: str) -> Handle:
        """Begin averaging ``buffer`` over the replicate group; in place once the handle is waited."""
        ...

    def state_dict(self) -> dict[str, torch.Tensor] | None:
        """State kept across steps, ``{unit key: 1-D tensor}`` laid out like the unit's reduced slot (see
        ``runtime/reduction.py``; on a heterogeneous mesh one entry per bucket of pieces, ``piece_hop.bucket_key``);
        ``None`` for a hop that keeps no state (``{}``: none yet). A hop replaces these tensors when it updates
        them, never writes into them: an elastic step that is discarded puts the old ones back
        (``runtime/hop_transaction.py``)."""
        ...

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore (some units' entries of) what :meth:`state_dict` returned."""
        ...


def waits_locally(hop: Any) -> bool:
    """Whether waiting for ``hop``'s handles issues no collective (an optional ``waits_locally`` attribute of a
    hop; absent: no). Only then may the runtime wait for them wherever a rank first reads a gradient
    (``runtime/late_grads.py``): a collective issued there could meet another rank's different one."""
    return bool(getattr(hop, "waits_locally", False))


@dataclass
class AllReduceHop:
    """All-reduce (average) in ``dtype`` (``None``: the buffer's own). Exact up to the wire dtype."""

    dtype: torch.dtype | None = None

    @property
    def waits_locally(self) -> bool:
        """True: its wait casts back at most (``waits_locally``)."""
        return True

    def start(self, buffer: torch.Tensor, n_flags: int, comm: Comm, key: str) -> Handle:
        """Begin the average of ``buffer`` over the replicate group, on the wire in ``dtype``."""
        if comm.size("replicate") == 1:
            return Handle()
        if self.dtype is None or self.dtype == buffer.dtype:
            return comm.all_reduce(buffer, "replicate", op=dist.ReduceOp.AVG, async_op=True, label=_label(key))
        wire = buffer.to(self.dtype)
        handle = comm.all_reduce(wire, "replicate", op=dist.ReduceOp.AVG, async_op=True, label=_label(key))
        return handle.then(lambda: buffer.copy_(wire))

    def start_scatter(self, output: torch.Tensor, packed: torch.Tensor, n_flags: int, comm: Comm, key: str,
                      exact: tuple[int, ...] = ()) -> Handle:
        """Begin the average over the replicate group of ``packed`` ``(R, n)``, row ``q`` landing in replica
        ``q``'s ``output`` ``(n,)``: the first half of the all-reduce, in the wire dtype. ``n_flags`` and
        ``exact`` (see :meth:`Int8ErrorFeedbackHop.start_scatter`) need nothing special here: every column is
        reduced the same way in every row."""
        if self.dtype is None or self.dtype == packed.dtype:
            return comm.reduce_scatter(output, packed.view(-1), "replicate", op=dist.ReduceOp.AVG, async_op=True,
                                       label=_label(key))
        wire_out = torch.empty(output.shape, dtype=self.dtype, device=output.device)
        handle = comm.reduce_scatter(wire_out, packed.view(-1).to(self.dtype), "replicate", op=dist.ReduceOp.AVG,
                                     async_op=True, label=_label(key))
        return handle.then(lambda: output.copy_(wire_out))

    def state_dict(self) -> None:
        """``None``: this hop keeps no state across steps."""
        return None  # stateless

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Nothing to restore (stateless)."""


@dataclass
class Int8ErrorFeedbackHop:
    """Per-block symmetric int8 quantisation with error feedback (1-bit-Adam style residuals).

    Each replica adds its residual (what earlier rounding lost) to the gradient, quantises blocks of
    ``block_size`` with one fp32 scale each, keeps the new rounding error as residual, and all-gathers the
    int8 payload and the scales; every replica then averages the dequantised values, so all replicas
    apply the same gradient. Inter-node bytes: ``(R-1) * n * (1 + 4/block_size)`` per rank versus
    ``2 (R-1)/R * n * 4`` for an fp32 all-reduce and half that in bf16: an all-gather grows with R, so it
    wins only for small replica counts (below about R=5 against a bf16 hop, R=9 against fp32) and on
    links slow enough to pay for the quantisation's compute. With ``shard_optimizer_across_replicas`` it
    reduce-scatters instead (:meth:`start_scatter`): ``(R-1)/R * n * (1 + 4/block_size)``, whatever R.

    ``two_stage`` (from 3 replicas; DiLoCo's int8 wire, ``optim/outer_wire.py``): the average as a reduce-scatter
    then an all-gather, both in int8, ``2 (R-1)/R * n * (1 + 4/block_size)`` per rank, the all-reduce floor in
    int8 (at R = 3, two thirds of the all-gather's bytes). Each replica averages one chunk of blocks in fp32 from
    every replica's int8 (an all-to-all), quantises that mean again and all-gathers it, so every replica still
    applies the same values; the second rounding has no error feedback (the chunk a replica owns changes with
    the replica count) and is issued by the hop worker the moment the first stage completes (:meth:`flush`), or
    else when the handle is waited: the per-step hop, waited at the end of backward, keeps the all-gather.
    """

    block_size: int = 256
    residuals: dict[str, torch.Tensor] = field(default_factory=dict)
    two_stage: bool = False
    _second: list[_SecondStage] = field(default_factory=list, repr=False, compare=False)  # started, not yet flushed

    @property
    def waits_locally(self) -> bool:
        """Its wait dequantises; a two-stage average's wait may issue the all-gather (``waits_locally``)."""
        return not self.two_stage

    def flush(self, comm: Comm) -> None:
        """Issue the second stages of the two-stage averages started since the last flush behind their first
        stages, in start order on every rank: on CPUs the mesh's hop worker (``hop_worker.py``) waits for each
        first stage and issues its all-gathers the moment it completes; on a device the host issues them now,
        the stream waiting for the first stage. The whole average then completes in the background, and a late
        wait (DiLoCo's delayed landing) or a :meth:`Handle.ready` poll finds it done. Call after starting a sync's
        averages, before any other inter-node collective. Unflushed, a second stage is issued at its wait."""
        stages, self._second = self._second, []
        if stages and comm.mesh.device.type != "cpu":
            for stage in stages:  # a device queues the wait for the first stage: the host issues the second now
                stage.issue()
        elif stages:
            chained = comm.chain(lambda: [stage.issue() for stage in stages], "int8 second stages")
            for stage in stages:
                stage.chained = chained

    def start(self, buffer: torch.Tensor, n_flags: int, comm: Comm, key: str) -> Handle:
        """Quantise ``buffer`` plus this unit's residual, keep the new residual, and begin the all-gathers of
        the int8 blocks and their scales (``two_stage`` from 3 replicas: the reduce-scatter's all-to-alls); the
        handle's wait leaves every replica's mean in ``buffer``."""
        r = comm.size("replicate")
        if r == 1:
            return Handle()
        if self.two_stage and r > 2:
            return self._start_two_stage(buffer, n_flags, comm, key, r)
        n = buffer.numel() - n_flags
        x = buffer[:n].float() + self.residuals.get(key, 0)
        q, scale, sent = _quantise(x.view(1, n), self.block_size)
        q, scale = q[0], scale[0]
        n_blocks = scale.numel()
        self.residuals[key] = x - sent[0]
        meta = torch.cat([scale, buffer[n:].float()])
        q_all = torch.empty(r * q.numel(), dtype=torch.int8, device=buffer.device)
        meta_all = torch.empty(r * meta.numel(), device=buffer.device)
        handles = [comm.all_gather(q_all, q.view(-1), "replicate", async_op=True, label=_label(key)),
                   comm.all_gather(meta_all, meta, "replicate", async_op=True, label=f"{_label(key)} scales")]

        def decompress() -> None:
            metas = meta_all.view(r, -1)
            values = q_all.view(r, n_blocks, self.block_size).float() * metas[:, :n_blocks, None]
            buffer[:n].copy_(values.mean(dim=0).view(-1)[:n])
            buffer[n:].copy_(metas[:, n_blocks:].mean(dim=0))

        return Handle.all(handles, on_done=decompress)

    def _start_two_stage(self, buffer: torch.Tensor, n_flags: int, comm: Comm, key: str, r: int) -> Handle:
        """:meth:`start` as a reduce-scatter and an all-gather (class docstring, ``two_stage``): replica ``q``
        owns blocks ``[q * per, (q + 1) * per)`` of the mean; the flags cross whole in fp32 in the second stage."""
        n, b, device = buffer.numel() - n_flags, self.block_size, buffer.device
        x = buffer[:n].float() + self.residuals.get(key, 0)
        q, scale, sent = _quantise(x.view(1, n), b)
        self.residuals[key] = x - sent[0]
        n_blocks = scale.shape[1]
        per = -(-n_blocks // r)  # blocks of the mean each replica owns (the last ones zero-padded)
        q_rows = torch.zeros(r * per * b, dtype=torch.int8, device=device)
        q_rows[: n_blocks * b] = q[0]
        s_rows = torch.zeros(r * per, device=device)
        s_rows[:n_blocks] = scale[0]
        q_mine = torch.empty(r * per * b, dtype=torch.int8, device=device)
        s_mine = torch.empty(r * per, device=device)
        label, tail = _label(key), buffer[n:].float()
        first = [comm.all_to_all(q_mine, q_rows, [per * b] * r, [per * b] * r, "replicate", async_op=True,
                                 label=label),
                 comm.all_to_all(s_mine, s_rows, [per] * r, [per] * r, "replicate", async_op=True,
                                 label=f"{label} scales")]

        def mean_chunk() -> tuple[torch.Tensor, torch.Tensor]:  # this replica's chunk of the mean, again int8
            mean = (q_mine.view(r, per, b).float() * s_mine.view(r, per, 1)).mean(dim=0)
            q2, s2, _ = _quantise(mean.view(1, -1), b)
            return q2.view(-1), torch.cat([s2[0], tail])

        def land(q_all: torch.Tensor, meta_all: torch.Tensor) -> None:
            metas = meta_all.view(r, -1)
            buffer[:n].copy_((q_all.view(r, per, b).float() * metas[:, :per, None]).view(-1)[:n])
            buffer[n:].copy_(metas[:, per:].mean(dim=0))

        stage = _SecondStage(first, comm, label, mean_chunk, land)
        self._second.append(stage)
        return Handle(on_done=stage.finish, ready_when=stage.ready)

    def start_scatter(self, output: torch.Tensor, packed: torch.Tensor, n_flags: int, comm: Comm, key: str,
                      exact: tuple[int, ...] = ()) -> Handle:
        """The reduce-scatter of ``shard_optimizer_across_replicas`` with error feedback: ``packed`` ``(R, m)``
        holds this rank's values for replica ``q`` in row ``q``. Each row plus its residual is quantised in int8
        blocks (one fp32 scale each), the new rounding error kept as the row's residual (``{key: (R, m -
        n_flags)}``), and an all-to-all sends row ``q``'s blocks and scales to replica ``q``, which dequantises
        what every replica sent and averages it in fp32 into ``output`` ``(m,)``. Inter-node bytes: ``(R-1)/R``
        of the int8 payload, about a quarter of an fp32 reduce-scatter's.

        The last ``n_flags`` columns (flags, batch weights) and the columns ``exact`` (0-d parameters, which
        every row carries whole) cross in fp32 without a residual: quantised per row, their copies would land
        differently on each replica, which must all step them alike."""
        r, m = comm.size("replicate"), packed.shape[1]
        n, keep = m - n_flags, list(exact)
        x = packed[:, :n].float() + self.residuals.get(key, 0)
        exact_values = torch.cat([x[:, keep], packed[:, n:].float()], dim=1)
        x[:, keep] = 0.0  # no residual either: the exact columns are not quantised
        q, scale, sent = _quantise(x, self.block_size)
        self.residuals[key] = x - sent
        meta = torch.cat([scale, exact_values], dim=1)
        n_blocks, width = scale.shape[1], q.shape[1]
        q_recv = torch.empty(r * width, dtype=torch.int8, device=packed.device)
        meta_recv = torch.empty(r * meta.shape[1], device=packed.device)
        handles = [comm.all_to_all(q_recv, q.reshape(-1), [width] * r, [width] * r, "replicate", async_op=True,
                                   label=_label(key)),
                   comm.all_to_all(meta_recv, meta.reshape(-1), [meta.shape[1]] * r, [meta.shape[1]] * r,
                                   "replicate", async_op=True, label=f"{_label(key)} scales")]

        def decompress() -> None:
            metas = meta_recv.view(r, -1)
            values = q_recv.view(r, n_blocks, self.block_size).float() * metas[:, :n_blocks, None]
            mean, exact_mean = values.mean(dim=0).view(-1)[:n], metas[:, n_blocks:].mean(dim=0)
            mean[keep] = exact_mean[: len(keep)]
            output[:n].copy_(mean)
            output[n:].copy_(exact_mean[len(keep):])

        return Handle.all(handles, on_done=decompress)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The residuals, ``{unit key: 1-D tensor}`` (saved with the optimizer state by ``save_checkpoint``)."""
        return dict(self.residuals)

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore (some units') residuals returned by :meth:`state_dict`."""
        self.residuals.update(state)


@dataclass(eq=False)
class _SecondStage:
    """A two-stage int8 average after its first stage (the all-to-alls) was issued: the all-gathers of every
    replica's re-quantised chunk of the mean, issued once flushed (by the hop worker on CPUs: ``chained``), or else
    by the wait itself (:meth:`finish`)."""

    first: list[Handle]
    comm: Comm
    label: str
    mean_chunk: Callable[[], tuple[torch.Tensor, torch.Tensor]]
    land: Callable[[torch.Tensor, torch.Tensor], None]
    chained: Chained | None = None
    issued: bool = False
    second: list[Handle] = field(default_factory=list)
    gathered: tuple[torch.Tensor, torch.Tensor] | None = None

    def issue(self) -> None:
        """Wait for the first stage, then issue the all-gathers (async: the caller need not wait for them)."""
        self.issued = True
        for handle in self.first:
            handle.wait()
        q2, meta = self.mean_chunk()
        r = self.comm.size("replicate")
        q_all = torch.empty(r * q2.numel(), dtype=torch.int8, device=q2.device)
        meta_all = torch.empty(r * meta.numel(), device=meta.device)
        self.second = [self.comm.all_gather(q_all, q2, "replicate", async_op=True, label=f"{self.label} mean"),
                       self.comm.all_gather(meta_all, meta, "replicate", async_op=True,
                                            label=f"{self.label} mean scales")]
        self.gathered = (q_all, meta_all)

    def ready(self) -> bool:
        flushed = self.chained.ready() if self.chained is not None else self.issued
        return flushed and all(h.ready() for h in self.second)

    def finish(self) -> None:
        """The wait: the second stage issued (by the hop worker, at the flush, or here), waited, and the mean
        landed."""
        if self.chained is not None:
            self.chained.wait()  # re-raises what the worker's issue raised
        elif not self.issued:
            self.issue()
        for handle in self.second:
            handle.wait()
        assert self.gathered is not None
        self.land(*self.gathered)


def _quantise(x: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Symmetric int8 of each row of ``x`` ``(rows, n)`` in blocks of ``block_size`` (the last zero-padded):
    the int8 blocks ``(rows, n_blocks * block_size)``, their fp32 scales ``(rows, n_blocks)`` and the
    dequantised values ``(rows, n)``."""
    rows, n = x.shape
    n_blocks = -(-n // block_size)
    padded = torch.zeros(rows, n_blocks * block_size, device=x.device)
    padded[:, :n] = x
    blocks = padded.view(rows, n_blocks, block_size)
    scale = blocks.abs().amax(dim=2).clamp_min(1e-30) / 127.0
    q = torch.round(blocks / scale[:, :, None]).clamp_(-127, 127).to(torch.int8)
    sent = (q.float() * scale[:, :, None]).view(rows, -1)[:, :n]
    return q.view(rows, -1), scale, sent


@dataclass
class NoHop:
    """Nothing crosses nodes: the reduced gradient stays the replica's own average (DiLoCo's inner steps,
    ``replica_sync.py``, whose replicas sync their weights every H steps instead)."""

    waits_locally = True

    def start(self, buffer: torch.Tensor, n_flags: int, comm: Comm, key: str) -> Handle:
        return Handle()

    def state_dict(self) -> None:
        return None

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        pass


def start_split_over_tp(hop: ReplicaHop, buffer: torch.Tensor, comm: Comm, key: str) -> Handle:
    """``hop.start`` for a unit whose parameters are replicated across the tensor-parallel group (plain
    parameters of a tensor-parallel model: embeddings, head, norms): its reduced shard is the same on the T
    ranks of a node's tp group, so each sends only a 1/T piece across nodes and the tp group all-gathers the
    pieces inside the node. Inter-node bytes stay at the floor instead of T times it; the price is one
    intra-node all-gather of the shard. Needs a hop without per-rank state (``AllReduceHop``)."""
    t, n = comm.size("tp"), buffer.numel()
    piece = -(-n // t)
    padded = buffer if n == t * piece else buffer.new_zeros(t * piece)
    if padded is not buffer:
        padded[:n].copy_(buffer)
    mine = padded[comm.mesh.tp_rank * piece: (comm.mesh.tp_rank + 1) * piece]
    handle = hop.start(mine, 0, comm, key)

    def gather() -> None:
        comm.all_gather(padded, mine.clone(), "tp", label=f"{_label(key)} tp pieces")
        if padded is not buffer:
            buffer.copy_(padded[:n])

    return handle.then(gather)


def can_scatter(hop: Any) -> bool:
    """Whether ``hop`` can reduce-scatter across replicas (needed by ``shard_optimizer_across_replicas``)."""
    return callable(getattr(hop, "start_scatter", None))


# The built-in hops by the names configuration files and the planner use.
HOP_NAMES = ("fp32", "bf16", "int8")


def named_hop(name: str) -> ReplicaHop:
    """A fresh built-in hop by name: ``"fp32"`` (exact all-reduce), ``"bf16"`` (all-reduce in bf16, half
    the inter-node bytes), ``"int8"`` (error-feedback int8, about a quarter)."""
    if name == "fp32":
        return AllReduceHop()
    if name == "bf16":
        return AllReduceHop(torch.bfloat16)
    if name == "int8":
        return Int8ErrorFeedbackHop()
    raise ValueError(f"unknown replica hop {name!r}: choose one of {', '.join(HOP_NAMES)}")
