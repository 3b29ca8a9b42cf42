"""``torch.optim.Muon`` on a ShardedModel: every update matrix is orthogonalised whole, on one rank.

[Note: Muon on dim-0 shards]
Muon's Newton-Schulz iteration multiplies the whole update matrix by its transpose, so it cannot run on a
rank's rows alone: on plain chunks it is simply wrong, and through DTensor dispatch each matmul becomes a
partial sum reduced in bf16 (off by ~1e-3 after a few steps, several times slower, and with collectives that
hsdp does not see, some over the replicate mesh dim). Instead, per parameter group and step:

1. momentum and Nesterov blend on the local chunks (element-wise, exactly torch's ops);
2. each matrix gets an owner rank in the shard group (largest first, to the least loaded rank), and one
   all-to-all brings every chunk of a matrix to its owner;
3. the owner runs torch's own ``_zeropower_via_newtonschulz`` on the whole matrix;
4. a second all-to-all returns each rank its rows of the result, applied with Muon's weight decay and
   shape-adjusted learning rate.

Torch's iteration first casts its input to bf16 and returns bf16, so both all-to-alls carry bf16: half the
bytes of fp32 and the same bits as one process. Per rank and step that is about 2 x (S-1)/S x P_muon x 2
bytes inside the shard group, and nothing across replicas: they hold identical gradient shards after the
backward, so each replica's shard group computes the same result. Newton-Schulz compute is split about
evenly over the S ranks instead of being repeated on each.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

from hsdp.engine.collectives import Comm
from hsdp.engine.runtime.dtensor import local_of
from hsdp.engine.runtime.layout import ShardLayout
from hsdp.engine.runtime.sharded_param import ShardedParam

if TYPE_CHECKING:
    from hsdp.engine.model import ShardedModel

# The dtype torch's Newton-Schulz casts its input to first (and returns): what crosses the wire.
NS_DTYPE = torch.bfloat16


def muon_step(optimizer: torch.optim.Muon, model: ShardedModel) -> None:
    """One ``torch.optim.Muon`` step over ``model``'s shards, equal to Muon on the unsharded model.

    A collective in the shard group (two all-to-alls per parameter group): every rank must call it.
    State (``momentum_buffer``) stays a DTensor chunk like the parameter, as torch's Muon would keep it.
    """
    comm = model.comm
    by_param = {id(sp.sharded): sp for sp in model.sharded_params()}
    with torch.no_grad():
        for group in optimizer.param_groups:
            params, updates = _momentum_updates(optimizer, group, by_param)
            ortho = orthogonalize(comm, [sp.layout for sp in params], updates, group["ns_coefficients"],
                                  group["ns_steps"], group["eps"])
            lr = float(group["lr"])
            for sp, o in zip(params, ortho, strict=True):
                local = sp.sharded_local
                local.mul_(1 - lr * group["weight_decay"])
                local.add_(o, alpha=-_adjust_lr(lr, group["adjust_lr_fn"], torch.Size(sp.layout.global_shape)))


def _momentum_updates(optimizer: torch.optim.Optimizer, group: dict, by_param: dict[int, ShardedParam],
                      ) -> tuple[list[ShardedParam], list[torch.Tensor]]:
    """Torch Muon's momentum (and Nesterov) step on each local chunk; the chunks to orthogonalise."""
    params, updates = [], []
    momentum = group["momentum"]
    for p in group["params"]:
        if p.grad is None:
            continue
        if torch.is_complex(p):
            raise RuntimeError("Muon does not support complex parameters")
        state = optimizer.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
        sp = by_param[id(p)]
        grad, buf = sp.grad_local, local_of(state["momentum_buffer"])
        buf.lerp_(grad, 1 - momentum)
        params.append(sp)
        updates.append(grad.lerp(buf, momentum) if group["nesterov"] else buf)
    return params, updates


def owners(numels: list[int], ranks: int) -> list[int]:
    """Shard rank that orthogonalises each matrix: largest first, to the least loaded rank (ties: lowest
    rank). A pure function of the global shapes, so every rank computes the same assignment."""
    load = [0] * ranks
    out = [0] * len(numels)
    for i in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
        out[i] = min(range(ranks), key=lambda r: (load[r], r))
        load[out[i]] += numels[i]
    return out


def orthogonalize(comm: Comm, layouts: list[ShardLayout], chunks: list[torch.Tensor],
                  ns_coefficients: tuple[float, float, float], ns_steps: int, eps: float) -> list[torch.Tensor]:
    """This rank's rows of Newton-Schulz of each whole matrix whose rank-local rows are ``chunks``.

    Each matrix is gathered on its owner (one all-to-all), orthogonalised there, and its rows sent back
    (a second all-to-all). Returns bf16 chunks shaped like ``chunks``.
    """
    if not chunks:
        return []
    ranks = comm.size("shard")
    me = layouts[0].shard_rank
    owner = owners([math.prod(lay.global_shape) for lay in layouts], ranks)
    mine = [i for i in range(len(layouts)) if owner[i] == me]
    # Send: to each rank r, my rows of every matrix r owns (in matrix order).
    order = sorted(range(len(layouts)), key=lambda i: (owner[i], i))
    send = torch.cat([chunks[i].reshape(-1).to(NS_DTYPE) for i in order])
    send_sizes = [sum(layouts[i].local_numel for i in order if owner[i] == r) for r in range(ranks)]
    # Receive: from each rank r, its rows of every matrix I own.
    pieces = [[layouts[i].local_rows(r) * layouts[i].row_numel for i in mine] for r in range(ranks)]
    recv_sizes = [sum(row) for row in pieces]
    gathered = send.new_empty(sum(recv_sizes))
    comm.all_to_all(gathered, send, recv_sizes, send_sizes, label="muon gather")
    by_rank = [part.split(pieces[r]) for r, part in enumerate(gathered.split(recv_sizes))]
    results = []
    for j, i in enumerate(mine):
        full = torch.cat([by_rank[r][j] for r in range(ranks)]).view(layouts[i].global_shape)
        results.append(_zeropower_via_newtonschulz(full, ns_coefficients, ns_steps, eps).to(NS_DTYPE))
    # Return trip: the mirror image; rank r gets rows of each of my matrices, in the same order.
    rows = [res.narrow(0, layouts[i].row_offset(r), layouts[i].local_rows(r)).reshape(-1)
            for r in range(ranks) for i, res in zip(mine, results, strict=True)]
    back = torch.cat(rows) if rows else send.new_empty(0)
    received = send.new_empty(sum(send_sizes))
    comm.all_to_all(received, back, send_sizes, recv_sizes, label="muon scatter")
    out: list[torch.Tensor] = [chunks[0]] * len(chunks)
    for i, part in zip(order, received.split([layouts[i].local_numel for i in order]), strict=True):
        out[i] = part.view(layouts[i].local_shape)
    return out

