"""torchft's side of ``elastic_recovery.py``: one rank of a torchft replica group, and its lighthouse.

torchft 0.2.0 (``pip install -e .[peers]``), its HSDP path: inside each replica group (one emulated node, its own
torchrun job, exactly as hsdp's) the GPT is sharded with FSDP2 (``torch.distributed.fsdp.fully_shard``: every
block, then the root, as ``hsdp.ShardedModel`` wraps it) over the node's 2 ranks on gloo; across the groups,
``torchft.Manager`` with a ``torchft.ProcessGroupGloo`` on the replicate dimension: each step the quorum
(``start_quorum``, asynchronous, overlapping the forward), the sharded gradients flattened into one buffer and
averaged by ``Manager.allreduce`` (the fault-tolerant all-reduce: a peer that dies mid-reduction makes it report an
error instead of raising), ``Manager.should_commit()`` and only then ``AdamW.step()``. A restarted group is healed
by torchft from a live one (its checkpoint transport, HTTP, serving each rank's local shards and AdamW state),
while the others go on. Not torchft's DDP wrapper: 0.2.0's comm hook crashes the survivor when a peer dies
mid-all-reduce (``assert fut._fut`` in its ``ddp.py``).

The lighthouse (``torchft_lighthouse``, the binary of the torchft wheel) runs where hsdp's coordinator runs, on
node 0 (its network namespace, outside the cpu groups), started by the driver once the launch's coordinator
process exists (the torchft run goes through the same ``hsdp launch --elastic``, whose coordinator then idles).

Timeouts, set equal to hsdp's where they correspond (``hsdp.engine.replicate.elastic.ElasticPolicy``'s defaults
and ``hsdp launch --elastic``'s coordinator; see :func:`timeouts`): heartbeat interval (hsdp's ranks beat to the
coordinator; torchft's manager to the lighthouse), heartbeat timeout (coordinator; lighthouse
``--heartbeat_timeout_ms``), the replicate collectives' timeout (hsdp's ``hop_timeout``; the manager's
``timeout`` and its ``ProcessGroupGloo``'s), connect timeout, the wait to be admitted (hsdp's ``join_timeout``;
the manager's ``quorum_timeout``), the start's wait for every replica (the coordinator's ``--start-grace``; the
lighthouse's ``--join_timeout_ms``, which torchft applies to every quorum with a heartbeating straggler, not only
the first), and the minimum of replicas (a majority, 2 of 3, on both). hsdp's coordinator also probes a failed
reduction's ranks' liveness ports (a dead process is dropped at once, before its heartbeat times out); torchft's
lighthouse has only the heartbeat.

What inside network namespaces needs (each node's host name resolves to the machine's address, not the
node's): the manager is given the node's address as its ``hostname`` and its store address, and the HTTP
checkpoint server (whose address is built from ``socket.gethostname()``) advertises the node's address
(:class:`_NodeHTTPTransport`); gloo uses the node's link (``GLOO_SOCKET_IFNAME``, set by the launch).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import IO, Any

NPROC = 2
MIN_REPLICAS = 2  # hsdp launch's default: a majority of the 3 nodes
REPLICA_ID_PREFIX = "replica_"  # torchft derives a group's global ranks from the id's trailing digits
VERSION = "0.2.0"


def timeouts() -> dict[str, float]:
    """The seconds both systems get, named after hsdp's settings (each torchft counterpart in the docstring)."""
    from hsdp.engine.replicate.elastic.protocol import ElasticPolicy
    from hsdp.tools.launch.elastic import START_GRACE_S

    p = ElasticPolicy()
    return {"heartbeat_interval": p.heartbeat_interval, "heartbeat_timeout": p.heartbeat_timeout,
            "hop_timeout": p.hop_timeout, "connect_timeout": p.connect_timeout, "join_timeout": p.join_timeout,
            "start_grace": START_GRACE_S}


def installed_version() -> str | None:
    """torchft's installed version, ``None`` when it is missing."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torchft")
    except PackageNotFoundError:
        return None


# ---------------------------------------------------------------------------------------------------------
# The lighthouse, started by the driver in node 0's network namespace.
# ---------------------------------------------------------------------------------------------------------
def _coordinator_pid(marker_env: str, marker: str) -> int | None:
    """The launch's coordinator (``hsdp coordinator``) of this run: it sits in node 0's network namespace."""
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if (env.get(marker_env.encode()) == marker.encode() and b"coordinator" in argv and b"hsdp" in argv
                and b"TORCHELASTIC_RESTART_COUNT" not in env):
            return int(entry)
    return None


def lighthouse_command(port: int) -> list[str]:
    """``torchft_lighthouse`` on ``port`` of every address, with the timeouts of :func:`timeouts`."""
    t = timeouts()
    binary = Path(sys.executable).parent / "torchft_lighthouse"
    found = str(binary) if binary.exists() else shutil.which("torchft_lighthouse")
    if found is None:
        raise SystemExit("torchft_lighthouse not found: pip install -e .[peers]")
    return [found, "--bind", f"[::]:{port}", "--min_replicas", str(MIN_REPLICAS),
            "--heartbeat_timeout_ms", str(round(1000 * t["heartbeat_timeout"])),
            "--join_timeout_ms", str(round(1000 * t["start_grace"])), "--quorum_tick_ms", "100"]


def start_lighthouse(marker_env: str, marker: str, port: int, sink: IO[str], timeout_s: float = 120.0,
                     alive: Any = None) -> subprocess.Popen:
    """The lighthouse in the network namespace of this run's coordinator (entered with ``nsenter`` when it is
    not this process's: an emulated launch), once that coordinator exists."""
    deadline = time.monotonic() + timeout_s
    while (pid := _coordinator_pid(marker_env, marker)) is None:
        if alive is not None and not alive():
            raise RuntimeError("the launch ended before its coordinator started")
        if time.monotonic() > deadline:
            raise RuntimeError(f"no coordinator process within {timeout_s:.0f} s")
        time.sleep(0.2)
    same = os.readlink(f"/proc/{pid}/ns/net") == os.readlink("/proc/self/ns/net")
    enter = [] if same else ["nsenter", f"--net=/proc/{pid}/ns/net", "--"]
    return subprocess.Popen([*enter, *lighthouse_command(port)], stdout=sink, stderr=subprocess.STDOUT,
                            env={**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "warn")})


# ---------------------------------------------------------------------------------------------------------
# One rank of a replica group (under torchrun, one job per node).
# ---------------------------------------------------------------------------------------------------------
def node_address(toward: str) -> str:
    """This node's address on the route to ``toward`` (node 0): its link's address in a namespace, else the
    loopback's. A UDP connect sends nothing; it only picks the source address."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((toward, 9))
        return str(s.getsockname()[0])


def _wait_reachable(host: str, port: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((host, port), timeout=1.0).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _local(t: Any) -> Any:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _state_fns(model: Any, opt: Any) -> tuple[Any, Any]:
    """torchft's ``state_dict`` / ``load_state_dict`` of one rank: its local shards of the parameters and of
    AdamW's state (what a healed rank of the same position in another group needs; plain tensors, so the HTTP
    transport pickles no device mesh)."""
    import torch
    from torch.distributed.tensor import DTensor

    params = list(model.parameters())

    def state_dict() -> dict[str, Any]:
        return {"params": [_local(p.detach()) for p in params],
                "optim": [{k: _local(v) for k, v in opt.state[p].items()} for p in params]}

    def load_state_dict(sd: dict[str, Any]) -> None:
        with torch.no_grad():
            for p, saved, state in zip(params, sd["params"], sd["optim"]):
                _local(p).copy_(saved)
                opt.state[p] = {k: DTensor.from_local(v.clone(), p.device_mesh, p.placements, run_check=False,
                                                      shape=p.shape, stride=p.stride())
                                if isinstance(p, DTensor) and v.dim() > 0 else v.clone() for k, v in state.items()}

    return state_dict, load_state_dict


def node_transport(host: str, timeout: timedelta) -> Any:
    """torchft's HTTP checkpoint transport, advertising ``host`` rather than the machine's host name."""
    from torchft.checkpointing.http_transport import HTTPTransport

    class _NodeHTTPTransport(HTTPTransport):
        def address(self) -> str:
            return f"http://{host}:{self._server.socket.getsockname()[1]}/checkpoint/"

    return _NodeHTTPTransport(timeout=timeout, num_chunks=0)


def _average_gradients(manager: Any, params: list[Any]) -> None:
    """The sharded gradients, flattened into one buffer, averaged across the replica groups by torchft."""
    import torch

    grads = [_local(p.grad) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    manager.allreduce(flat).wait()
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def _members(manager: Any) -> list[int]:
    """The replicas of the manager's current quorum (torchft keeps them only as the replicate group's global
    ranks: replica * group size + group rank)."""
    ranks = getattr(manager._pg, "_global_ranks", None) or []
    return sorted({r // NPROC for r in ranks})


def job(preset_name: str, out: Path, lighthouse_port: int, seed_of: Any) -> None:
    """Train until the driver's stop file's step, one line per step from each group's rank 0 into ``out``
    (the same fields as hsdp's job); ``seed_of(step, replica, rank)`` is the data's seed."""
    # torchft's Rust side logs several INFO lines per step (quorum, commit) into the launcher's pipes, which
    # hsdp's ranks do not: warnings only. Read when its extension loads, so before the import.
    os.environ.setdefault("RUST_LOG", "warn")
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torchft import Manager, ProcessGroupGloo

    from hsdp.models.gpt import GPT, preset

    torch.set_num_threads(1)
    t = timeouts()
    replica, restart = int(os.environ["HSDP_REPLICA_ID"]), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    node0 = os.environ["HSDP_COORDINATOR"].rsplit(":", 1)[0]
    dist.init_process_group("gloo")  # the group's own world: its torchrun job, its store on its rank 0
    rank = dist.get_rank()
    cfg = preset(preset_name)
    torch.manual_seed(0)
    model = GPT(cfg)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    params = [p for p in model.parameters() if p.requires_grad]
    state_dict, load_state_dict = _state_fns(model, opt)
    host = node_address(node0)
    _wait_reachable(node0, lighthouse_port, t["join_timeout"])
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=t["hop_timeout"])), load_state_dict=load_state_dict,
        state_dict=state_dict, min_replica_size=MIN_REPLICAS, replica_id=f"{REPLICA_ID_PREFIX}{replica}",
        lighthouse_addr=f"http://{node0}:{lighthouse_port}", hostname=host, store_addr=host,
        store_port=int(os.environ["MASTER_PORT"]), timeout=timedelta(seconds=t["hop_timeout"]),
        quorum_timeout=timedelta(seconds=t["join_timeout"]), connect_timeout=timedelta(seconds=t["connect_timeout"]),
        heartbeat_interval=timedelta(seconds=t["heartbeat_interval"]), init_sync=False,
        checkpoint_transport=node_transport(host, timedelta(seconds=t["hop_timeout"])))
    log = open(out / f"steps_r{replica}.jsonl", "a") if rank == 0 else None  # noqa: SIM115
    stop_file, stop_at = out / "stop", None
    while stop_at is None or manager.current_step() <= stop_at:
        if stop_at is None and stop_file.exists():
            stop_at = int(stop_file.read_text())
        manager.start_quorum()
        opt.zero_grad()
        g = torch.Generator().manual_seed(seed_of(manager.current_step(), replica, rank))
        ids = torch.randint(0, cfg.vocab_size, (2, cfg.block_size + 1), generator=g)
        _, loss = model(ids[:, :-1], ids[:, 1:])
        loss.backward()
        _average_gradients(manager, params)  # waits for the quorum (and a healed group's step)
        step = manager.current_step()
        committed = manager.should_commit()
        if committed:
            opt.step()
        if log is not None:
            log.write(json.dumps({"t": time.time(), "step": step, "committed": committed,
                                  "replicas": _members(manager), "restart": restart}) + "\n")
            log.flush()
    manager.shutdown(wait=False)
    dist.destroy_process_group()
