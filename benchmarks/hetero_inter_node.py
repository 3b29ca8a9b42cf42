"""Inter-node bytes of replicas of different shard degrees, on emulated links: against the all-reduce floor.

Two emulated nodes of 2 and 1 ranks (``hsdp launch --nodes 2 --nproc-per-node 2,1``): ``hsdp.init_mesh()``
defaults to one replica per node, sharding degrees ``[2, 1]``, whose dim-0 chunks differ, so the gradient is
reduced in pieces over the ranks holding them (``hsdp/engine/runtime/piece_plan.py``). Each step trains a GPT
preset (AdamW, ``hsdp.clip_grad_norm_``). Per step and node, the bytes each node's link sent (frames, TCP/IP
headers included) are the difference between a long and a short run over their step difference (the
wrap-time broadcasts and the rendezvous cancel out), against the floor ``2(R-1)/R x P x 4`` (R = 2
replicas, P trainable parameters, fp32); hsdp's own count (``model.comm_stats()``, the node's ranks summed)
is reported too. Writes ``benchmarks/results/hetero_inter_node_<date>.{json,md}`` with the commands.

    sudo python benchmarks/hetero_inter_node.py            # the driver: two launches, the table
    python benchmarks/hetero_inter_node.py --job --steps 6  # one rank's job (what the driver launches)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
NPROC = "2,1"


def job(steps: int, preset_name: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    import hsdp
    from hsdp.models.gpt import GPT, preset

    mesh = hsdp.init_mesh()  # nodes of different sizes: one replica per node
    cfg = preset(preset_name)
    torch.manual_seed(0)
    model = hsdp.ShardedModel(GPT(cfg), mesh=mesh)
    opt = hsdp.ShardedOptimizer(model, torch.optim.AdamW(model.parameters(), lr=3e-4))
    n_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    sent = 0.0
    for step in range(steps):
        g = torch.Generator().manual_seed(1000 * step + mesh.data_parallel_rank)
        ids = torch.randint(0, cfg.vocab_size, (2, cfg.block_size + 1), generator=g)
        model.reset_comm_stats()
        _, loss = model(ids[:, :-1], ids[:, 1:])
        loss.backward()
        hsdp.clip_grad_norm_(model, 1.0)
        opt.step()
        opt.zero_grad()
        if step > 0:  # every later step sends the same bytes
            sent += sum(op["wire_bytes"] for op in model.comm_stats().get("replicate", {}).values())
    per_rank = torch.tensor([sent / max(1, steps - 1)], dtype=torch.float64)
    everyone = [torch.zeros(1, dtype=torch.float64) for _ in range(mesh.world_size)]
    dist.all_gather(everyone, per_rank)
    if mesh.rank == 0:
        Path(out).write_text(json.dumps({"mesh": repr(mesh), "degrees": list(mesh.replicas.degrees),
                                         "params": n_params, "hsdp_bytes_per_rank": [t.item() for t in everyone],
                                         "loss": loss.item()}))


def _launch(steps: int, args: argparse.Namespace, tmp: Path) -> tuple[list[str], dict, dict]:
    stats, facts = tmp / f"links_{steps}.json", tmp / f"hsdp_{steps}.json"
    command = [str(Path(sys.executable).parent / "hsdp"), "launch", "--nodes", "2", "--nproc-per-node", NPROC,
               "--inter-node-bandwidth", args.bandwidth, "--require-emulation", "--stats-json", str(stats), "--",
               __file__, "--job", "--steps", str(steps), "--preset", args.preset, "--out", str(facts)]
    subprocess.run(command, check=True)
    # As a person would type it: no interpreter or temporary paths.
    shown = ["hsdp", *command[1:command.index("--stats-json") + 1], f"links_{steps}.json", "--",
             "benchmarks/hetero_inter_node.py", *command[command.index("--job"):-1], f"hsdp_{steps}.json"]
    return shown, json.loads(stats.read_text()), json.loads(facts.read_text())


def drive(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        long_cmd, long_links, facts = _launch(args.steps, args, Path(tmp))
        short_cmd, short_links, _ = _launch(2, args, Path(tmp))
    r = len(facts["degrees"])
    floor = 2 * (r - 1) / r * facts["params"] * 4
    starts = [sum(facts["degrees"][:q]) for q in range(r)]
    hsdp_node = [sum(facts["hsdp_bytes_per_rank"][s: s + d]) for s, d in zip(starts, facts["degrees"], strict=True)]
    rows = []
    for node, (a, b) in enumerate(zip(long_links["nodes"], short_links["nodes"], strict=True)):
        per_step = (a["sent_bytes"] - b["sent_bytes"]) / (args.steps - 2)
        rows.append({"node": node, "ranks": facts["degrees"][node], "sent_long": a["sent_bytes"],
                     "sent_short": b["sent_bytes"], "per_step": per_step, "ratio": per_step / floor,
                     "hsdp_per_step": hsdp_node[node], "hsdp_ratio": hsdp_node[node] / floor})
    result = {"date": datetime.date.today().isoformat(), "mesh": facts["mesh"], "preset": args.preset,
              "params": facts["params"], "floor_bytes": floor, "bandwidth": args.bandwidth, "nodes": rows,
              "commands": [shlex.join(long_cmd), shlex.join(short_cmd)]}
    _write(result, args)


def _write(result: dict, args: argparse.Namespace) -> None:
    RESULTS.mkdir(exist_ok=True)
    stem = RESULTS / f"hetero_inter_node_{result['date']}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [f"# Inter-node bytes of replicas of different shard degrees ({NPROC} ranks on 2 emulated nodes)", "",
             f"{result['mesh']}: GPT `{result['preset']}`, {result['params'] / 1e6:.2f}M trainable parameters "
             f"(fp32), AdamW, `hsdp.clip_grad_norm_`, links at {result['bandwidth']}. Per step = (sent in "
             f"{args.steps} steps - sent in 2 steps) / {args.steps - 2}, from each node's link counters (frames, "
             f"TCP/IP headers included).", "", "```", "sudo python benchmarks/hetero_inter_node.py "
             f"--steps {args.steps} --preset {args.preset} --bandwidth {args.bandwidth}", *result["commands"], "```",
             "", f"Floor 2(R-1)/R x P x 4 = {result['floor_bytes'] / 1e6:.3f} MB per node per step.", "",
             "| node | ranks | sent per step (B) | per step / floor | hsdp's count (B) | hsdp's count / floor |",
             "|---|---|---|---|---|---|"]
    for row in result["nodes"]:
        lines.append(f"| {row['node']} | {row['ranks']} | {row['per_step']:.0f} | {row['ratio']:.4f} | "
                     f"{row['hsdp_per_step']:.0f} | {row['hsdp_ratio']:.4f} |")
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", action="store_true", help="run one rank's training job (under torchrun)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--preset", default="small", help="a GPT preset of hsdp.models.gpt (default: small)")
    parser.add_argument("--bandwidth", default="1gbit", help="each node link's rate (default: 1gbit)")
    parser.add_argument("--out", default=os.devnull, help="--job: where rank 0 writes hsdp's byte counts")
    args = parser.parse_args()
    if args.job:
        job(args.steps, args.preset, args.out)
    else:
        drive(args)


if __name__ == "__main__":
    main()
