"""One parameter's sharded and unsharded faces: the chunk this rank owns (a view into its unit's flat
shard buffer, exposed as a DTensor) and the full tensor the module computes with (see ``layout.py``).
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from hsdp.engine.runtime.dtensor import local_of, sharded_parameter, to_sharded_dtensor, tp_dtensor, tp_local
from hsdp.engine.runtime.late_grads import raw_grad, set_raw_grad
from hsdp.engine.runtime.layout import ShardLayout
from hsdp.engine.runtime.piece_slice import PieceSliceLayout
from hsdp.engine.runtime.replica_slice import SliceLayout


@dataclass(frozen=True)
class ParamSlot:
    """A place a parameter is registered: ``module._parameters[name]``. Tied parameters have several."""

    module: nn.Module
    name: str
    fqn: str

    def set(self, param: nn.Parameter) -> None:
        # Direct dict write: nn.Module.__setattr__ is slow and would reject swaps during forward.
        self.module._parameters[self.name] = param


class ShardedParam:
    """The sharded and unsharded faces of one original parameter.

    ``sharded`` is the parameter the module exposes between steps and the optimizer sees: an
    ``nn.Parameter`` holding a ``DTensor`` ``Shard(0)`` on the replica's mesh (``HSDPMesh.param_mesh``) of
    the original (global) shape,
    whose local tensor (``sharded_local``) is a view into the unit's flat sharded buffer, so an in-place
    optimizer update is an update of the all-gather's input with no copy. Its gradient is a DTensor of the
    same layout over a view of the reduction output.
    ``unsharded`` has the original shape and takes part in autograd during forward and backward; its
    storage is a view into a padded buffer of ``S * padded_numel`` elements that is freed between uses.
    It is a plain tensor: the module's own forward code never sees a DTensor, except under tensor
    parallelism: a parameter that ``parallelize_module`` made a DTensor on the tp mesh (``tp_mesh`` given)
    keeps that face, its TP-local tensor gathered by hsdp (the modules' TP hooks compute with it), and its
    gradient is brought to the parameter's own tp placement (a ``Partial`` sum is all-reduced in the tp group
    by DTensor) before hsdp reduces the TP-local part.
    """

    def __init__(self, slots: list[ParamSlot], original: nn.Parameter, layout: ShardLayout,
                 compute_dtype: torch.dtype | None = None, tp_mesh: DeviceMesh | None = None) -> None:
        self.slots = slots
        self.fqn = slots[0].fqn
        self.layout = layout
        # Lets an optimizer built before wrapping be re-pointed at the shard, without keeping it alive.
        self.original_ref = weakref.ref(original)
        self._initial_requires_grad = original.requires_grad  # until the sharded parameter exists
        self.dtype = original.dtype
        self.device = original.device
        self.compute_dtype = compute_dtype or original.dtype
        # The tp sub-mesh when the module computes with a DTensor face (tensor-parallel parameter), else None.
        self.tp_mesh = tp_mesh
        # Set when the optimizer state is sharded across replicas too: the rows of the chunk this replica
        # reduces and steps (``replica_slice.py``); ``None``: it steps the whole chunk.
        # On replicas of different degrees a ``PieceSliceLayout`` (``piece_slice.py``): its part of each piece.
        self.slice: SliceLayout | PieceSliceLayout | None = None
        # A piece slice's own buffer of its parameter values (see opt_local): 1/R of the chunk, counted by
        # hsdp.state_bytes as parameter bytes.
        self.slice_values: torch.Tensor | None = None
        # The ("replicate", "shard") grid a slice's DTensors live on (a slice is split across replicas too).
        self.slice_mesh: DeviceMesh | None = None
        self.sharded: nn.Parameter  # DTensor; set by bind_sharded
        self.sharded_local: torch.Tensor  # 1D slot view shaped like this rank's chunk; set by bind_sharded
        self.device_mesh: DeviceMesh  # the replica's mesh (HSDPMesh.param_mesh); set by bind_sharded
        # fp32 sum of unsharded gradients kept across micro-batches when gradient sync is off.
        self.grad_acc: torch.Tensor | None = None
        # ND: the padded all-gather destination, shape (S, padded_numel); storage freed when resharded.
        self._make_unsharded(self.compute_dtype, original.requires_grad)

    def _make_unsharded(self, compute_dtype: torch.dtype, requires_grad: bool) -> None:
        """(Re-)create the unsharded face, storage freed, on ``self.device`` in ``compute_dtype``."""
        self.compute_dtype = compute_dtype
        self.unsharded_padded = torch.empty(
            self.layout.sharding_degree * self.layout.padded_numel, dtype=compute_dtype, device=self.device
        )
        full = self.unsharded_padded[: math.prod(self.layout.global_shape)].view(self.layout.global_shape)
        if self.tp_mesh is not None:
            assert self.layout.tp is not None
            full = tp_dtensor(full, self.tp_mesh, self.layout.tp.placement, self.layout.tp.full_shape)
        self.unsharded = nn.Parameter(full, requires_grad=requires_grad)
        self.free_unsharded()

    def rebase(self, module_prefix: dict[int, str]) -> None:
        """Recompute names relative to a new root (a nested ShardedModel absorbed by its parent)."""
        self.slots = [ParamSlot(s.module, s.name, module_prefix[id(s.module)] + s.name) for s in self.slots]
        self.fqn = self.slots[0].fqn

    def bind_sharded(self, flat_view: torch.Tensor, device_mesh: DeviceMesh) -> None:
        """Make the sharded parameter a DTensor over a view of the unit's flat buffer slot."""
        self.device_mesh = device_mesh
        self.sharded_local = flat_view[: self.layout.local_numel].view(self.layout.local_shape)
        self.sharded = sharded_parameter(self.sharded_local, device_mesh, self.layout.dtensor_shape,
                                         self.requires_grad, self.layout.placements)

    def rebind(self, flat_view: torch.Tensor, device_mesh: DeviceMesh, compute_dtype: torch.dtype,
               grad_local: torch.Tensor | None = None) -> None:
        """Move to a new slot ``flat_view`` of the unit's flat buffer after a dtype or device conversion
        (``ShardUnit.adopt_flat``): the sharded parameter's local tensor becomes a view into it, its gradient
        becomes ``grad_local`` (already converted), and the unsharded face is re-created in
        ``compute_dtype`` on the new device.

        The sharded ``nn.Parameter`` keeps its identity where torch allows it (``torch.utils.swap_tensors``,
        what ``nn.Module._apply`` does for DTensor parameters), so an optimizer or a dict holding it sees the
        converted tensor; otherwise (the old one is referenced from C++, e.g. by a live autograd graph) it
        is a new object and the module's slots are re-pointed by :meth:`to_sharded`.
        """
        old = getattr(self, "sharded", None)
        requires_grad = self.requires_grad
        if old is not None:
            old.grad = None  # a gradient holds a reference that would block the swap
        self.dtype, self.device = flat_view.dtype, flat_view.device
        self.bind_sharded(flat_view, device_mesh)
        if old is not None:
            try:
                torch.utils.swap_tensors(old, self.sharded)
                self.sharded = old
            except RuntimeError:
                pass  # keep the new object
        if grad_local is not None:
            self.sharded.grad = self.to_opt_dtensor(grad_local)
        self._make_unsharded(compute_dtype, requires_grad)

    @property
    def requires_grad(self) -> bool:
        """The sharded parameter's flag: freezing or unfreezing it after wrapping (``requires_grad_``
        between steps, the same on every rank, as with DDP) takes effect at the next forward."""
        sharded = getattr(self, "sharded", None)
        return self._initial_requires_grad if sharded is None else sharded.requires_grad

    def to_dtensor(self, local: torch.Tensor) -> torch.Tensor:
        """A tensor shaped like this rank's chunk, as a DTensor of the parameter's global shape."""
        return to_sharded_dtensor(local, self.device_mesh, self.layout.dtensor_shape, self.layout.placements)

    # -- what the optimizer steps: the chunk, or this replica's slice of it ------------------------------
    @property
    def opt_local(self) -> torch.Tensor:
        """The part of the parameter this rank's optimizer updates: a view into the flat shard buffer, or for a
        slice of pieces (not one run of the chunk's rows) a buffer of its own, filled by :meth:`refresh_slice`
        and written back by the all-gather after the step."""
        if self.slice is None:
            return self.sharded_local
        if isinstance(self.slice, PieceSliceLayout) and not self.slice.replicated:
            if self.slice_values is None:
                self.refresh_slice()
            assert self.slice_values is not None
            return self.slice_values
        return self.slice.of_chunk(self.sharded_local)

    def refresh_slice(self) -> None:
        """Copy a piece slice's rows out of the chunk into its buffer (before a step: the chunk may have been
        loaded or changed since); nothing to do for a view."""
        if not isinstance(self.slice, PieceSliceLayout) or self.slice.replicated:
            return
        values = self.slice_values
        chunk = self.sharded_local.detach()
        if values is None or values.dtype != chunk.dtype or values.device != chunk.device:
            self.slice_values = self.slice.of_chunk(chunk).clone()
        else:
            with torch.no_grad():
                values.copy_(self.slice.of_chunk(chunk))

    @property
    def opt_shape(self) -> tuple[int, ...]:
        return self.layout.local_shape if self.slice is None else self.slice.local_shape

    def to_opt_dtensor(self, local: torch.Tensor) -> torch.Tensor:
        """A tensor shaped like :attr:`opt_local` (a gradient, a moment) as a DTensor of the global shape."""
        if self.slice is None:
            return self.to_dtensor(local)
        if isinstance(self.slice, PieceSliceLayout):
            # No placement describes a rank's parts of several pieces: the DTensor carries the global shape for
            # the parameter's ``.grad`` and state; its local tensor is the slice (what hsdp reads, and what the
            # optimizer state dict turns into a ShardedTensor of every rank's runs).
            return self.to_dtensor(local)
        assert self.slice_mesh is not None
        return to_sharded_dtensor(local, self.slice_mesh, self.layout.dtensor_shape, self.slice.placements)

    # -- the sharded gradient ----------------------------------------------------------------------------
    @property
    def grad_local(self) -> torch.Tensor | None:
        """This rank's part of the reduced gradient, shaped like :attr:`opt_local` (``None`` when there is
        none)."""
        grad = self.sharded.grad  # lands late gradients first (late_grads.py)
        return None if grad is None else local_of(grad)

    def accumulate_grad(self, local: torch.Tensor) -> None:
        """Add a reduced gradient part (shaped like :attr:`opt_local`) to ``sharded.grad``; the first one becomes
        the gradient without a copy (a view into the reduction output) when dtypes agree."""
        if local.dtype != self.dtype:
            local = local.to(self.dtype)
        current = raw_grad(self.sharded)  # not grad_local: this may be a late gradient landing (late_grads.py)
        current = None if current is None else local_of(current)
        if current is None:
            set_raw_grad(self.sharded, self.to_opt_dtensor(local))
        else:
            current += local

    # -- storage -------------------------------------------------------------------------------------------
    def alloc_unsharded(self) -> None:
        storage = self.unsharded_padded.untyped_storage()
        nbytes = self.unsharded_padded.numel() * self.unsharded_padded.element_size()
        if storage.size() != nbytes:
            storage.resize_(nbytes)

    def take_unsharded_grad(self, weight: float | torch.Tensor | None = None) -> torch.Tensor | None:
        """Detach the unsharded gradient, times the batch ``weight`` if any (plus any fp32 sum from unsynced
        micro-batches, weighted already)."""
        grad, self.unsharded.grad = self._weighted_local_grad(weight), None
        if self.grad_acc is not None:
            acc, self.grad_acc = self.grad_acc, None
            grad = acc if grad is None else acc.add_(grad)
        return grad

    def accumulate_unsharded_grad(self, weight: float | torch.Tensor | None = None) -> None:
        """Move the unsharded gradient, times the batch ``weight`` if any, into the fp32 sum (no communication
        this micro-batch)."""
        grad, self.unsharded.grad = self._weighted_local_grad(weight), None
        if grad is None:
            return
        if self.grad_acc is None:
            self.grad_acc = grad.to(torch.promote_types(grad.dtype, torch.float32), copy=True)
        else:
            self.grad_acc.add_(grad)

    def _weighted_local_grad(self, weight: float | torch.Tensor | None) -> torch.Tensor | None:
        # Scaled after _local_grad, which may redistribute (a new tensor): scaling before would be lost.
        grad = self._local_grad()
        return grad if grad is None or weight is None else grad.mul_(weight)

    def _local_grad(self) -> torch.Tensor | None:
        """The unsharded gradient as the tensor hsdp reduces: itself, or under tensor parallelism the
        TP-local part of the parameter's own tp placement."""
        grad = self.unsharded.grad
        if grad is None or self.tp_mesh is None:
            return grad
        assert self.layout.tp is not None
        return tp_local(grad, self.layout.tp.placement)

    def full_tensor(self, gathered: torch.Tensor) -> torch.Tensor:
        """The full parameter from its all-gathered (TP-local) value: under tensor parallelism an all-gather in
        the tp group (DTensor's), else ``gathered`` itself."""
        if self.tp_mesh is None:
            return gathered
        assert self.layout.tp is not None
        return tp_dtensor(gathered, self.tp_mesh, self.layout.tp.placement, self.layout.tp.full_shape).full_tensor()

    def free_unsharded(self) -> None:
        self.unsharded_padded.untyped_storage().resize_(0)

    @property
    def all_gather_output(self) -> torch.Tensor:
        """The (S, padded_numel) destination of the copy-out from the unit's all-gather buffer."""
        return self.unsharded_padded.view(self.layout.sharding_degree, self.layout.padded_numel)

    # -- which face the module sees ---------------------------------------------------------------------
    def to_sharded(self) -> None:
        for slot in self.slots:
            slot.set(self.sharded)

    def to_unsharded(self) -> None:
        if self.unsharded.requires_grad != self.requires_grad:
            self.unsharded.requires_grad_(self.requires_grad)  # frozen or unfrozen since the last step
        for slot in self.slots:
            slot.set(self.unsharded)
