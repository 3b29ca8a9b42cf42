"""torchft's side of ``diloco_slow_links.py``: one rank of torchft 0.2.0's DiLoCo and Streaming DiLoCo.

The same launch (``hsdp launch --nodes 2 --nproc-per-node 2``: one torchrun world of 4 ranks over 2 emulated
nodes), model, batches (the same ``TokenStream`` position per rank: replica x 2 + shard rank), held-out windows,
inner AdamW, gradient clipping and step count as hsdp's modes. Inside each node the GPT is sharded with FSDP2
(``fully_shard`` on every block, then the root, over the node's 2 ranks); across the nodes
``torchft.local_sgd.DiLoCo`` with a ``torchft.Manager`` per node (``use_async_quorum=False``, as DiLoCo requires;
a ``ProcessGroupGloo`` on the replicate dimension), the outer optimizer ``torch.optim.SGD(lr=outer_lr,
momentum=outer_momentum, nesterov=momentum > 0)`` as hsdp's. Streaming DiLoCo: the same class with F
``model_fragments`` (the units, the root then the blocks, split by hsdp's ``split_fragments``: contiguous runs
of about equal parameter counts), ``fragment_sync_delay=tau``, ``fragment_update_alpha=mix``. Pseudo-gradients
travel in fp32: torchft's quantised all-reduce needs triton (a GPU), so ``--wire`` does not apply.

The lighthouse is in-process on global rank 0 (``torchft.coordination.LighthouseServer``: no node fails in this
benchmark); each node's rank 0 hosts its group's store. Addresses are the nodes' own (see
``elastic_recovery_torchft.py`` for why the host name cannot be used inside network namespaces).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from elastic_recovery_torchft import node_address, node_transport, timeouts

NPROC = 2
MODES = ("torchft-diloco", "torchft-streaming")


def _fragments(model: Any, count: int) -> list[Any]:
    """The model's units in hsdp's order (the root's own parameters, then the blocks) as ``count`` fragment
    modules."""
    from torch import nn

    from hsdp.engine.optim.outer_step import split_fragments

    root = nn.ModuleList([model.tok_emb, model.pos_emb, model.ln_f, model.lm_head])  # the tied matrix once
    units = [root, *model.blocks]
    runs = split_fragments([sum(p.numel() for p in u.parameters()) for u in units], count)
    return [nn.ModuleList([units[i] for i in run]) for run in runs]


def _shared_addresses(host: str, port: int) -> list[tuple[str, int]]:
    import torch.distributed as dist

    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (host, port))
    return everyone


def _manager(replica: int, shard_rank: int, host: str, lighthouse: str) -> Any:
    """Node ``replica``'s Manager, its store hosted by the node's rank 0 (the world's store is shared by both
    nodes, and a Manager writes fixed keys into its group's)."""
    import torch.distributed as dist
    from torchft import Manager, ProcessGroupGloo

    t = timeouts()
    store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False) if shard_rank == 0 else None
    stores = _shared_addresses(host, store.port if store is not None else 0)
    store_host, store_port = stores[replica * NPROC]
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=t["hop_timeout"])), load_state_dict=None, state_dict=None,
        min_replica_size=2, use_async_quorum=False, init_sync=False, replica_id=f"replica_{replica}", rank=shard_rank,
        world_size=NPROC, store_addr=store_host, store_port=store_port, lighthouse_addr=lighthouse, hostname=host,
        timeout=timedelta(seconds=t["hop_timeout"]), quorum_timeout=timedelta(seconds=t["join_timeout"]),
        connect_timeout=timedelta(seconds=t["connect_timeout"]),
        heartbeat_interval=timedelta(seconds=t["heartbeat_interval"]),
        checkpoint_transport=node_transport(host, timedelta(seconds=t["hop_timeout"])))
    manager._bench_store = store  # kept alive with the manager
    return manager


def _count_sent(manager: Any, sent: list[int]) -> None:
    """Add the bytes each ``Manager.allreduce`` is handed to ``sent[-1]`` (torchft counts none itself)."""
    allreduce = manager.allreduce

    def counted(tensor: Any, *a: Any, **kw: Any) -> Any:
        sent[-1] += tensor.numel() * tensor.element_size()
        return allreduce(tensor, *a, **kw)

    manager.allreduce = counted


def job(args: argparse.Namespace, held_out: Any, evaluate: Any) -> None:
    """One rank: ``args.steps`` inner steps; rank 0 writes the same record as hsdp's job (``held_out`` and
    ``evaluate`` are the driver's, so the windows and the evaluation are the same)."""
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's per-sync INFO lines: see elastic_recovery_torchft.py
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torchft.coordination import LighthouseServer
    from torchft.local_sgd import DiLoCo

    from hsdp.data.text import TokenStream, as_tokens, default_corpus_bytes, split_tokens
    from hsdp.models.gpt import GPT, preset

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    replica, shard_rank = divmod(rank, NPROC)
    host = node_address(os.environ["MASTER_ADDR"])
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2) if rank == 0 else None
    port = int(lighthouse.address().rsplit(":", 1)[1]) if lighthouse is not None else 0
    node0, lighthouse_port = _shared_addresses(host, port)[0]
    cfg = preset(args.preset)
    train, held = split_tokens(as_tokens(default_corpus_bytes(args.corpus_bytes)), 0.05)
    stream = TokenStream(train, args.block, args.batch, seed=args.seed, rank=rank, world_size=world)
    windows = held_out(held, args.block, args.eval_windows, shard_rank, NPROC)
    torch.manual_seed(args.seed)
    model = GPT(cfg)
    mesh = init_device_mesh("cpu", (world // NPROC, NPROC), mesh_dim_names=("replicate", "shard"))["shard"]
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    inner = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    fragments = _fragments(model, args.fragments if args.mode == "torchft-streaming" else 1)
    outer = [torch.optim.SGD(f.parameters(), lr=args.outer_lr, momentum=args.outer_momentum,
                             nesterov=args.outer_momentum > 0) for f in fragments]
    manager = _manager(replica, shard_rank, host, f"http://{node0}:{lighthouse_port}")
    streaming = args.mode == "torchft-streaming"

    def held_out_loss() -> float:
        loss = evaluate(model, windows)
        model.reshard()  # FSDP2 keeps the root unsharded after a forward without backward; DiLoCo needs shards
        return loss

    step_s, losses, sent = [], [], []
    _count_sent(manager, sent)
    with DiLoCo(manager, fragments, inner, outer, sync_every=args.every,
                fragment_sync_delay=args.delay if streaming else 0,
                fragment_update_alpha=args.mix if streaming else 0.0):
        evals = [(0, held_out_loss())]
        for step in range(args.steps):
            x, y = stream.batch(step)
            sent.append(0)
            start = time.perf_counter()
            _, loss = model(x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            inner.step()  # DiLoCo's hook: the (fragment's) sync when its step comes
            inner.zero_grad()
            step_s.append(time.perf_counter() - start)
            losses.append(loss.item())
            if (step + 1) % args.every == 0 or step + 1 == args.steps:
                evals.append((step + 1, held_out_loss()))
    mine = {"step_s": step_s, "loss": losses, "sent": sent}
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        params = sum(p.numel() for p in model.parameters() if p.requires_grad)
        Path(args.out).write_text(json.dumps({"mesh": f"FSDP2 shard=2 x torchft replicas=2 (rank {rank})",
                                              "params": params, "evals": evals, "ranks": everyone}))
    manager.shutdown(wait=False)
    dist.barrier()
    if lighthouse is not None:
        lighthouse.shutdown()
    dist.destroy_process_group()
