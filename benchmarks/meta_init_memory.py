"""Peak memory per rank of getting a big GPT into a ShardedModel: plain construction vs meta + materialize
vs meta + load_pretrained.

Each mode runs in fresh processes (``--world`` ranks on gloo, mesh ``world/S x S``). A rank records its
resident set after imports and process-group set-up, resets the kernel's high-water mark
(``/proc/self/clear_refs``), builds and wraps the model, and reports the growth of its peak RSS. The ratio
to the full model's fp32 bytes is the number to read: plain construction holds the whole model on every
rank (1x) plus its shards, meta + materialize holds the shards (1/S) plus the largest module being
initialised, load_pretrained the shards plus one tensor's rows. ``pretrained`` loads a file this script
writes first (from the plain model, seed 0) and checks every rank's shards equal the plain run's.

    python benchmarks/meta_init_memory.py                       # gpt2-350m preset, 4 ranks, 2 x 2
    python benchmarks/meta_init_memory.py --preset small --modes plain,meta

Writes ``benchmarks/results/meta_init_memory_<date>.json`` and ``.md`` (with this command).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import hashlib
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import hsdp
from hsdp.models.gpt import GPT, GPTConfig, preset

MODES = ("plain", "meta", "pretrained")
# glibc returns a freed block to the OS only if it was mmap'd, and by default raises its mmap threshold
# (up to 32 MiB) after each large free: later blocks of a few MiB then come from the heap, whose freed holes
# it keeps. "fixed" pins the threshold at 1 MiB, so RSS follows the live tensors.
ALLOCATORS = {"default": None, "fixed": "1048576"}


def gpt_style_init(model: nn.Module, cfg: GPTConfig):  # a closure: init(module) -> None
    """``init=`` for materialize reproducing GPT's scheme (N(0, 0.02), scaled residual projections)."""
    proj = {id(m) for name, m in model.named_modules() if name.endswith(".proj")}
    proj_std = 0.02 / math.sqrt(2 * cfg.n_layer)

    def init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, mean=0.0, std=proj_std if id(m) in proj else 0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
        else:
            m.reset_parameters()

    return init


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"{field}:\s+(\d+)", f.read()).group(1))


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        return True
    except OSError:
        return False


def _build(mode: str, cfg: GPTConfig, mesh: hsdp.HSDPMesh, path: str) -> nn.Module:
    if mode == "plain":
        torch.manual_seed(0)
        return hsdp.ShardedModel(GPT(cfg), mesh=mesh)
    with torch.device("meta"):
        model = hsdp.ShardedModel(GPT(cfg), mesh=mesh)
    if mode == "meta":
        torch.manual_seed(0)
        return hsdp.materialize(model, init=gpt_style_init(model, cfg))
    return hsdp.load_pretrained(model, path)


def _worker(rank: int, world: int, degree: int, mode: str, cfg: GPTConfig, path: str, tmp: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=world,
                            timeout=timedelta(minutes=20))
    mesh = hsdp.init_mesh(degree, fault_policy=None)
    _warm_up(mesh, tmp, rank)
    dist.barrier()
    gc.collect()
    base = _status_kib("VmRSS")
    exact = _reset_peak()
    start = time.perf_counter()
    model = _build(mode, cfg, mesh, path)
    seconds = time.perf_counter() - start
    gc.collect()
    peak = _status_kib("VmHWM")  # without a reset (exact=False): the peak since process start
    flats = [u.sharded_flat for u in model.units if u.params]
    digest = hashlib.sha256(b"".join(f.detach().numpy().tobytes() for f in flats)).hexdigest()[:16]
    out = {"rank": rank, "peak_growth": (peak - base) * 1024, "final_growth": (_status_kib("VmRSS") - base) * 1024,
           "shard_bytes": sum(f.numel() * f.element_size() for f in flats), "seconds": seconds,
           "peak_reset": exact, "digest": digest}
    with open(os.path.join(tmp, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()


def _warm_up(mesh: hsdp.HSDPMesh, tmp: str, rank: int) -> None:
    """Build each mode once with the tiny preset, so lazy imports and one-time caches (tens of MiB) are
    resident before the baseline and the measurement sees the model's memory only."""
    path = os.path.join(tmp, f"tiny{rank}.safetensors")
    write_checkpoint(preset("tiny"), path)
    for mode in MODES:
        _build(mode, preset("tiny"), mesh, path)
    gc.collect()


def run_mode(mode: str, world: int, degree: int, cfg: GPTConfig, path: str, allocator: str) -> list[dict]:
    os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
    if ALLOCATORS[allocator] is not None:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = ALLOCATORS[allocator]  # read by glibc as each child starts
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_worker, args=(world, degree, mode, cfg, path, tmp), nprocs=world, join=True,
                           start_method="spawn")
        return [json.load(open(os.path.join(tmp, f"rank{r}.json"))) for r in range(world)]


def write_checkpoint(cfg: GPTConfig, path: str) -> None:
    """The plain model's weights (seed 0), each tied tensor once, as one safetensors file."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    model = GPT(cfg)
    weights, seen = {}, set()
    for name, t in model.state_dict().items():
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            weights[name] = t
    save_file(weights, path)


def _markdown(report: dict) -> str:
    lines = [f"# Meta-device initialisation memory {report['date']}", "",
             f"Command: `{report['command']}` (git {report['git']})", "",
             f"GPT preset `{report['preset']}`: {report['params']:,} parameters, full model "
             f"{report['model_bytes'] / 2**20:.1f} MiB fp32; {report['world']} ranks on gloo (CPU), mesh "
             f"{report['world'] // report['degree']} x {report['degree']} (replicas x shards). Peak RSS growth: "
             f"the kernel's resident-set high-water mark (VmHWM, reset after set-up) minus the resident set "
             f"before building, per rank; ratio = growth / full model bytes. Shards alone are 1/S = "
             f"{1 / report['degree']:.2f}x.", "",
             "Allocator `default`: glibc as configured (its mmap threshold grows after large frees, and freed "
             "heap blocks stay resident); `fixed`: `MALLOC_MMAP_THRESHOLD_=1048576` in the ranks' environment, "
             "so freed tensors leave the RSS and it follows the live tensors.", "",
             "| mode | allocator | rank | peak RSS growth MiB | x full model | shard MiB | final MiB | seconds |",
             "|---|---|---|---|---|---|---|---|"]
    for key, ranks in report["modes"].items():
        mode, allocator = key.split("/")
        for r in ranks:
            lines.append(f"| {mode} | {allocator} | {r['rank']} | {r['peak_growth'] / 2**20:.1f} | "
                         f"{r['peak_growth'] / report['model_bytes']:.3f} | {r['shard_bytes'] / 2**20:.1f} | "
                         f"{r['final_growth'] / 2**20:.1f} | {r['seconds']:.1f} |")
    lines += ["", *[f"- {note}" for note in report["notes"]], ""]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="gpt2-350m")
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--sharding-degree", type=int, default=2)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--allocators", default=",".join(ALLOCATORS))
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = parser.parse_args()
    modes = args.modes.split(",")
    allocators = args.allocators.split(",")
    if unknown := set(modes) - set(MODES):
        parser.error(f"unknown modes {sorted(unknown)}: choose from {MODES}")
    if unknown := set(allocators) - set(ALLOCATORS):
        parser.error(f"unknown allocators {sorted(unknown)}: choose from {sorted(ALLOCATORS)}")
    cfg = preset(args.preset)
    with torch.device("meta"):
        params = sum(p.numel() for p in GPT(cfg).parameters())
    report = {"date": datetime.date.today().isoformat(), "preset": args.preset, "params": params,
              "model_bytes": params * 4, "world": args.world, "degree": args.sharding_degree,
              "command": " ".join(["python benchmarks/meta_init_memory.py", *sys.argv[1:]]),
              "git": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                    text=True).stdout.strip() or "unknown", "modes": {}, "notes": []}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model.safetensors")
        if "pretrained" in modes:
            write_checkpoint(cfg, path)
        for allocator in allocators:
            for mode in modes:
                key = f"{mode}/{allocator}"
                report["modes"][key] = run_mode(mode, args.world, args.sharding_degree, cfg, path, allocator)
                worst = max(r["peak_growth"] for r in report["modes"][key]) / report["model_bytes"]
                print(f"{key}: worst rank peak RSS growth {worst:.3f}x the full model", flush=True)
    runs = report["modes"]
    same = [a["digest"] == b["digest"] for al in allocators if f"plain/{al}" in runs and f"pretrained/{al}" in runs
            for a, b in zip(runs[f"plain/{al}"], runs[f"pretrained/{al}"], strict=True)]
    if same:
        report["notes"].append(f"load_pretrained shards equal the plain run's on every rank: {all(same)}")
    if not all(r["peak_reset"] for ranks in report["modes"].values() for r in ranks):
        report["notes"].append("VmHWM could not be reset: peaks include process start-up")
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"meta_init_memory_{report['date']}")
    with open(stem + ".json", "w") as f:
        json.dump(report, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(_markdown(report))
    print(json.dumps({m: [round(r["peak_growth"] / report["model_bytes"], 3) for r in rs]
                      for m, rs in report["modes"].items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
