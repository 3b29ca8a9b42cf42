"""``hsdp env``: what a bug report needs about this machine, in one command (``--json`` for a file).

Versions (hsdp, torch, Python), CUDA and its devices, the communication backends, the torchrun variables
this process sees and the mesh ``hsdp.init_mesh()`` would build from them, the network interfaces, and
whether ``hsdp launch`` can emulate a cluster here. Read-only and bounded: no process group is initialised
(the mesh comes from the same pure function ``init_mesh`` calls), nothing is created, and every external
program runs with a timeout, so it answers on a machine with a broken network or no GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import subprocess
import warnings
from typing import Any

from hsdp.apps.cli.helptext import HelpFormatter
from hsdp.tools.quantities import format_bytes

# What torchrun (and hsdp launch) set for each rank, and what changes how the ranks talk or are laid out.
LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                    "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
                    "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "HSDP_SHARDING_DEGREE",
                    "CUDA_VISIBLE_DEVICES", "NCCL_SOCKET_IFNAME", "NCCL_IB_HCA", "NCCL_DEBUG",
                    "GLOO_SOCKET_IFNAME", "OMP_NUM_THREADS")
PROBE_TIMEOUT_S = 5.0  # per external program (ip, tc): a wedged one must not hang a bug report


def add_env(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``env`` on ``subparsers``."""
    p = subparsers.add_parser("env", help="print versions, devices, backends, launch variables and network "
                                          "for a bug report",
                              description="Print what a bug report needs: hsdp, torch and Python versions; CUDA\n"
                                          "devices and NCCL; gloo, NCCL and MPI availability; the torchrun\n"
                                          "variables present and the mesh init_mesh() would build from them;\n"
                                          "network interfaces; whether hsdp launch can emulate a cluster here.\n"
                                          "Creates nothing and starts no process group.",
                              formatter_class=HelpFormatter)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the text report")
    p.set_defaults(func=run_env)
    return p


def run_env(args: argparse.Namespace) -> int:
    """Execute a parsed ``hsdp env``: print the report; 0."""
    info = collect()
    print(json.dumps(info, indent=2) if args.json else render(info))
    return 0


def collect(environ: dict[str, str] | None = None) -> dict[str, Any]:
    """Everything ``hsdp env`` reports, as plain JSON values; ``environ`` defaults to this process's."""
    environ = dict(os.environ if environ is None else environ)
    return {"versions": versions(), "cuda": cuda(), "backends": backends(),
            "launch_variables": {k: environ[k] for k in LAUNCH_VARIABLES if k in environ},
            "mesh": default_mesh(environ), "network": interfaces(), "emulation": emulation()}


def versions() -> dict[str, str]:
    import torch

    from hsdp import __version__

    return {"hsdp": __version__, "torch": torch.__version__, "python": platform.python_version(),
            "platform": platform.platform()}


def cuda() -> dict[str, Any]:
    """Whether CUDA is usable, torch's CUDA build, NCCL's version and each visible device."""
    import torch

    out: dict[str, Any] = {"available": torch.cuda.is_available(), "torch_cuda": torch.version.cuda}
    if not out["available"]:
        return out
    try:
        out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception as e:  # NCCL missing from this build: say so instead of failing the report
        out["nccl"] = f"unavailable ({e})"
    out["devices"] = [{"name": torch.cuda.get_device_name(i),
                       "memory_bytes": torch.cuda.get_device_properties(i).total_memory,
                       "capability": ".".join(map(str, torch.cuda.get_device_capability(i)))}
                      for i in range(torch.cuda.device_count())]
    return out


def backends() -> dict[str, bool]:
    import torch.distributed as dist

    if not dist.is_available():
        return {"distributed": False}
    return {"distributed": True, "gloo": dist.is_gloo_available(), "nccl": dist.is_nccl_available(),
            "mpi": dist.is_mpi_available()}


def default_mesh(environ: dict[str, str]) -> dict[str, Any]:
    """The replicate x shard mesh ``init_mesh()`` (no arguments) would build under these variables,
    from :func:`hsdp.engine.mesh_layout.default_sharding_degree`; ``error`` holds what init_mesh would raise, and
    ``not_a_rank`` says why there is no mesh to show outside a launcher (the normal case, not an error)."""
    from hsdp.engine.mesh_layout import default_sharding_degree, node_crossing_warning

    if "WORLD_SIZE" not in environ:
        return {"not_a_rank": "WORLD_SIZE is not set (run hsdp env under torchrun or hsdp launch to see the "
                              "mesh a rank would build)"}
    try:
        world = int(environ["WORLD_SIZE"])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            degree = default_sharding_degree(world, environ)
    except ValueError as e:
        return {"error": str(e)}
    out: dict[str, Any] = {"world_size": world, "replicate": world // degree, "shard": degree,
                           "notes": [str(w.message) for w in caught]}
    crossing = node_crossing_warning(world, degree, int(environ.get("LOCAL_WORLD_SIZE", world)))
    if crossing:
        out["notes"].append(crossing)
    return out


def _probe(argv: list[str]) -> tuple[bool, str]:
    """(whether ``argv`` exited 0, its first line of output or error), bounded by :data:`PROBE_TIMEOUT_S`."""
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, str(e)
    lines = (proc.stdout.strip() or proc.stderr.strip()).splitlines()
    return proc.returncode == 0, lines[0] if lines else ""


def interfaces() -> list[dict[str, Any]]:
    """Each network interface and its addresses: psutil when installed, else ``ip -j addr``, else the
    names alone (``socket.if_nameindex``)."""
    try:
        import psutil
    except ImportError:
        psutil = None
    if psutil is not None:
        return [{"name": name, "addresses": [a.address for a in addrs if a.family in (socket.AF_INET, socket.AF_INET6)]}
                for name, addrs in psutil.net_if_addrs().items()]
    ip = shutil.which("ip")
    if ip is not None:
        try:
            out = subprocess.run([ip, "-j", "addr", "show"], capture_output=True, text=True,
                                 timeout=PROBE_TIMEOUT_S, check=True).stdout
            return [{"name": link["ifname"], "addresses": [a["local"] for a in link.get("addr_info", [])]}
                    for link in json.loads(out or "[]")]
        except (OSError, ValueError, KeyError, subprocess.SubprocessError):
            pass  # an old iproute2 without -j, or a wedged one: the names still help
    return [{"name": name, "addresses": []} for _, name in socket.if_nameindex()]


def emulation() -> dict[str, Any]:
    """What ``hsdp launch`` needs to emulate nodes (root, ``ip netns``, ``tc``): its own verdict
    (:func:`hsdp.tools.launch.emulated.unavailable_reason`), whether both programs answer, and the
    namespaces of runs whose launcher died (``hsdp launch --cleanup`` removes them)."""
    from hsdp.tools.launch.emulated import unavailable_reason
    from hsdp.tools.launch.netns import RunId, find_tools, list_namespaces

    tools = find_tools()
    reason = unavailable_reason(tools)
    out: dict[str, Any] = {"root": os.geteuid() == 0, "ip": tools.ip if tools else shutil.which("ip"),
                           "tc": tools.tc if tools else shutil.which("tc"), "usable": reason is None,
                           "reason": reason}
    if tools is None:
        return out
    out["ip_netns_works"], _ = _probe([tools.ip, "netns", "list"])
    out["tc_works"], _ = _probe([tools.tc, "qdisc", "show", "dev", "lo"])
    if out["ip_netns_works"]:
        runs = [RunId.from_namespace(name) for name in list_namespaces(tools)]
        out["leftover_namespaces"] = sorted({r.name for r in runs if r is not None and not r.owner_alive()})
    return out


def render(info: dict[str, Any]) -> str:
    """The text report: one ``section:`` line, then indented ``key: value`` lines."""
    lines = []
    for section, body in info.items():
        lines.append(f"{section}:")
        if isinstance(body, dict):
            lines += [f"  {key}: {_text(value)}" for key, value in body.items()]
        else:
            lines += [f"  {_text(item)}" for item in body] or ["  (none)"]
        if section == "launch_variables" and not body:
            lines.append("  (none: not under torchrun or hsdp launch)")
    return "\n".join(lines)


def _text(value: Any) -> str:
    if isinstance(value, dict) and {"name", "addresses"} <= set(value):  # an interface
        return f"{value['name']}: {', '.join(value['addresses']) or '-'}"
    if isinstance(value, list):
        return "; ".join(_text(v) for v in value) if value else "-"
    if isinstance(value, dict):  # a device: its memory in GiB, as it is sold
        return ", ".join(f"{k}={format_bytes(v) if k.endswith('_bytes') else _text(v)}" for k, v in value.items())
    return str(value)

