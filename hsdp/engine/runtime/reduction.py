"""The two-hop gradient reduction of one unit: reduce-scatter in the shard group, then the replica hop.

Stages: ``start`` issues the reduce-scatter (async) -> ``start_replica_hop`` waits for it and, on a sync
step, starts the inter-node hop (async) -> ``finish`` waits and hands each sharded parameter its gradient.
The runtime chains each hop right behind its own reduce-scatter: on CUDA a wait on the hop stream (see
``streams.py``); on CPUs, where a wait blocks the thread that makes it, the mesh's hop worker thread waits and
issues the hop (``hop_worker.py``). Either way the hop overlaps the backward of earlier units, and the last
units' hops overlap each other.

Deferred sync (gradient accumulation): on a micro-batch that does not sync replicas, the reduce-scattered
shard is added to the unit's fp32 ``partial`` and nothing crosses nodes; the sync micro-batch sends the
whole partial sum once, so inter-node bytes per optimizer step do not grow with the micro-batch count.

Replica-sharded optimizer (``shard_optimizer_across_replicas``): the hop reduce-scatters the shard across
replicas instead of all-reducing it, so each rank ends with the reduced gradient of its slice only
(``replica_slice.py``); the flags travel in every replica's part.

Each rank appends one "has gradient" flag per parameter to every chunk of its reduce-scatter input. After
both averaging hops the flag is positive iff some rank produced a gradient, which gives exactly DDP's
semantics for unused parameters (gradient ``None`` only when unused everywhere) without an extra collective.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable

import torch
import torch.distributed as dist

from hsdp.engine.collectives import Chained, Handle
from hsdp.engine.hops import NoHop, start_split_over_tp, waits_locally
from hsdp.engine.runtime import batch_weight
from hsdp.engine.runtime.batch_weight import SLOTS, Weight
from hsdp.engine.runtime.late_grads import raw_grad
from hsdp.engine.runtime.piece_hop import follow_plan, plan_of, start_piece_hops
from hsdp.engine.runtime.piece_scatter import start_piece_scatters
from hsdp.engine.runtime.piece_slice import PieceSliceLayout
from hsdp.engine.runtime.replica_slice import SliceLayout, pack_gradient, packed_numel, replicated_columns
from hsdp.engine.runtime.sharded_param import ShardedParam
from hsdp.engine.runtime.unit import ShardUnit


def reduced_params(unit: ShardUnit) -> list[ShardedParam]:
    """The parameters a unit's reduction carries, in slot order: the trainable ones."""
    return [p for p in unit.params if p.requires_grad]


def slot_offsets(params: list[ShardedParam]) -> list[int]:
    """Where each parameter's chunk starts in a reduced slot: padded chunks back to back (the flags follow).
    Hop state (error-feedback residuals) is laid out the same way."""
    return _running_offsets([p.layout.padded_numel for p in params])


def _running_offsets(numels: list[int]) -> list[int]:
    offsets, offset = [], 0
    for n in numels:
        offsets.append(offset)
        offset += n
    return offsets


def reduce_grads(unit: ShardUnit, sync_shards: bool = True, sync_replicas: bool = True,
                 weight: Weight | None = None) -> Reduction | None:
    """Take a unit's unsharded gradients, reshard it, and start their reduce-scatter; ``None`` when nothing
    is communicated.

    Resharding comes first (as in FSDP2's post_backward) so that the unit's unsharded parameters are
    freed before the reduce-scatter buffers are allocated: that moment is the peak of many steps.

    Every rank that ran this unit in forward must call this, even when its own gradients are all
    ``None``: it then contributes zeros, and the gradient stays ``None`` only if no rank had one.
    ``sync_shards=False`` keeps fp32 unsharded sums instead (no communication this micro-batch);
    ``sync_replicas=False`` reduce-scatters but defers the inter-node hop. ``weight``: this backward's batch
    weight (``batch_weight.py``; ``None``: the plain average).
    """
    trainable = reduced_params(unit)
    if not trainable:
        unit.reshard()
        return None
    if not sync_shards:
        for p in trainable:
            p.accumulate_unsharded_grad(weight)
        unit.window_weight = batch_weight.add(unit.window_weight, weight)
        unit.reshard()
        return None
    grads = [p.take_unsharded_grad(weight) for p in trainable]
    unit.reshard()
    window, unit.window_weight = unit.window_weight, None
    return Reduction.start(unit, trainable, grads, sync_replicas, weight, window)


class Stage(enum.Enum):
    REDUCE_SCATTER = "reduce_scatter"
    REPLICA_HOP = "replica_hop"
    SUMMED = "summed"  # a micro-batch without the replica sync: added to the unit's partial sum
    DONE = "done"


class Reduction:
    """An in-flight gradient reduction for the trainable parameters of one unit."""

    def __init__(self, unit: ShardUnit, params: list[ShardedParam], output: torch.Tensor, handle: Handle,
                 sync_replicas: bool) -> None:
        self.unit = unit
        self.params = params
        self.output = output  # 1D: this rank's reduced slot, then one flag per parameter and the weight slots
        self.n_extra = len(params) + SLOTS  # the values after the slot (batch_weight.py)
        self.sync_replicas = sync_replicas
        self.weighted = False  # this rank weighted its batch: divide by the averaged weight once reduced
        self._converted = False
        self._handle = handle
        self._rs_input: torch.Tensor | None = None  # CUDA: held until the compute stream waited (release_input)
        # CUDA: the ends of the reduce-scatter and of the hop on their streams (streams.py, Streams.record).
        self._scattered: torch.cuda.Event | None = None
        self._hopped: torch.cuda.Event | None = None
        self.stage = Stage.REDUCE_SCATTER
        self._chained: Chained | None = None  # CPU: the hop issued by the hop worker (hop_worker.py)
        self.missing = False  # some parameter had no gradient on this rank (its flag needs reading)
        self.waits_locally = False  # its hop was issued and waiting for it issues no collective (late_grads.py)
        # Set by finish: the reduced flags, and which parameters this reduction gave their first gradient.
        self.flags: torch.Tensor | None = None
        self.created: list[bool] = []

    @classmethod
    def start(cls, unit: ShardUnit, params: list[ShardedParam], grads: list[torch.Tensor | None],
              sync_replicas: bool, weight: Weight | None = None, window: Weight | None = None) -> Reduction:
        """Copy ``grads`` into the reduce-scatter input and issue it. Consumes ``grads`` (the list is
        emptied): the unsharded gradients are freed before the output is allocated, as in FSDP2."""
        comm, s = unit.comm, unit.sharding_degree
        device = unit.sharded_flat.device
        dtype = unit.policy.reduce(params[0].dtype)
        # _chunk_cat casts into its output, but needs one input dtype (fp32 sums may meet bf16 grads).
        in_dtypes = {g.dtype for g in grads if g is not None}
        in_dtype = in_dtypes.pop() if len(in_dtypes) == 1 else dtype
        # In the reduction's dtype: a weight (a token count) must not round to the gradients' bf16 on the way.
        flags = batch_weight.extras(_flags(grads, dtype, device), weight, window)
        missing = any(g is None for g in grads)
        slices = _slices(params)
        if slices is None or isinstance(slices[0], PieceSliceLayout):  # pieces: sliced after the node's reduction
            rs_input = _chunked_input(params, grads, flags, in_dtype, dtype, device, s)
        else:
            rs_input = _packed_input(params, slices, grads, flags, dtype, device, s)
        grads.clear()
        output = rs_input.new_empty(rs_input.shape[1])
        with unit.streams.on("reduce_scatter"):  # after the copy-in above, on the compute stream
            handle = comm.reduce_scatter(output, rs_input.view(-1), "shard", op=dist.ReduceOp.AVG, async_op=True,
                                         label=unit.name)
            if unit.streams.enabled:
                # The reduce-scatter stream waits for the collective (no host block): the event below then
                # marks the collective's end, which the compute stream waits for before dropping the input.
                handle.wait()
            scattered = unit.streams.record("reduce_scatter")
        reduction = cls(unit, params, output, handle, sync_replicas)
        reduction._scattered, reduction.missing, reduction.weighted = scattered, missing, weight is not None
        if unit.streams.enabled:
            # Held until the compute stream waited for the reduce-scatter (release_input). Without streams the
            # collective's own work holds it, and drops it as soon as it completes: hold nothing more.
            reduction._rs_input = rs_input
        return reduction

    def release_input(self) -> None:
        """Drop the reduce-scatter input (a whole unit of gradients) once the compute stream is ordered after
        the collective reading it, as FSDP2 does: called when the next unit's reduction starts, before it
        allocates. The allocator can then hand the block to that unit at once, so at most two inputs are ever
        held, however far the host runs ahead of the device (``record_stream`` would hold each one until the
        device got there)."""
        if self._rs_input is not None:
            self.unit.streams.wait(self._scattered)
            self._rs_input = None

    def start_replica_hop(self) -> None:
        """Wait for the reduce-scatter and start the inter-node hop. The wait blocks the host where the
        device does not queue work (gloo on CPUs); on CUDA it only makes the hop stream wait. Chained on a
        hop worker (:meth:`chain_hop`): wait until the worker has started it."""
        if self._chained is not None:
            chained, self._chained = self._chained, None
            chained.wait()
            return
        self._issue_hop()

    def chain_hop(self) -> None:
        """Have the mesh's hop worker wait for the reduce-scatter and start the hop the moment it completes
        (CPUs, where the host's wait would block the backward; see ``hop_worker.py``)."""
        self._chained = self.unit.comm.chain(self._issue_hop, self.unit.name, blocked_on=self._handle)

    def _issue_hop(self) -> None:
        if self.stage is not Stage.REDUCE_SCATTER:
            return
        # On the hop stream, which waits for the reduce-scatter, not for the backward still running.
        with self.unit.streams.on("replica_hop", after_compute=False):
            self._start_replica_hop()

    def _start_replica_hop(self) -> None:
        streams = self.unit.streams
        self._handle.wait()
        self._handle = Handle()
        streams.wait(self._scattered)
        self._hop()
        if streams.enabled and self.stage is Stage.REPLICA_HOP:
            # Converted unit by unit on the hop stream, so each reduce-dtype shard is released here rather than
            # beside the gradients at the end of backward. The wait costs no overlap: one group's collectives
            # run one after the other anyway.
            self._handle.wait()
            self._handle = Handle()
            self._finish_values()
        self._hopped = streams.record("replica_hop")

    def _set_output(self, tensor: torch.Tensor) -> None:
        """Replace ``output`` on the hop stream: the old one (maybe allocated on the compute stream, as the
        reduce-scatter output or a partial sum moved by ``.to()`` is) may still be read by the hop stream's
        queued work, so the allocator must not hand its block out before the hop stream gets there."""
        self.unit.streams.release_after(self.output, "replica_hop")
        self.output = tensor

    def _finish_values(self) -> None:
        """Once: the reduced shard in the sharded parameters' dtype (their gradients'), divided by the averaged
        batch weight where this rank weighted its batch."""
        if self._converted:
            return
        self._converted = True
        if self.unit.phase_weight is not None:
            self._add_phase_weight()
        dtype = self.params[0].dtype
        if self.output.dtype != dtype:
            self._set_output(self.output.to(dtype))
        if self.weighted:
            batch_weight.normalize_(self.output, self.n_extra)

    def _add_phase_weight(self) -> None:
        """DiLoCo: add this backward's weight on this replica to the unit's phase weight. The slot holds the mean over
        the replica's ranks (of the window's sum; nothing crosses replicas): times the degree, the replica's sum;
        unweighted, 1 (per backward at any degree: where weights always travel, elastic, replicas count once)."""
        unit, share = self.unit, self.unit.sharding_degree if self.weighted else 1
        unit.phase_weight.add_(self.output[-SLOTS].to(unit.phase_weight.dtype) * share)
        unit.phase_weighted |= self.weighted

    def _hop(self) -> None:
        unit = self.unit
        if unit.partial is not None or not self.sync_replicas:
            # fp32 partial sums: low-precision accumulation across micro-batches loses accuracy.
            if unit.partial is None:
                unit.partial = self.output.float()
            else:
                unit.partial += self.output
            if not self.sync_replicas:
                # Summed into the partial: do not hold the buffer until the end of backward (a view would).
                self._set_output(self.output.new_empty(0))
                self.stage = Stage.SUMMED
                return
            self._set_output(unit.partial)
            unit.partial = None
        hop_dtype = unit.policy.reduce(self.params[0].dtype)  # a sync after fp32 partial sums: back to it
        if self.output.dtype != hop_dtype:
            self._set_output(self.output.to(hop_dtype))
        if _slices(self.params) is not None:
            self._handle = self._start_scatter()
        else:
            # Nothing crosses replicas under DiLoCo (NoHop): the replica's own average, no pieces, no pre-scale.
            # A grid has no plan: the whole slot is one hop over the "replicate" group. Replicas of different
            # degrees reduce pieces, per tp coordinate under tensor parallelism.
            plan = None if isinstance(unit.hop, NoHop) else plan_of(
                unit.comm, self.params, slot_offsets(self.params), self.n_extra, self.output.numel() - self.n_extra,
                unit.piece_plans)
            if plan is not None:
                if unit.comm.mesh.replicas.transactional:  # (elastic) quorums of other degrees, discarded steps
                    follow_plan(unit.hop, unit.key, unit.hop_plan, plan, self.output.numel() - self.n_extra,
                                self.output.device)
                    unit.hop_plan = plan
                self._handle = start_piece_hops(unit.hop, self.output, plan, unit.comm, unit.key)
                self.waits_locally = waits_locally(unit.hop)
            # A stateful hop (error feedback) keeps its residual laid out like the whole slot: no 1/T pieces. Nor
            # where the layer discards steps (elastic): a member lost mid-step can fail one tp rank's hop and not
            # another's, and the tp all-gather behind the hop would then wait for a rank that dropped its step.
            elif unit.tp_replicated and unit.hop.state_dict() is None and not unit.comm.mesh.replicas.transactional:
                self._handle = start_split_over_tp(unit.hop, self.output, unit.comm, unit.key)
            else:
                self._handle = unit.hop.start(self.output, self.n_extra, unit.comm, unit.key)
                self.waits_locally = waits_locally(unit.hop)
        self.stage = Stage.REPLICA_HOP

    def _start_scatter(self) -> Handle:
        """Reduce-scatter the reduced shard, already packed replica-major by the reduce-scatter inside the node
        (``_packed_input``), across replicas; ``output`` becomes this replica's part: its slices, then the
        flags."""
        unit = self.unit
        slices = _slices(self.params)
        if isinstance(slices[0], PieceSliceLayout):  # replicas of different degrees: piece by piece
            handle, result = start_piece_scatters(unit.hop, self.output, self.params, self.n_extra,
                                                  unit.comm.mesh.replicas, unit.comm, unit.key)
            self._set_output(result)
            return handle
        packed = self.output.view(unit.comm.size("replicate"), -1)
        self._set_output(self.output.new_empty(packed.shape[1]))
        # 0-d parameters sit whole in every replica's part: a lossy hop must send them exactly (hops.py).
        exact = replicated_columns(slices)  # type: ignore[arg-type]
        return unit.hop.start_scatter(self.output, packed, self.n_extra, unit.comm, unit.key, exact)

    def abandon(self, quiet: bool = False) -> None:
        """Wait for the collective in flight and drop its result (the backward that started it raised; ``quiet``:
        a collective that fails too, as the rest of an elastic step's hops do once a peer left, is dropped)."""
        if self._chained is not None:
            self._chained.settle()  # let the worker's issue end; the backward's own error is the one to see
            self._chained = None
        try:
            self._handle.wait()
        except RuntimeError:
            if not quiet:
                raise
        self._handle = Handle()
        self.unit.streams.wait(self._scattered)
        self.unit.streams.wait(self._hopped)
        self._rs_input = None
        self.output = self.output.new_empty(0)  # the compute stream waited for both streams: drop at once
        self.stage = Stage.DONE

    def finish(self) -> None:
        """Wait for both hops and accumulate the reduced shards into ``param.grad`` of the sharded params."""
        if self.stage is Stage.DONE:
            return
        self.start_replica_hop()
        self.release_input()
        if self.stage is Stage.SUMMED:
            # No replica sync this micro-batch, but the hop stream still wrote the partial sum: order the compute
            # stream after it, or a read or free of the partial (a torn step, a .to()) would race it.
            self.unit.streams.wait(self._hopped)
            self.stage = Stage.DONE
            return
        self._handle.wait()
        self.unit.streams.wait(self._hopped)
        self._finish_values()  # on CUDA done unit by unit on the hop stream already
        slices = _slices(self.params)
        if slices is None:
            parts = _parts(self.output, slot_offsets(self.params), [p.layout.local_shape for p in self.params])
        else:
            parts = _parts(self.output, _running_offsets([s.padded_numel for s in slices]),
                           [s.local_shape for s in slices])
        # Every parameter gets its part now, zeros for one no rank used; which had a gradient nowhere is read
        # once per step on the host, after every reduction (drop_unused_grads): no host sync per unit.
        self.created = [raw_grad(p.sharded) is None for p in self.params]  # raw: maybe landing late (late_grads.py)
        for p, part in zip(self.params, parts, strict=True):
            p.accumulate_grad(part)
        self.flags = self.output[-self.n_extra: -SLOTS]
        self.stage = Stage.DONE


def drop_unused_grads(reductions: list[Reduction], deferred: list[DeferredRead] | None = None) -> None:
    """After every reduction of a backward finished, where some parameter had no gradient on this rank: the
    step's one host read, of all the "has gradient" flags at once. A parameter no rank produced a gradient
    for gets ``grad = None`` back (DDP's semantics for unused parameters) where this backward created its
    gradient; one that already had a gradient got zeros added, which leaves it as it was.

    ``deferred``: values queued since the last read (``(1-element tensor, callback)``, e.g. the last
    ``clip_grad_norm_``'s total norm), read in the same copy and handed to their callbacks, then cleared."""
    done = [r for r in reductions if r.flags is not None]
    pending = deferred if deferred else []
    if not done and not pending:
        return
    # fp32: the flags may be bf16, a deferred value must keep its precision.
    values = torch.cat([r.flags.float() for r in done] + [t.float().reshape(1) for t, _ in pending]).tolist()
    flat = iter(values)
    for r in done:
        for p, created in zip(r.params, r.created, strict=True):
            if not next(flat) > 0 and created:
                p.sharded.grad = None
        r.flags = None
    callbacks = [callback for _, callback in pending]
    pending.clear()  # before the callbacks: one may raise (a failed check), and must not be read again
    for callback, value in zip(callbacks, flat, strict=True):
        callback(value)


DeferredRead = tuple[torch.Tensor, Callable[[float], None]]


def _flags(grads: list[torch.Tensor | None], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The "has gradient" flags, written on the device (a tensor from a Python list would be a blocking copy
    from the host on every post-backward)."""
    flags = torch.ones(len(grads), dtype=dtype, device=device)
    for i, g in enumerate(grads):
        if g is None:
            flags[i].fill_(0.0)
    return flags


def _slices(params: list[ShardedParam]) -> list[SliceLayout] | list[PieceSliceLayout] | None:
    """The replica slices of a unit's reduced parameters; ``None`` without replica sharding (all or none)."""
    slices = [p.slice for p in params]
    return None if slices[0] is None else slices  # type: ignore[return-value]


def _parts(buffer: torch.Tensor, offsets: list[int], shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
    """Views of each parameter's part of a flat reduction buffer."""
    return [buffer[o: o + math.prod(shape)].view(shape) for o, shape in zip(offsets, shapes, strict=True)]


def _chunked_input(params: list[ShardedParam], grads: list[torch.Tensor | None], flags: torch.Tensor,
                   in_dtype: torch.dtype, dtype: torch.dtype, device: torch.device, s: int) -> torch.Tensor:
    """The reduce-scatter input ``(S, slot + n_flags)``: row r is what rank r receives, its padded chunk of
    every gradient back to back (the slot layout), then the flags; casts on the way."""
    inputs = [_reduce_scatter_input(p, g, in_dtype, device, s) for p, g in zip(params, grads, strict=True)]
    # One copy of the flags in every rank's chunk; contiguous, so _chunk_cat keeps its fast path.
    inputs.append(flags.to(in_dtype).expand(s, -1).contiguous())
    n_out = sum(p.layout.padded_numel for p in params) + flags.numel()
    rs_input = torch.empty(s, n_out, dtype=dtype, device=device)
    torch._chunk_cat(inputs, dim=0, num_chunks=s, out=rs_input)
    if in_dtype != dtype:
        rs_input[:, -flags.numel():] = flags  # exact: the weight slot, not its rounding to in_dtype
    return rs_input


def _packed_input(params: list[ShardedParam], slices: list[SliceLayout], grads: list[torch.Tensor | None],
                  flags: torch.Tensor, dtype: torch.dtype, device: torch.device, s: int) -> torch.Tensor:
    """The replica-sharded reduce-scatter input ``(S, R x (packed slices + n_flags))``: rank r receives its
    chunks already packed replica-major, each replica's part ending with the flags, ready to be
    reduce-scattered across replicas as is (``replica_slice.py``). Same bytes copied as ``_chunked_input``."""
    r, width, n = slices[0].replicas, packed_numel(slices), flags.numel()
    # Zeros where something is left unwritten: padding rows, and the slots of gradients this rank has not.
    dense = all(g is not None and sl.even for sl, g in zip(slices, grads, strict=True))
    rs_input = (torch.empty if dense else torch.zeros)(s, r, width + n, dtype=dtype, device=device)
    for offset, sl, g in zip(_running_offsets([x.padded_numel for x in slices]), slices, grads, strict=True):
        if g is not None:
            pack_gradient(g, sl, rs_input[:, :, offset: offset + sl.padded_numel])
    rs_input[:, :, width:] = flags
    return rs_input.view(s, -1)


def _reduce_scatter_input(p: ShardedParam, grad: torch.Tensor | None, dtype: torch.dtype, device: torch.device,
                          s: int) -> torch.Tensor:
    """A gradient as ``_chunk_cat`` input: dim-0 chunks go to the shard ranks; a replicated (0-d) parameter's
    gradient goes whole to every rank (an expanded view, like the flags), so each receives the average."""
    g = torch.zeros(p.layout.global_shape, dtype=dtype, device=device) if grad is None else grad.to(dtype)
    return g.reshape(1, -1).expand(s, -1) if p.layout.replicated else g
