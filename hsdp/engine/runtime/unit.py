"""A unit: the parameters gathered by one all-gather and reduced by one reduce-scatter (FSDP2's param group).

Flat layout (per rank, "slot"): the padded chunks of the unit's parameters back to back. The sharded
parameters are views into ``sharded_flat``, so the all-gather input needs no copy-in; the all-gather output
is rank-major ``(S, slot)`` and one ``split_with_sizes_copy`` moves it into the unsharded parameters.
"""

from __future__ import annotations

import enum

import torch
from torch import nn
from torch.distributed.tensor import Shard

from hsdp.engine.collectives import Comm, Handle
from hsdp.engine.hops import AllReduceHop, ReplicaHop
from hsdp.engine.policy import FULL_PRECISION, MixedPrecision
from hsdp.engine.runtime.piece_plan import PiecePlan
from hsdp.engine.runtime.sharded_param import ShardedParam
from hsdp.engine.runtime.slice_gather import SliceGathers
from hsdp.engine.runtime.streams import Streams


class ShardedState(enum.Enum):
    SHARDED = "sharded"
    UNSHARDING = "unsharding"  # all-gather in flight
    UNSHARDED = "unsharded"


class ShardUnit:
    """Parameters of one module (minus those of nested units), sharded over the mesh's shard group."""

    def __init__(self, module: nn.Module, params: list[ShardedParam], comm: Comm,
                 reshard_after_forward: bool, key: str = "",
                 policy: MixedPrecision = FULL_PRECISION, hop: ReplicaHop | None = None) -> None:
        self.module = module
        self.params = params
        self.comm = comm
        self.reshard_after_forward = reshard_after_forward
        self.key = key  # the unit module's name in the model ("" for the root); names hop state
        self.policy = policy
        self.hop: ReplicaHop = hop or AllReduceHop()
        self.state = ShardedState.SHARDED
        self.name = f"{type(module).__name__}({key or 'root'})"
        # fp32 reduce-scattered gradient sum of micro-batches that did not sync replicas (1D, flags last).
        self.partial: torch.Tensor | None = None
        # What the micro-batches kept unsharded since the last reduce-scatter weighed (batch_weight.py).
        self.window_weight: float | torch.Tensor | None = None
        # DiLoCo (optim/outer_step.py): what this replica's backwards weighed since the unit's last sync, summed
        # over its ranks (None: not tracked, off DiLoCo), and whether any of them set a batch weight.
        self.phase_weight: torch.Tensor | None = None
        self.phase_weighted = False
        self._gather_handle: Handle | None = None
        self._gather_buffer: torch.Tensor | None = None
        self._gather_input: torch.Tensor | None = None
        self._gathered: torch.cuda.Event | None = None  # the end of the copy-in and gather on their stream
        # The side streams of the model's runtime (set by it; none on CPUs).
        self.streams = Streams(torch.device("cpu"))
        # Heterogeneous replicas: the reduction's piece plans per set of trainable parameters (piece_hop.py).
        self.piece_plans: dict[tuple[int, ...], PiecePlan | None] = {}
        self.hop_plan: PiecePlan | None = None  # the plan a stateful hop's state follows (piece_hop.follow_plan)
        # Replica-sharded optimizer: the model's queue of slice all-gathers (set by the runtime).
        self.slice_gathers: SliceGathers | None = None
        # Per-step bookkeeping, reset by the root at the end of backward.
        self.used_in_grad_forward = False
        self.pending_post_backward = 0
        self.sharded_flat = self._build_sharded_flat()

    # -- layout ------------------------------------------------------------------------------------------
    @property
    def slot_numel(self) -> int:
        return sum(p.layout.padded_numel for p in self.params)

    @property
    def sharding_degree(self) -> int:
        return self.comm.size("shard")

    @property
    def tp_replicated(self) -> bool:
        """Whether every parameter is whole on each rank of a tensor-parallel group of more than one rank (a
        tensor-parallel model's plain parameters): the replica hop can then split its bytes over the tp ranks
        (``hops.start_split_over_tp``)."""
        return self.comm.size("tp") > 1 and bool(self.params) and all(
            p.layout.tp is not None and not isinstance(p.layout.tp.placement, Shard) for p in self.params)

    @classmethod
    def empty(cls, module: nn.Module, comm: Comm, policy: MixedPrecision = FULL_PRECISION) -> ShardUnit:
        """A unit that owns no parameters: it only gives the root its hooks (and input/output casts)."""
        return cls(module, [], comm, reshard_after_forward=False, policy=policy)

    def _build_sharded_flat(self) -> torch.Tensor:
        # 1D: this rank's padded chunks of every parameter, in order; padding stays zero. On the mesh's
        # device whatever device the module was built on (see [Note: the device at wrap] in sharding.py);
        # meta stays meta until hsdp.materialize.
        device = self.comm.mesh.device
        if not self.params:
            return torch.empty(0, device=device)
        p0 = self.params[0]
        if p0.device.type == "meta":
            device = p0.device
        flat = torch.zeros(self.slot_numel, dtype=p0.dtype, device=device)
        offset = 0
        for p in self.params:
            view = flat[offset: offset + p.layout.padded_numel]
            if p.device == device:
                p.bind_sharded(view, self.comm.mesh.param_mesh)
            else:  # built elsewhere (a CPU model on a GPU mesh): its unsharded face moves to the device too
                p.rebind(view, self.comm.mesh.param_mesh, p.compute_dtype)
            offset += p.layout.padded_numel
        return flat

    def adopt_flat(self, flat: torch.Tensor, grads: list[torch.Tensor | None]) -> None:
        """Make ``flat`` (``sharded_flat`` converted to another dtype or device, same shape) this unit's shard
        buffer: every parameter is re-bound to its slot in it (``ShardedParam.rebind``), with ``grads`` (this
        rank's converted gradient chunks, ``None`` where there is none) and an unsharded face in the policy's
        compute dtype for the new dtype. Padding is zeroed (a conversion like ``to_empty`` leaves garbage).
        """
        assert self.state is ShardedState.SHARDED and flat.shape == self.sharded_flat.shape
        self.sharded_flat = flat
        compute = self.policy.compute(flat.dtype)
        offset = 0
        with torch.no_grad():
            for p, grad in zip(self.params, grads, strict=True):
                p.rebind(flat[offset: offset + p.layout.padded_numel], self.comm.mesh.param_mesh, compute, grad)
                p.to_sharded()
                if not flat.is_meta:
                    flat[offset + p.layout.local_numel: offset + p.layout.padded_numel].zero_()
                offset += p.layout.padded_numel

    def load_full(self, fulls: list[torch.Tensor]) -> None:
        """Copy this rank's chunk of each full tensor into the sharded parameters."""
        self.settle()  # a late slice gather must not overwrite what is loaded
        with torch.no_grad():
            for p, full in zip(self.params, fulls, strict=True):
                p.sharded_local.copy_(p.layout.chunk(full))

    # -- replica-sharded optimizer ------------------------------------------------------------------------
    def settle(self) -> None:
        """Finish this unit's slice all-gather after a replica-sliced optimizer step, if one is pending (see
        ``slice_gather.py``): the shards then hold every replica's update. Called before any read of them."""
        if self.slice_gathers is not None:
            self.slice_gathers.settle(self)

    # -- unshard / reshard (forward and pre-backward) -------------------------------------------------
    def unshard(self, async_op: bool = True) -> None:
        """Start the all-gather of this unit's parameters (no-op when unsharded or in flight)."""
        if self.state is not ShardedState.SHARDED:
            return
        self.settle()
        if not self.params:
            self.state = ShardedState.UNSHARDED
            return
        if self.sharded_flat.is_meta:
            raise ValueError(f"{self.name}: parameters are on the meta device (the model was built under "
                             f"torch.device('meta')): call hsdp.materialize(model) or hsdp.load_pretrained(model, "
                             f"path), or model.to_empty(device=...) and initialise them, before the forward")
        s = self.sharding_degree
        dtype = self.params[0].compute_dtype
        device = self.sharded_flat.device
        # Allocated on the compute stream and held until it waited for the gather (streams.py).
        self._gather_buffer = torch.empty(s * self.slot_numel, dtype=dtype, device=device)
        copy_in = dtype != self.sharded_flat.dtype or self.streams.enabled
        self._gather_input = torch.empty_like(self.sharded_flat, dtype=dtype) if copy_in else self.sharded_flat
        with self.streams.on("all_gather"):
            # Copy-in: the one cast of the step under mixed precision, and on a device a private copy, so that
            # the gather never reads the live shard; on CPUs without a cast it reads the shard in place.
            if copy_in:
                self._gather_input.copy_(self.sharded_flat)
            self._gather_handle = self.comm.all_gather(self._gather_buffer, self._gather_input, "shard",
                                                      async_op=async_op, label=self.name)
            self._gathered = self.streams.record("all_gather")
        self.state = ShardedState.UNSHARDING

    def wait_for_unshard(self) -> None:
        """Finish the all-gather, copy it into the unsharded parameters and expose them to the module."""
        if self.state is ShardedState.SHARDED:
            self.unshard(async_op=False)
        if self.state is ShardedState.UNSHARDED:
            return
        assert self._gather_handle is not None and self._gather_buffer is not None
        self._gather_handle.wait()
        self.streams.wait(self._gathered)
        for p in self.params:
            p.alloc_unsharded()
        gathered = self._gather_buffer.view(self.sharding_degree, self.slot_numel)
        outs = [p.all_gather_output for p in self.params]
        # The unsharded parameters may be saved by autograd from an earlier forward: refilling them with
        # the same values must not bump their version counter.
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(tuple(outs)):
            torch.split_with_sizes_copy(gathered, [p.layout.padded_numel for p in self.params], dim=1,
                                        out=outs)
        self._gather_buffer = self._gather_handle = self._gather_input = self._gathered = None
        for p in self.params:
            p.to_unsharded()
        self.state = ShardedState.UNSHARDED

    def reshard(self) -> None:
        """Free the unsharded parameters and put the sharded ones back into the module."""
        if self.state is ShardedState.UNSHARDING:
            self.wait_for_unshard()
        if self.state is ShardedState.SHARDED:
            return
        for p in self.params:
            p.free_unsharded()
            p.to_sharded()
        self.state = ShardedState.SHARDED

    def gathered_full(self) -> list[torch.Tensor]:
        """Full copies of every parameter (a collective in the shard group; state unchanged)."""
        self.settle()
        s = self.sharding_degree
        out = torch.empty(s * self.slot_numel, dtype=self.sharded_flat.dtype, device=self.sharded_flat.device)
        self.comm.all_gather(out, self.sharded_flat, "shard", label=self.name)
        pieces = out.view(s, self.slot_numel).split([p.layout.padded_numel for p in self.params], dim=1)
        return [piece.reshape(-1)[: p.unsharded.numel()].view(p.layout.global_shape).clone()
                for p, piece in zip(self.params, pieces, strict=True)]

    def __repr__(self) -> str:
        return f"ShardUnit({self.name}, params={len(self.params)}, state={self.state.value})"
