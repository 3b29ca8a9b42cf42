"""Optimizer state of a slice of pieces (``runtime/piece_slice.py``) in and out of state dicts.

On replicas of different shard degrees a rank's slice of a parameter is its part of each piece it holds: several
runs of rows, which no DTensor placement describes. The live state keeps the slice as the local tensor of a
DTensor of the parameter's shape (``ShardedParam.to_opt_dtensor``); a state dict gives it out as a
``ShardedTensor`` of the parameter's global shape with one shard per run, its metadata listing every rank's runs
(arithmetic, no collective), so that the ranks' runs tile the tensor exactly once and DCP writes each row once
(``ReplicaSavePlanner`` keeps every rank's items: no replica's runs tile a tensor alone). Loading takes any form:
a ``ShardedTensor`` of these runs, hsdp's chunk DTensor (what ``hsdp.load_checkpoint`` reads, from a checkpoint of
any layout), or a full tensor; the slice is cut from it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard as TensorShard
from torch.distributed._shard.sharded_tensor import ShardedTensor, ShardedTensorMetadata, TensorProperties
from torch.distributed.tensor import DTensor

from hsdp.engine.replicate.degrees import replica_starts
from hsdp.engine.replicate.pieces import chunk_rows
from hsdp.engine.runtime.dtensor import local_chunk
from hsdp.engine.runtime.layout import ShardLayout
from hsdp.engine.runtime.piece_slice import PieceSliceLayout, piece_slice
from hsdp.engine.runtime.sharded_param import ShardedParam


def is_piece_sliced(sp: ShardedParam) -> bool:
    return isinstance(sp.slice, PieceSliceLayout) and not sp.slice.replicated


def piece_sliced_tensor(local: torch.Tensor, sp: ShardedParam, degrees: tuple[int, ...], rank: int) -> ShardedTensor:
    """``local`` (this rank's slice, shaped like ``sp.slice.local_shape``) as its shards of a ``ShardedTensor`` of
    the parameter's shape whose metadata lists every rank's runs."""
    mine = sp.slice
    assert isinstance(mine, PieceSliceLayout)
    shape = sp.layout.global_shape
    device = local.device
    metas, shards = [], []
    for q, (start, d) in enumerate(zip(replica_starts(degrees), degrees, strict=True)):
        for s in range(d):
            layout = piece_slice(ShardLayout(shape, d, s), degrees, q)
            first = s * chunk_rows(shape[0], d)
            for (row, n), at in zip(layout.runs, layout.run_offsets(), strict=True):
                if n == 0:
                    continue
                meta = ShardMetadata([first + row] + [0] * (len(shape) - 1), [n, *shape[1:]],
                                     f"rank:{start + s}/{device}")
                metas.append(meta)
                if start + s == rank:
                    shards.append(TensorShard(local.narrow(0, at, n), meta))
    props = TensorProperties(dtype=local.dtype, layout=local.layout, requires_grad=False,
                             memory_format=torch.contiguous_format, pin_memory=False)
    metadata = ShardedTensorMetadata(metas, torch.Size(shape), props)
    return ShardedTensor._init_from_local_shards_and_global_metadata(shards, metadata)


def piece_slice_state(value: Any, sp: ShardedParam) -> Any:
    """One loaded state entry as a slice of pieces keeps it (a DTensor over this rank's slice, owning its memory);
    scalars and other shapes unchanged."""
    if not is_piece_sliced(sp):
        return value
    piece = sp.slice
    assert isinstance(piece, PieceSliceLayout)
    shape = sp.layout.global_shape
    if isinstance(value, ShardedTensor):
        if tuple(value.metadata().size) != shape:
            return value
        parts = [s.tensor for s in sorted(value.local_shards(), key=lambda s: s.metadata.shard_offsets[0])]
        local = torch.cat(parts) if parts else torch.empty((0, *shape[1:]), dtype=value.dtype)
        if tuple(local.shape) != piece.local_shape:
            raise ValueError(f"optimizer state of {sp.fqn!r}: a ShardedTensor of other runs than this rank's slice "
                             f"({tuple(local.shape)} against {piece.local_shape}): load it with "
                             f"hsdp.load_checkpoint, which reshards")
        return sp.to_opt_dtensor(local.to(sp.sharded_local.device).clone())
    if not isinstance(value, torch.Tensor) or value.dim() == 0 or tuple(value.shape) != shape:
        return value
    if isinstance(value, DTensor) and tuple(value.to_local().shape) == piece.local_shape \
            and value.to_local().shape != sp.layout.local_shape:
        return value  # already this rank's slice (a live state handed back)
    chunk = local_chunk(value, sp.layout)
    return sp.to_opt_dtensor(piece.of_chunk(chunk).clone())
