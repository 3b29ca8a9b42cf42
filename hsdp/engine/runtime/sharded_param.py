"""One parameter split into dim-0 chunks across the shard group (the layout FSDP2 and DTensor use).

Rank ``i`` of ``S`` holds rows ``[i*c, min((i+1)*c, rows))`` with ``c = ceil(rows / S)``: the chunks of
``torch.chunk`` and of ``DTensor`` ``Shard(0)``. Trailing ranks may hold fewer rows, or none. Each rank
reserves ``c`` rows in the unit's flat buffers (zero padding), so every rank contributes the same number
of elements to a collective.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from hsdp.engine.runtime.dtensor import sharded_parameter, to_sharded_dtensor


@dataclass(frozen=True)
class ShardLayout:
    """Pure arithmetic of the dim-0 chunking of one tensor shape over ``sharding_degree`` ranks.

    A 0-d tensor (CLIP's ``logit_scale``) has no dim 0 to split: it is *replicated* in the shard group,
    every rank holding the whole value in a one-element slot (its DTensor placements are
    ``(Replicate(), Replicate())``); the all-gather then returns S equal copies and the reduce-scatter
    gives every rank the averaged gradient. It costs one element per rank.
    """

    global_shape: tuple[int, ...]
    sharding_degree: int
    shard_rank: int

    @property
    def replicated(self) -> bool:
        return not self.global_shape

    @property
    def placements(self) -> tuple[Placement, Placement]:
        """The DTensor placements on the ``("replicate", "shard")`` mesh."""
        return (Replicate(), Replicate()) if self.replicated else (Replicate(), Shard(0))

    @property
    def rows(self) -> int:
        return 1 if self.replicated else self.global_shape[0]

    @property
    def row_numel(self) -> int:
        return math.prod(self.global_shape[1:])

    @property
    def chunk_rows(self) -> int:
        return 1 if self.replicated else -(-self.rows // self.sharding_degree)

    @property
    def padded_numel(self) -> int:
        """Elements each rank reserves in a flat buffer (its slot, padding included)."""
        return self.chunk_rows * self.row_numel

    def row_offset(self, shard_rank: int | None = None) -> int:
        r = self.shard_rank if shard_rank is None else shard_rank
        return 0 if self.replicated else min(r * self.chunk_rows, self.rows)

    def local_rows(self, shard_rank: int | None = None) -> int:
        r = self.shard_rank if shard_rank is None else shard_rank
        return 1 if self.replicated else max(0, min(self.chunk_rows, self.rows - r * self.chunk_rows))

    @property
    def local_shape(self) -> tuple[int, ...]:
        return self.global_shape if self.replicated else (self.local_rows(), *self.global_shape[1:])

    @property
    def local_numel(self) -> int:
        return self.local_rows() * self.row_numel

    def chunk(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's piece of a full tensor of ``global_shape`` (a view)."""
        return full if self.replicated else full.narrow(0, self.row_offset(), self.local_rows())


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
    ``nn.Parameter`` holding a ``DTensor`` ``(Replicate(), Shard(0))`` of the original (global) shape,
    whose local tensor (``sharded_local``) is a view into the unit's flat sharded buffer, so an in-place
    optimizer update is an update of the all-gather's input with no copy. Its gradient is a DTensor of the
    same layout over a view of the reduction output.
    ``unsharded`` has the original shape and takes part in autograd during forward and backward; its
    storage is a view into a padded buffer of ``S * padded_numel`` elements that is freed between uses.
    It is a plain tensor: the module's own forward code never sees a DTensor.
    """

    def __init__(self, slots: list[ParamSlot], original: nn.Parameter, layout: ShardLayout,
                 compute_dtype: torch.dtype | None = None) -> None:
        self.slots = slots
        self.fqn = slots[0].fqn
        self.layout = layout
        # Lets an optimizer built before wrapping be re-pointed at the shard, without keeping it alive.
        self.original_ref = weakref.ref(original)
        self._initial_requires_grad = original.requires_grad  # until the sharded parameter exists
        self.dtype = original.dtype
        self.device = original.device
        self.compute_dtype = compute_dtype or original.dtype
        self.sharded: nn.Parameter  # DTensor; set by bind_sharded
        self.sharded_local: torch.Tensor  # 1D slot view shaped like this rank's chunk; set by bind_sharded
        self.device_mesh: DeviceMesh  # set by bind_sharded
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
        self.sharded = sharded_parameter(self.sharded_local, device_mesh, self.layout.global_shape,
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
            self.sharded.grad = self.to_dtensor(grad_local)
        self._make_unsharded(compute_dtype, requires_grad)

    @property
    def requires_grad(self) -> bool:
        """The sharded parameter's flag: freezing or unfreezing it after wrapping (``requires_grad_``
        between steps, the same on every rank, as with DDP) takes effect at the next forward."""
        sharded = getattr(self, "sharded", None)
        return self._initial_requires_grad if sharded is None else sharded.requires_grad

    def to_dtensor(self, local: torch.Tensor) -> torch.Tensor:
        """A tensor shaped like this rank's chunk, as a DTensor of the parameter's global shape."""
        return to_sharded_dtensor(local, self.device_mesh, self.layout.global_shape, self.layout.placements)

    # -- the sharded gradient ----------------------------------------------------------------------------
    @property
    def grad_local(self) -> torch.Tensor | None:
        """This rank's chunk of the sharded gradient (``None`` when there is none)."""
        grad = self.sharded.grad
        if grad is None:
            return None
        return grad.to_local() if isinstance(grad, DTensor) else grad

    def accumulate_grad(self, local: torch.Tensor) -> None:
        """Add a reduced gradient chunk to ``sharded.grad``; the first one becomes the gradient without a copy
        (a view into the reduction output) when dtypes agree."""
        if local.dtype != self.dtype:
            local = local.to(self.dtype)
        current = self.grad_local
        if current is None:
            self.sharded.grad = self.to_dtensor(local)
        else:
            current += local

    # -- storage -------------------------------------------------------------------------------------------
    def alloc_unsharded(self) -> None:
        storage = self.unsharded_padded.untyped_storage()
        nbytes = self.unsharded_padded.numel() * self.unsharded_padded.element_size()
        if storage.size() != nbytes:
            storage.resize_(nbytes)

    def take_unsharded_grad(self) -> torch.Tensor | None:
        """Detach the unsharded gradient (plus any fp32 sum from unsynced micro-batches)."""
        grad, self.unsharded.grad = self.unsharded.grad, None
        if self.grad_acc is not None:
            acc, self.grad_acc = self.grad_acc, None
            grad = acc if grad is None else acc.add_(grad)
        return grad

    def accumulate_unsharded_grad(self) -> None:
        """Move the unsharded gradient into the fp32 sum (no communication this micro-batch)."""
        grad, self.unsharded.grad = self.unsharded.grad, None
        if grad is None:
            return
        if self.grad_acc is None:
            self.grad_acc = grad.to(torch.promote_types(grad.dtype, torch.float32), copy=True)
        else:
            self.grad_acc.add_(grad)

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
