"""The decentralized recipe, measured: unequal replicas on slow links, a node killed every minute, in one job.

The layout of the README's "Training across unreliable, slow-linked nodes", on this machine's scale: 3 emulated
nodes of 2, 1 and 1 ranks (``hsdp launch --elastic --nodes 3 --nproc-per-node 2,1,1``: replicas of shard degrees
2, 1 and 1), each node in a cpu group (``--node-cpus 0.6,0.6,0.3``: the third node at half the CPU of the
second), 100 Mbit/s links between nodes. hsdp's elastic replicas with Streaming DiLoCo (``hsdp.DiLoCo(every=H,
fragments=F, delay=tau, wire_dtype=torch.int8)``: int8 pseudo-gradients with error feedback) and batch weights
(each rank's batch sized so that the replicas' inner steps take as long, ``model.set_batch_weight`` its
sequence count, so a replica's pseudo-gradient counts by the samples it trained on: a sync waits for the slowest
replica, so a faster one trains on more samples instead of waiting). A byte-level GPT (``hsdp.models.gpt``) on
the standard library's sources (``hsdp.data.text``, the last 5 % of the tokens held out); at inner step k, rank s
of replica r trains on windows drawn by a generator seeded (seed, k, r, s).

Three launches, one invocation:

1. ``alone``: the same replicas, cpu groups, batches and model with no inter-node communication and no faults (a
   fixed mesh of degrees [2, 1, 1], DiLoCo whose phase is longer than the run: nothing crosses nodes). Its tokens/s
   (each replica's tokens per second over ``--alone-seconds``, summed) is compute utilization's denominator.
2. ``decentralized``: the recipe for ``--minutes`` from the first committed step, this driver SIGKILLing every rank
   of one node every ``--kill-every`` seconds (replicas 0, 1, 2, 0, ...), torchrun restarting it; hsdp's
   coordinator on node 0. Compute utilization = the tokens it kept per second of the window / the alone tokens/s.
   Kept: each replica's inner steps, less those a killed incarnation trained after its last landed sync (they
   never reached the others).
3. ``plain``: plain HSDP (the gradient all-reduced across replicas every step) on the same degrees and batches, no
   faults, unlimited links (loopback, no cpu groups), for as many steps as give the tokens the decentralized run
   kept: the held-out loss at equal tokens (the decentralized replicas' mean at the end; each replica evaluates
   the same fixed windows) and its inter-node bytes per step (hsdp's count).

Inter-node bytes per step of the decentralized run: hsdp's count (the replicate group's wire bytes: the
pseudo-gradients and the heals of the rejoining replicas) and the nodes' link counters (every frame: the
coordinator's control traffic, headers), both over the window's steps.

Writes ``benchmarks/results/decentralized_<date>.{json,md}`` (``--tag`` adds a suffix) with the commands.

    sudo python benchmarks/decentralized.py                          # 5 min, a kill every 60 s
    sudo python benchmarks/decentralized.py --minutes 1.5 --kill-every 40 --alone-seconds 40   # a smoke run
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import elastic_recovery as er

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = Path(__file__).resolve().parents[1]
MODES = ("alone", "decentralized", "plain")


# ---------------------------------------------------------------------------------------------------------
# One rank (under torchrun; each node its own job in the decentralized launch).
# ---------------------------------------------------------------------------------------------------------
def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def _sync(args: argparse.Namespace) -> object:
    import torch

    import hsdp

    if args.mode == "plain":
        return None
    if args.mode == "alone":  # a phase longer than any run: no sync, nothing crosses nodes
        return hsdp.DiLoCo(every=10**9, outer_lr=args.outer_lr, outer_momentum=args.outer_momentum)
    return hsdp.DiLoCo(every=args.every, outer_lr=args.outer_lr, outer_momentum=args.outer_momentum,
                       fragments=args.fragments, delay=args.delay,
                       wire_dtype=torch.int8 if args.wire == "int8" else None)


def _windows(tokens: object, block: int, count: int, generator: object) -> object:
    import torch

    starts = torch.randint(0, len(tokens) - block - 1, (count,), generator=generator)  # type: ignore[arg-type]
    return torch.stack([tokens[s:s + block + 1] for s in starts.tolist()]).long()  # type: ignore[index]


def _seed(seed: int, step: int, replica: int, rank: int) -> int:
    """The batch's seed of ``rank`` of ``replica`` at inner step ``step``: the same data in every launch."""
    return ((seed * 1_000_003 + step) * 64 + replica) * 64 + rank


def job(args: argparse.Namespace) -> None:
    import torch

    import hsdp
    from hsdp.data.text import as_tokens, default_corpus_bytes, split_tokens
    from hsdp.models.gpt import GPT, preset

    torch.set_num_threads(1)
    nproc, batches = _ints(args.nproc), _ints(args.batches)
    elastic = args.mode == "decentralized"
    mesh = hsdp.init_mesh(elastic=True) if elastic else hsdp.init_mesh(nproc)
    replica = int(os.environ["HSDP_REPLICA_ID"]) if elastic else mesh.replicate_rank
    rank, restart = mesh.shard_rank, int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    mine = batches[sum(nproc[:replica]) + rank]
    cfg = preset(args.preset)
    train, held = split_tokens(as_tokens(default_corpus_bytes(args.corpus_bytes)), 0.05)
    held_windows = _windows(held, cfg.block_size, args.eval_windows, torch.Generator().manual_seed(12345))
    torch.manual_seed(args.seed)
    model = hsdp.ShardedModel(GPT(cfg), mesh=mesh, replica_sync=_sync(args))
    opt = hsdp.ShardedOptimizer(model, torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95),
                                                         weight_decay=0.1))
    model.set_batch_weight(float(mine))
    log = open(Path(args.out) / f"r{replica}_s{rank}_i{restart}.jsonl", "a")  # noqa: SIM115
    step = model.last_step.step + 1 if elastic and model.last_step is not None else 0
    log.write(json.dumps({"joined": step, "t": time.time(), "restart": restart}) + "\n")
    stop_file, stop_at = Path(args.out) / "stop", args.steps - 1 if args.steps else None
    while stop_at is None or step <= stop_at:
        if stop_at is None and stop_file.exists():
            stop_at = int(stop_file.read_text())
        x = _windows(train, cfg.block_size, mine, torch.Generator().manual_seed(_seed(args.seed, step, replica, rank)))
        model.reset_comm_stats()
        _, loss = model(x[:, :-1], x[:, 1:])
        loss.backward()
        hsdp.clip_grad_norm_(model, 1.0)
        opt.step()
        opt.zero_grad()
        sent = sum(op["wire_bytes"] for op in model.comm_stats().get("replicate", {}).values())
        record = {"t": time.time(), "step": step, "tokens": mine * cfg.block_size, "loss": loss.item(),
                  "sent": sent}
        if elastic:
            last, sync = model.last_step, opt.last_sync
            record.update(step=last.step, committed=last.committed, replicas=list(last.replicas),
                          landed=list(sync.landed) if sync else [])
        log.write(json.dumps(record) + "\n")
        log.flush()
        step = record["step"] + 1
    if elastic:  # what the DiLoCo guide tells users: land the last phase's progress, every replica the global copy
        opt.sync_replicas()
    model.eval()
    with torch.no_grad():  # every rank of a replica the same windows: its shards' all-gathers, nothing across
        _, loss = model(held_windows[:, :-1], held_windows[:, 1:])
    log.write(json.dumps({"eval": loss.item(), "after": step - 1, "t": time.time()}) + "\n")
    log.close()


# ---------------------------------------------------------------------------------------------------------
# The driver.
# ---------------------------------------------------------------------------------------------------------
def _job_args(args: argparse.Namespace, mode: str, steps: int = 0) -> list[str]:
    return ["--job", "--mode", mode, "--ranks-per-node", args.nproc, "--batches", args.batches, "--preset", args.preset,
            "--every", str(args.every), "--fragments", str(args.fragments), "--delay", str(args.delay),
            "--wire", args.wire, "--outer-lr", str(args.outer_lr), "--outer-momentum", str(args.outer_momentum),
            "--lr", str(args.lr), "--seed", str(args.seed), "--eval-windows", str(args.eval_windows),
            "--corpus-bytes", str(args.corpus_bytes), *(["--steps", str(steps)] if steps else [])]


def _launch_flags(args: argparse.Namespace, mode: str, stats: Path) -> list[str]:
    nodes = ["--nodes", str(len(_ints(args.nproc))), "--nproc-per-node", args.nproc]
    if mode == "plain":  # unlimited links: loopback, no cpu groups
        return [*nodes, "--no-emulation"]
    shaped = [*nodes, "--node-cpus", args.node_cpus, "--inter-node-bandwidth", args.bandwidth,
              "--stats-json", str(stats)]
    if mode == "decentralized":
        return ["--elastic", "--max-restarts", str(args.max_restarts), *shaped]
    return shaped


def _read(out: Path) -> dict[tuple[int, int], list[list[dict]]]:
    """(replica, rank) -> each incarnation's records, in restart order."""
    logs: dict[tuple[int, int], list[list[dict]]] = {}
    for path in sorted(out.glob("r*_s*_i*.jsonl"), key=lambda p: int(p.stem.rsplit("_i", 1)[1])):
        replica, rank = int(path.name[1:].split("_")[0]), int(path.stem.split("_s")[1].split("_")[0])
        lines = [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]
        logs.setdefault((replica, rank), []).append(lines)
    return logs


def _steps(lines: list[dict]) -> list[dict]:
    return [r for r in lines if "step" in r]


def _leaders(out: Path) -> dict[int, list[dict]]:
    """Each replica's rank-0 step records over all its incarnations."""
    return {replica: [r for lines in inc for r in _steps(lines)] for (replica, rank), inc in _read(out).items()
            if rank == 0}


def _stop_step(newest: int, args: argparse.Namespace, mode: str) -> int:
    """A step 20 past ``newest`` where no fragment's sync is in flight (between one landing and the next start)."""
    if mode != "decentralized":
        return newest + 20
    period = args.every // args.fragments
    step = newest + 20
    while (step + 1) % period != min(period - 1, args.delay + 1):
        step += 1
    return step


def _all_three(out: Path, after: float, replicas: int) -> bool:
    return any(r.get("committed") and len(r["replicas"]) == replicas and r["t"] > after
               for r in _leaders(out).get(0, []))


def launch(args: argparse.Namespace, mode: str, tmp: Path, steps: int = 0) -> dict:
    """One launch of ``mode``: its logs, the kills, the window's start, its link counters and the command."""
    out, marker = tmp / mode, uuid.uuid4().hex
    out.mkdir()
    stats, log = out / "links.json", out / "launch.log"
    command = [sys.executable, "-m", "hsdp", "launch", *_launch_flags(args, mode, stats), "--",
               str(Path(__file__).resolve()), *_job_args(args, mode, steps), "--out", str(out)]
    env = {**os.environ, er.MARKER_ENV: marker, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    replicas = len(_ints(args.nproc))
    window = args.minutes * 60 if mode == "decentralized" else args.alone_seconds
    kills, t0 = [], None
    print(f"[bench] {mode}: launching", flush=True)
    with open(log, "w") as sink:
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT)
        try:
            if mode != "plain":
                t0 = _window_start(out, proc, mode, replicas)
                k = 1
                while mode == "decentralized" and k * args.kill_every <= window - args.margin:
                    time.sleep(max(0.0, t0 + k * args.kill_every - time.time()))
                    kills.append(_kill(marker, (k - 1) % replicas, t0))
                    k += 1
                time.sleep(max(0.0, t0 + window - time.time()))
                if mode == "decentralized":
                    er._wait_for("a step of every replica", lambda: _all_three(out, t0 + window - 1, replicas),
                                 300, proc)
                newest = max(r["step"] for rs in _leaders(out).values() for r in rs)
                (out / "stop.tmp").write_text(str(_stop_step(newest, args, mode)))
                (out / "stop.tmp").replace(out / "stop")  # atomic: a rank never reads it half written
            code = proc.wait(timeout=1800)
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=60)
    if code != 0:
        print(log.read_text()[-4000:], file=sys.stderr)
        raise SystemExit(f"the {mode} launch exited with status {code}")
    shown = ["hsdp", "launch", *_launch_flags(args, mode, Path("links.json")), "--", "benchmarks/decentralized.py",
             *_job_args(args, mode, steps), "--out", "RUN_DIR"]
    return {"logs": _read(out), "kills": kills, "t0": t0, "window": window, "command": shlex.join(shown),
            "links": json.loads(stats.read_text()) if stats.exists() else None}


def _window_start(out: Path, proc: subprocess.Popen, mode: str, replicas: int) -> float:
    """When every replica has trained a step (decentralized: committed one together)."""
    def ready() -> bool:
        leaders = _leaders(out)
        if mode == "decentralized":
            return _all_three(out, 0.0, replicas)
        return len(leaders) == replicas and all(leaders.values())

    er._wait_for("every replica's first step", ready, 600, proc)
    return time.time()


def _kill(marker: str, victim: int, t0: float) -> dict:
    pids = er._ranks_of(victim, marker)
    at = time.time()
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    print(f"[bench] decentralized: killed replica {victim} ({len(pids)} ranks) at +{at - t0:.1f} s", flush=True)
    return {"t": at, "victim": victim, "ranks_killed": len(pids)}


def _kept_tokens(run: dict, window_only: bool = True) -> int:
    """Tokens of the inner steps that reached the others (of the window's, or of the whole run's): an
    incarnation that died (a later one exists) loses its steps after its last landed sync."""
    t0, end, kept = run["t0"], run["t0"] + run["window"], 0
    for incarnations in run["logs"].values():
        for i, lines in enumerate(incarnations):
            steps = _steps(lines)
            died = i + 1 < len(incarnations)
            last_landed = max((r["step"] for r in steps if r.get("landed")), default=-1)
            kept += sum(r["tokens"] for r in steps if (not window_only or t0 <= r["t"] <= end)
                        and (not died or r["step"] <= last_landed))
    return kept


def _alone_rate(run: dict) -> float:
    """Tokens per second of the replicas on their own: each replica's tokens over the window, summed."""
    t0, end = run["t0"], run["t0"] + run["window"]
    return sum(r["tokens"] for lines in run["logs"].values() for inc in lines for r in _steps(inc)
               if t0 <= r["t"] <= end) / run["window"]


def _node_bytes_per_step(run: dict, nproc: list[int], in_window: bool) -> float:
    """hsdp's replicate-group wire bytes per step of the busiest node (its ranks summed; the median node's
    would hide the one that heals the others)."""
    t0 = run["t0"] or 0.0
    end = t0 + run["window"] if in_window else math.inf
    per_node = []
    for replica in range(len(nproc)):
        steps = {r["step"] for inc in run["logs"].get((replica, 0), []) for r in _steps(inc)
                 if not in_window or t0 <= r["t"] <= end}
        sent = sum(r["sent"] for rank in range(nproc[replica]) for inc in run["logs"].get((replica, rank), [])
                   for r in _steps(inc) if not in_window or t0 <= r["t"] <= end)
        per_node.append(sent / max(1, len(steps)))
    return max(per_node)


def _final_eval(run: dict) -> list[float]:
    """Each replica's held-out loss at the end (its rank 0's, the last incarnation)."""
    return [incs[-1][-1]["eval"] for (replica, rank), incs in sorted(run["logs"].items())
            if rank == 0 and "eval" in incs[-1][-1]]


def measure(alone: dict, dec: dict, plain: dict, args: argparse.Namespace, plain_steps: int) -> dict:
    nproc = _ints(args.nproc)
    kept, trained = _kept_tokens(dec), _kept_tokens(dec, window_only=False)
    alone_rate = _alone_rate(alone)
    dec_eval, plain_eval = _final_eval(dec), _final_eval(plain)
    steps_in_window = _leader_steps(dec, in_window=True)
    link = None
    if dec["links"]:
        link = max(n["sent_bytes"] for n in dec["links"]["nodes"]) / max(1, _leader_steps(dec))
    plain_bytes = _node_bytes_per_step(plain, nproc, in_window=False)
    dec_bytes = _node_bytes_per_step(dec, nproc, in_window=True)
    return {
        "alone_tokens_per_s": round(alone_rate, 1), "kept_tokens": kept, "trained_tokens": trained,
        "decentralized_tokens_per_s": round(kept / dec["window"], 1),
        "compute_utilization": round(kept / dec["window"] / alone_rate, 4),
        "kills": [{"victim": k["victim"], "ranks_killed": k["ranks_killed"], "at_s": round(k["t"] - dec["t0"], 1)}
                  for k in dec["kills"]],
        "inner_steps_in_window": steps_in_window, "plain_steps": plain_steps,
        "held_out_decentralized": dec_eval, "held_out_decentralized_mean": statistics.fmean(dec_eval),
        "held_out_plain": plain_eval[0],
        "held_out_gap": round(statistics.fmean(dec_eval) / plain_eval[0] - 1, 4),
        "plain_bytes_per_step_node": round(plain_bytes), "decentralized_bytes_per_step_node": round(dec_bytes),
        "decentralized_link_bytes_per_step_node": None if link is None else round(link),
        "bytes_ratio": round(plain_bytes / max(1.0, dec_bytes), 1),
        "link_bytes_ratio": None if link is None else round(plain_bytes / link, 1),
    }


def _leader_steps(run: dict, in_window: bool = False) -> int:
    """Replica 0's distinct steps (of the window's, or of the whole run's)."""
    t0, end = run["t0"], run["t0"] + run["window"]
    return len({r["step"] for inc in run["logs"][(0, 0)] for r in _steps(inc) if not in_window or t0 <= r["t"] <= end})


def _table(m: dict) -> list[str]:
    util = "yes" if m["compute_utilization"] >= 0.90 else "no"
    gap = "yes" if abs(m["held_out_gap"]) <= 0.03 else "no"
    ratio = "yes" if m["bytes_ratio"] >= 100 else "no"
    link = m["decentralized_link_bytes_per_step_node"]
    return [
        "| | value | target |", "|---|---|---|",
        f"| tokens/s, the replicas alone (no inter-node communication, no faults) | {m['alone_tokens_per_s']} | |",
        f"| tokens/s kept, decentralized with the kills | {m['decentralized_tokens_per_s']} | |",
        f"| compute utilization | {m['compute_utilization']:.3f} | >= 0.90: {util} |",
        f"| held-out loss at equal tokens ({m['trained_tokens']:,}): decentralized (replicas' mean) | "
        f"{m['held_out_decentralized_mean']:.4f} | |",
        f"| held-out loss, plain HSDP on unlimited links, no faults ({m['plain_steps']} steps) | "
        f"{m['held_out_plain']:.4f} | |",
        f"| gap | {100 * m['held_out_gap']:+.2f} % | within 3 %: {gap} |",
        f"| inter-node bytes per step, busiest node: plain HSDP (hsdp's count) | "
        f"{m['plain_bytes_per_step_node']:,} | |",
        f"| ... decentralized, hsdp's count (pseudo-gradients, heals) | {m['decentralized_bytes_per_step_node']:,} | |",
        f"| ... decentralized, link counters (every frame: control traffic too) | "
        f"{'n/a' if link is None else f'{link:,}'} | |",
        f"| plain / decentralized bytes (hsdp's count; link counters) | {m['bytes_ratio']}x; "
        f"{m['link_bytes_ratio']}x | >= 100x: {ratio} |",
    ]


def drive(args: argparse.Namespace) -> None:
    nproc, batches = _ints(args.nproc), _ints(args.batches)
    if len(batches) != sum(nproc):
        raise SystemExit(f"--batches gives {len(batches)} counts for {sum(nproc)} ranks "
                         f"(--ranks-per-node {args.nproc})")
    with tempfile.TemporaryDirectory() as tmp:
        where = args.keep or Path(tmp)
        where.mkdir(parents=True, exist_ok=True)
        alone = launch(args, "alone", where)
        dec = launch(args, "decentralized", where)
        tokens_per_step = sum(batches) * _block(args)
        plain_steps = max(1, round(_kept_tokens(dec, window_only=False) / tokens_per_step))
        plain = launch(args, "plain", where, steps=plain_steps)
    m = measure(alone, dec, plain, args, plain_steps)
    stem = f"decentralized_{datetime.date.today().isoformat()}{'_' + args.tag if args.tag else ''}"
    driver = shlex.join(["sudo", "python", "benchmarks/decentralized.py", *_shown_argv(sys.argv[1:])])
    result = {"date": datetime.date.today().isoformat(), "args": {k: v for k, v in vars(args).items() if k != "keep"},
              "measured": m, "commands": {"driver": driver, "alone": alone["command"],
                                          "decentralized": dec["command"], "plain": plain["command"]}}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{stem}.json").write_text(json.dumps(result, indent=1))
    md = [f"# Decentralized training: replicas of {args.nproc} ranks, {args.bandwidth} links, a kill every "
          f"{args.kill_every:g} s ({datetime.date.today().isoformat()})", "",
          f"GPT `{args.preset}`, byte-level, stdlib sources; per-rank batches {args.batches} sequences (batch "
          f"weights); node CPUs {args.node_cpus}; elastic replicas, Streaming DiLoCo H = {args.every}, F = "
          f"{args.fragments}, tau = {args.delay}, {args.wire} wire, outer lr {args.outer_lr}, momentum "
          f"{args.outer_momentum}; inner AdamW lr {args.lr}, clip 1.0. Window {args.minutes:g} min from the first "
          f"step all replicas committed together. Kills: "
          + ", ".join(f"replica {k['victim']} at +{k['at_s']} s" for k in m["kills"]) + ".", "",
          "```", driver, alone["command"], dec["command"], plain["command"], "```", "", *_table(m), "",
          f"Held-out loss per replica at the end: {m['held_out_decentralized']}."]
    (RESULTS / f"{stem}.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


def _shown_argv(argv: list[str]) -> list[str]:
    """The driver's arguments as the results show them: without ``--keep`` (a folder of this machine)."""
    shown, skip = [], False
    for part in argv:
        if skip or part.startswith("--keep="):
            skip = False
            continue
        skip = part == "--keep"
        if not skip:
            shown.append(part)
    return shown


def _block(args: argparse.Namespace) -> int:
    from hsdp.models.gpt import preset

    return preset(args.preset).block_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--job", action="store_true", help="run one rank (what the launches start)")
    parser.add_argument("--mode", choices=MODES, default="decentralized", help="--job: which launch")
    parser.add_argument("--out", type=Path, help="--job: the run's folder")
    parser.add_argument("--steps", type=int, default=0, help="--job: a fixed step count (plain); 0: the stop file")
    parser.add_argument("--ranks-per-node", dest="nproc", default="2,1,1", help="ranks per node (default: 2,1,1)")
    parser.add_argument("--batches", default="4,4,30,8",
                        help="sequences per rank per step, node-major, so that the replicas' steps take as long "
                             "with the syncs' cost included (default: 4,4,30,8: with 4,4,24,6, balanced alone, "
                             "nodes 1 and 2 waited ~0.2 s for node 0 at every fragment's start)")
    parser.add_argument("--node-cpus", default="0.6,0.6,0.3", help="each node's CPU budget (default: 0.6,0.6,0.3)")
    parser.add_argument("--bandwidth", default="100mbit", help="each node's link (default: 100mbit)")
    parser.add_argument("--preset", default="tiny", help="a GPT preset of hsdp.models.gpt (default: tiny)")
    parser.add_argument("--every", type=int, default=40, help="DiLoCo's H (default: 40)")
    parser.add_argument("--fragments", type=int, default=4, help="Streaming DiLoCo's F (default: 4)")
    parser.add_argument("--delay", type=int, default=2, help="Streaming DiLoCo's tau (default: 2)")
    parser.add_argument("--wire", choices=("int8", "fp32"), default="int8", help="pseudo-gradients (default: int8)")
    parser.add_argument("--outer-lr", type=float, default=0.7, help="outer SGD lr (default: 0.7)")
    parser.add_argument("--outer-momentum", type=float, default=0.9,
                        help="outer Nesterov momentum (default: 0.9, DiLoCo's; with 0.0 and lr 1.0 the held-out gap "
                             "was +12 %%, with 0.9 and lr 0.7 +1.0 %%)")
    parser.add_argument("--lr", type=float, default=1e-3, help="inner AdamW lr (default: 1e-3)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-windows", type=int, default=64, help="held-out windows (default: 64)")
    parser.add_argument("--corpus-bytes", type=int, default=2_000_000)
    parser.add_argument("--minutes", type=float, default=5.0, help="the decentralized window (default: 5)")
    parser.add_argument("--kill-every", type=float, default=60.0, help="seconds between kills (default: 60)")
    parser.add_argument("--margin", type=float, default=25.0, help="no kill in the window's last seconds")
    parser.add_argument("--alone-seconds", type=float, default=90.0, help="the alone run's window (default: 90)")
    parser.add_argument("--max-restarts", type=int, default=20)
    parser.add_argument("--keep", type=Path, help="keep the runs' folders under this one")
    parser.add_argument("--tag", default="", help="suffix of the result files' names")
    args = parser.parse_args()
    if args.job:
        job(args)
    else:
        drive(args)


if __name__ == "__main__":
    main()
