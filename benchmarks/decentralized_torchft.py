"""torchft's side of ``decentralized.py`` (``--systems hsdp,torchft``): one rank of torchft 0.2.0's Streaming
DiLoCo on one emulated node of the decentralized launch.

The same ``hsdp launch --elastic`` as hsdp's run (each node its own torchrun job, restarted after a kill; the
same cpu groups and 100 Mbit/s links; the coordinator idles), model (``hsdp.models.gpt``), data (the driver's
seeded windows per (inner step, replica, rank)), batches, inner AdamW + clip 1.0, H, F, tau and outer Nesterov
SGD. Inside each node the replica is FSDP2 (``fully_shard`` on every block, then the root, over the node's
ranks on gloo); a one-rank node trains the plain module (FSDP2 over one rank shards nothing). Across the nodes
``torchft.local_sgd.DiLoCo`` with ``model_fragments`` (hsdp's split: ``diloco_slow_links_torchft._fragments``),
``fragment_sync_delay=tau``, ``fragment_update_alpha`` the driver's ``--mix`` (hsdp's ``mix``) and a
``torchft.Manager`` per node (``use_async_quorum=False``, as DiLoCo requires), its lighthouse on node 0 (started
by the driver, as in ``elastic_recovery.py``), the timeouts of ``elastic_recovery_torchft.timeouts`` (hsdp's).
Pseudo-gradients travel in fp32: torchft's quantised all-reduce needs triton (a GPU).

What differs from hsdp, by torchft's design: a restarted node trains ``H / F - tau`` inner steps from its fresh
initialisation before its first quorum heals it (those steps are lost: the heal overwrites them, and the log
says when); the heal copies a live replica's weights, inner AdamW state and step counter, so until its next
sync the healed node repeats that replica's pseudo-gradient; across nodes the pseudo-gradients are averaged
unweighted (inside a node the loss is scaled so that FSDP2's mean is weighted by the ranks' batches, as hsdp's
batch weights do).

At the end every replica lands on the global copy, as hsdp's ``opt.sync_replicas()``: the ranks go on until no
fragment's sync is in flight, then sync every fragment once (quorum, all-reduce, outer step), then evaluate.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from decentralized_data import held_out_loss
from diloco_slow_links_torchft import _fragments
from elastic_recovery_torchft import (
    MIN_REPLICAS,
    REPLICA_ID_PREFIX,
    _state_fns,
    _wait_reachable,
    node_address,
    node_transport,
    timeouts,
)


def _replica(model: Any, nproc: int) -> Any:
    """The node's replica: FSDP2 over its ranks, as ``hsdp.ShardedModel`` wraps it; the module itself on one."""
    if nproc == 1:
        return model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (nproc,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _manager(replica: int, node0: str, port: int, state: dict[str, Any], model: Any, inner: Any) -> Any:
    """Node ``replica``'s Manager. What it heals a restarted node with: this rank's shards of the weights and of
    AdamW's state (``elastic_recovery_torchft._state_fns``) and the inner step counter (so the healed node's
    data goes on from the others' step); ``state["healed"]`` gets the time of each heal."""
    from torchft import Manager, ProcessGroupGloo

    t = timeouts()
    weights, load_weights = _state_fns(model, inner)

    def state_dict() -> dict[str, Any]:
        return {"weights": weights(), "step": state["step"]}

    def load_state_dict(sd: dict[str, Any]) -> None:
        load_weights(sd["weights"])
        state["step"] = sd["step"]
        state["healed"].append(time.time())

    host = node_address(node0)
    _wait_reachable(node0, port, t["join_timeout"])
    return Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=t["hop_timeout"])), load_state_dict=load_state_dict,
        state_dict=state_dict, min_replica_size=MIN_REPLICAS, use_async_quorum=False, init_sync=False,
        replica_id=f"{REPLICA_ID_PREFIX}{replica}", lighthouse_addr=f"http://{node0}:{port}", hostname=host,
        store_addr=host, store_port=int(os.environ["MASTER_PORT"]), timeout=timedelta(seconds=t["hop_timeout"]),
        quorum_timeout=timedelta(seconds=t["join_timeout"]), connect_timeout=timedelta(seconds=t["connect_timeout"]),
        heartbeat_interval=timedelta(seconds=t["heartbeat_interval"]),
        checkpoint_transport=node_transport(host, timedelta(seconds=t["hop_timeout"])))


def _members(manager: Any, nproc: int) -> list[int]:
    """The replicas of the manager's quorum (torchft keeps only the replicate group's global ranks: replica x
    node size + rank)."""
    return sorted({r // nproc for r in getattr(manager._pg, "_global_ranks", None) or []})


def _log_syncs(diloco: Any, syncs: list[tuple[int, bool]]) -> None:
    """Append (fragment, committed) to ``syncs`` at each fragment's landing (torchft logs none itself)."""
    for i, fragment in enumerate(diloco._fragments):
        def perform(i: int = i, original: Callable[[], bool] = fragment.perform_sync) -> bool:
            committed = original()
            syncs.append((i, committed))
            return committed

        fragment.perform_sync = perform


def _in_flight(diloco: Any) -> bool:
    """A fragment's all-reduce started and not landed (DiLoCo prepares it ``tau`` steps before its sync)."""
    return diloco._local_step >= diloco._sync_every - diloco._fragment_sync_delay


def _sync_all(diloco: Any, manager: Any) -> None:
    """Every fragment's sync once, in order, outside the inner steps: each replica then holds the global copy
    (hsdp's ``sync_replicas`` does the same, one outer step per fragment). The same calls on every replica."""
    for fragment in diloco._fragments:
        manager.start_quorum()
        fragment.prepare_sync()
        fragment.perform_sync()


def job(args: argparse.Namespace, data: tuple[Any, Callable[..., Any], Any]) -> None:
    """Train until the driver's stop step, one line per inner step into ``args.out`` (the fields of hsdp's job;
    the sync's on the steps a fragment lands); ``data``: the driver's (config, batch of (step, replica, rank,
    count), held-out windows)."""
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's per-sync INFO lines (see elastic_recovery_torchft.py)
    import torch
    import torch.distributed as dist
    from torchft.local_sgd import DiLoCo

    from hsdp.models.gpt import GPT

    torch.set_num_threads(1)
    cfg, batch_of, held = data
    replica, restart = int(os.environ["HSDP_REPLICA_ID"]), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    dist.init_process_group("gloo")  # the node's own world: its torchrun job
    rank, nproc = dist.get_rank(), dist.get_world_size()
    batches = [int(b) for b in args.batches.split(",")][replica * nproc:(replica + 1) * nproc]
    mine, scale = batches[rank], batches[rank] * nproc / sum(batches)  # FSDP2 averages: weight by batch
    torch.manual_seed(args.seed)
    model = _replica(GPT(cfg), nproc)
    inner = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    fragments = _fragments(model, args.fragments)
    outer = [torch.optim.SGD(f.parameters(), lr=args.outer_lr, momentum=args.outer_momentum,
                             nesterov=args.outer_momentum > 0) for f in fragments]
    state: dict[str, Any] = {"step": 0, "healed": []}
    node0 = os.environ["HSDP_COORDINATOR"].rsplit(":", 1)[0]
    manager = _manager(replica, node0, args.lighthouse_port, state, model, inner)
    log = open(Path(args.out) / f"r{replica}_s{rank}_i{restart}.jsonl", "a")  # noqa: SIM115
    log.write(json.dumps({"joined": 0, "t": time.time(), "restart": restart}) + "\n")
    stop_file, stop_at, syncs = Path(args.out) / "stop", None, []
    with DiLoCo(manager, fragments, inner, outer, sync_every=args.every, fragment_sync_delay=args.delay,
                fragment_update_alpha=args.mix) as diloco:
        _log_syncs(diloco, syncs)
        while stop_at is None or state["step"] <= stop_at or _in_flight(diloco):
            if stop_at is None and stop_file.exists():
                stop_at = int(stop_file.read_text())
            step, healed = state["step"], len(state["healed"])
            x = batch_of(step, replica, rank, mine)
            _, loss = model(x[:, :-1], x[:, 1:])
            (loss * scale).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            inner.step()  # DiLoCo's hook: a quorum (maybe a heal), a fragment's all-reduce or landing
            inner.zero_grad()
            record = {"t": time.time(), "step": step, "tokens": mine * cfg.block_size, "loss": loss.item(),
                      "restart": restart}
            if syncs:
                fragment, committed = syncs.pop()
                record.update(sync=fragment, committed=committed, replicas=_members(manager, nproc),
                              landed=[fragment] if committed else [])
            if len(state["healed"]) > healed:  # overwritten: this step and those since the last landing are lost
                record["healed"] = state["healed"][-1]
            log.write(json.dumps(record) + "\n")
            log.flush()
            state["step"] += 1  # the healed counter is the peer's step in progress: both go on from the next
    _sync_all(diloco, manager)
    loss = held_out_loss(model, held)  # every rank of a node the same windows: FSDP2's all-gathers, nothing across
    log.write(json.dumps({"eval": loss, "after": state["step"] - 1, "t": time.time(),
                          "final_syncs": [committed for _, committed in syncs]}) + "\n")
    log.close()
    manager.shutdown(wait=False)
    dist.destroy_process_group()
