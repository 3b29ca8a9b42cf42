"""The one place hsdp converts between this rank's dim-0 chunk and the global ``DTensor`` view of it.

Every sharded parameter, gradient and per-parameter optimizer state is a ``DTensor`` with placement
``Shard(0)`` on the mesh of its replica (``HSDPMesh.param_mesh``): split in ``torch.chunk`` dim-0 chunks
inside a node; the replicas across nodes are hsdp's business, not a DTensor dim (see
``docs/design/replicate_layer.md``). Code that reads shapes, norms or
counts (``numel()``, ``clip_grad_norm_``, DCP) then sees the global tensor, while element-wise work runs on
the local chunk through DTensor dispatch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from hsdp.engine.runtime.layout import ShardLayout
from hsdp.engine.runtime.origin import stamp
from hsdp.engine.runtime.replica_slice import SliceLayout

PLACEMENTS = (Shard(0),)


def contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(stride))


def to_sharded_dtensor(local: torch.Tensor, device_mesh: DeviceMesh, global_shape: tuple[int, ...],
                       placements: Sequence[Placement] = PLACEMENTS) -> DTensor:
    """``local`` as this rank's chunk of a ``Shard(0)`` DTensor of ``global_shape`` (or of
    other ``placements``); no copy, no collective (the caller vouches for the layout). See
    [Note: DTensor over a slice of a flat buffer]."""
    return _with_local(DTensor.from_local(_at_offset_zero(local), device_mesh, placements, run_check=False,
                                          shape=torch.Size(global_shape),
                                          stride=contiguous_stride(tuple(global_shape))), local)


def sharded_parameter(local: torch.Tensor, device_mesh: DeviceMesh, global_shape: tuple[int, ...],
                      requires_grad: bool, placements: Sequence[Placement] = PLACEMENTS) -> nn.Parameter:
    """An ``nn.Parameter`` holding :func:`to_sharded_dtensor` of ``local`` (the optimizer updates ``local``)."""
    dtensor = DTensor.from_local(_at_offset_zero(local), device_mesh, placements, run_check=False,
                                 shape=torch.Size(global_shape), stride=contiguous_stride(tuple(global_shape)))
    # nn.Parameter(subclass) detaches (a new wrapper): swap the local tensor in after, not before.
    param = _with_local(nn.Parameter(dtensor, requires_grad=requires_grad), local)
    param._hsdp_sharded = True  # lets a plain optimizer that would mis-step it be refused (optim/sharded_optimizer.py)
    return stamp(param)  # a pickled parameter names its rank's chunk (see origin.py)


# [Note: DTensor over a slice of a flat buffer]
# A unit's shards live in one flat buffer and every sharded parameter's local tensor is a view into it, so
# the all-gather reads the buffer with no copy-in. A DTensor wrapper copies its local tensor's storage
# offset, and torch's pickling (torch.save, copy.deepcopy) treats a wrapper subclass with a nonzero data
# pointer as a plain tensor and fails ("invalid python storage"). So the wrapper is built over the same
# memory at offset 0 (same shape and strides, inside the buffer) and the real view is swapped in as its
# local tensor: every DTensor op reads ``_local_tensor``; only the wrapper's own (unused) metadata differs.
# Results of ops on these DTensors (``detach()`` included) are new wrappers of offset views again: the
# state dict therefore builds fresh wrappers instead of detaching.
def _at_offset_zero(local: torch.Tensor) -> torch.Tensor:
    if local.storage_offset() == 0:
        return local
    return local.as_strided(local.shape, local.stride(), 0)


def _with_local(outer: DTensor, local: torch.Tensor) -> DTensor:
    if outer._local_tensor is not local and local.storage_offset() != 0:
        outer._local_tensor = local
    return outer


def tp_dtensor(local: torch.Tensor, tp_mesh: DeviceMesh, placement: Placement,
               full_shape: tuple[int, ...]) -> DTensor:
    """``local`` (a TP-local tensor) as the DTensor tensor parallelism computes with; no copy, no collective."""
    return DTensor.from_local(local, tp_mesh, (placement,), run_check=False, shape=torch.Size(full_shape),
                              stride=contiguous_stride(tuple(full_shape)))


def tp_local(grad: torch.Tensor, placement: Placement) -> torch.Tensor:
    """A tensor-parallel parameter's gradient as its TP-local tensor in the parameter's own ``placement``.

    A replicated parameter used on sequence-sharded activations (sequence parallel norms) gets a ``Partial``
    gradient: redistributing it is DTensor's all-reduce in the tp group, the one collective hsdp lets torch
    issue (TP's own communication, inside the node)."""
    if not isinstance(grad, DTensor):
        return grad
    if tuple(grad.placements) != (placement,):
        grad = grad.redistribute(placements=(placement,))
    local = grad.to_local()
    wait = getattr(local, "wait", None)  # an AsyncCollectiveTensor from the redistribute
    return wait() if callable(wait) else local


def local_of(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds: a DTensor's local chunk, a plain tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def replicated_dtensor(local: torch.Tensor, device_mesh: DeviceMesh) -> DTensor:
    """``local`` as a DTensor whole on every rank (``Replicate()`` on every mesh dim); no copy."""
    return DTensor.from_local(local, device_mesh, (Replicate(),) * device_mesh.ndim, run_check=False)


def is_hsdp_layout(value: DTensor, layout: ShardLayout) -> bool:
    """Whether ``value`` is already sharded the way ``layout`` says (its local tensor can be used as is)."""
    return (tuple(value.placements) == layout.placements and tuple(value.shape) == layout.dtensor_shape
            and tuple(value.to_local().shape) == layout.local_shape)


def local_chunk(value: Any, layout: ShardLayout) -> Any:
    """This rank's chunk of a full tensor or of a DTensor in any layout (a foreign layout costs a
    ``full_tensor()``, a collective). Values of another shape are returned unchanged, for the caller's
    own shape check to report."""
    if isinstance(value, DTensor):
        if is_hsdp_layout(value, layout):
            return value.to_local()
        value = value.full_tensor()
    if isinstance(value, torch.Tensor) and tuple(value.shape) == layout.dtensor_shape:
        return layout.chunk_of_full(value)
    return value


def as_sharded(value: Any, layout: ShardLayout, device_mesh: DeviceMesh) -> Any:
    """A full tensor or a DTensor of any layout, re-expressed in hsdp's layout; other values unchanged."""
    if isinstance(value, DTensor) and is_hsdp_layout(value, layout):
        return value
    local = local_chunk(value, layout)
    if local is value or not isinstance(local, torch.Tensor):
        return value
    return to_sharded_dtensor(local, device_mesh, layout.dtensor_shape, layout.placements)


def as_sharded_state(value: Any, layout: ShardLayout, device_mesh: DeviceMesh, replicated: bool = False) -> Any:
    """Per-parameter optimizer state (of the parameter with ``layout``) as hsdp keeps it, owning its memory (a view
    would keep a whole loaded tensor alive): a DTensor ``Shard(0)`` chunk of the state's own
    global shape when that shape has the parameter's rank and rows (moments, Adafactor's row factors), a fully
    replicated DTensor when ``replicated`` (Adafactor's column factor of a matrix); scalars and other shapes
    unchanged."""
    if isinstance(value, DTensor):
        # A replicated entry may have been loaded as a chunked DTensor when its shape equals the parameter's
        # (a one-row matrix's col_var): ``replicated`` decides, not the shape.
        if not replicated and (is_hsdp_layout(value, layout) or _chunked_as_hsdp(value, layout, device_mesh)):
            return value
        # A replicated value (any mesh) is its own full tensor: no collective.
        value = value.to_local() if all(p == Replicate() for p in value.placements) else value.full_tensor()
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return value
    shape = tuple(value.shape)
    if replicated:
        return replicated_dtensor(value.clone(), device_mesh)
    if layout.tp is not None:  # tensor parallelism: only states of the parameter's own shape are sharded
        if shape != layout.dtensor_shape:
            return value
        return to_sharded_dtensor(layout.chunk_of_full(value).clone(), device_mesh, shape, layout.placements)
    if len(shape) != len(layout.global_shape) or shape[0] != layout.rows:
        return value
    own = ShardLayout(shape, layout.sharding_degree, layout.shard_rank)
    return to_sharded_dtensor(own.chunk(value).clone(), device_mesh, shape)


def as_slice_state(value: Any, layout: ShardLayout, piece: SliceLayout, device_mesh: DeviceMesh) -> Any:
    """Per-parameter optimizer state as a replica-sharded optimizer keeps it: this replica's slice (see
    ``replica_slice.py``) as a DTensor of the parameter's shape, owning its memory, when the value has the
    parameter's shape (a full tensor, hsdp's chunk DTensor: no collective; another layout: a
    ``full_tensor()``); scalars and other shapes unchanged."""
    if isinstance(value, DTensor) and tuple(value.placements) == piece.placements \
            and tuple(value.to_local().shape) == piece.local_shape and value.device_mesh == device_mesh:
        return value
    if not isinstance(value, torch.Tensor) or value.dim() == 0 or tuple(value.shape) != layout.dtensor_shape:
        return value
    chunk = local_chunk(value, layout)
    return to_sharded_dtensor(piece.of_chunk(chunk).clone(), device_mesh, layout.dtensor_shape, piece.placements)


def _chunked_as_hsdp(value: DTensor, layout: ShardLayout, device_mesh: DeviceMesh) -> bool:
    """Whether a DTensor already is this rank's chunk of its own global shape on ``device_mesh`` (its local
    tensor can be kept as is)."""
    if tuple(value.placements) != PLACEMENTS or value.dim() == 0 or value.device_mesh != device_mesh:
        return False
    own = ShardLayout(tuple(value.shape), layout.sharding_degree, layout.shard_rank)
    return tuple(value.to_local().shape) == own.local_shape
