"""The two-hop gradient reduction of one unit: reduce-scatter in the shard group, all-reduce across replicas.

Stages: ``start`` issues the reduce-scatter (async) -> ``start_all_reduce`` waits for it and issues the
replica all-reduce (async) -> ``finish`` waits and hands each sharded parameter its gradient. The root
drives the stages so that one unit's all-reduce overlaps the next unit's reduce-scatter and backward.

Each rank appends one "has gradient" flag per parameter to every chunk of its reduce-scatter input. After
both averaging hops the flag is positive iff some rank produced a gradient, which gives exactly DDP's
semantics for unused parameters (gradient ``None`` only when unused everywhere) without an extra collective.
"""

from __future__ import annotations

import enum

import torch
import torch.distributed as dist

from hsdp.collectives import Comm, Handle
from hsdp.runtime.sharded_param import ShardedParam


class Stage(enum.Enum):
    REDUCE_SCATTER = "reduce_scatter"
    ALL_REDUCE = "all_reduce"
    DONE = "done"


class Reduction:
    """An in-flight gradient reduction for the trainable parameters of one unit."""

    def __init__(self, params: list[ShardedParam], output: torch.Tensor, handle: Handle, comm: Comm) -> None:
        self.params = params
        self.output = output  # 1D: this rank's reduced slot, then one flag per parameter
        self.comm = comm
        self._handle = handle
        self.stage = Stage.REDUCE_SCATTER

    @classmethod
    def start(cls, params: list[ShardedParam], grads: list[torch.Tensor | None], comm: Comm) -> Reduction:
        s = comm.size("shard")
        dtype, device = params[0].dtype, params[0].device
        flags = torch.tensor([0.0 if g is None else 1.0 for g in grads], dtype=dtype, device=device)
        inputs = [torch.zeros(p.layout.global_shape, dtype=dtype, device=device) if g is None else g
                  for p, g in zip(params, grads, strict=True)]
        inputs.append(flags.expand(s, -1))  # one copy of the flags in every rank's chunk
        # ND: (S, slot + n_flags); row r is what rank r receives, padded chunk by chunk.
        rs_input = torch._chunk_cat(inputs, dim=0, num_chunks=s)
        output = torch.empty(rs_input.shape[1], dtype=dtype, device=device)
        handle = comm.reduce_scatter(output, rs_input.view(-1), "shard", op=dist.ReduceOp.AVG, async_op=True)
        return cls(params, output, handle, comm)

    def start_all_reduce(self) -> None:
        if self.stage is not Stage.REDUCE_SCATTER:
            return
        self._handle.wait()
        self._handle = self.comm.all_reduce(self.output, "replicate", op=dist.ReduceOp.AVG, async_op=True)
        self.stage = Stage.ALL_REDUCE

    def finish(self) -> None:
        """Wait for both hops and accumulate the reduced shards into ``param.grad`` of the sharded params."""
        if self.stage is Stage.DONE:
            return
        self.start_all_reduce()
        self._handle.wait()
        n = len(self.params)
        has_grad = (self.output[-n:] > 0).tolist()
        offset = 0
        for p, flag in zip(self.params, has_grad, strict=True):
            if flag:
                self._accumulate(p, self.output[offset: offset + p.layout.local_numel])
            offset += p.layout.padded_numel
        self.stage = Stage.DONE

    @staticmethod
    def _accumulate(p: ShardedParam, flat_grad: torch.Tensor) -> None:
        grad = flat_grad.view(p.layout.local_shape)
        if p.sharded.grad is None:
            p.sharded.grad = grad  # a view into the reduction output: no copy
        else:
            p.sharded.grad += grad
