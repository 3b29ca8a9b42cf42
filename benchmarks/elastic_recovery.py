"""Elastic replicas under repeated faults: committed steps against a failure-free run, recovery and rejoin times.

Each system (``--systems``, default ``hsdp,torchft``) runs the same elastic job twice (``hsdp launch --elastic
--nodes 3 --nproc-per-node 2``: 3 emulated nodes of 2 ranks, each its own torchrun job with ``--max-restarts``, a
coordinator on node 0; each node in a cpu group of ``--node-cpus`` CPUs: on one machine a restarting node would
otherwise slow the others), a GPT preset of ``hsdp.models.gpt`` trained with AdamW on the same batches (a seed per
step, replica and rank) for the same wall time, counted from each run's first committed step:

* failure-free;
* with a fault every ``--kill-every`` seconds: this driver SIGKILLs every rank of one node (replica 0, 1, 2, 0,
  ... in turn), whose torchrun restarts it; it rejoins and is healed from a live replica. No kill falls in
  the last ``--margin`` seconds, so that every replica is back before the run ends.

The systems: ``hsdp`` (``hsdp.init_mesh(elastic=True)``, ``ShardedModel``, ``ShardedOptimizer``, its coordinator
and default ``ElasticPolicy``) and ``torchft`` (torchft 0.2.0, ``pip install -e .[peers]``: FSDP2 inside each
node, ``torchft.Manager`` with a ``ProcessGroupGloo`` across them, its lighthouse on node 0; the same launch,
links, cpu groups, kill schedule and measurement; the timeouts set equal to hsdp's where they correspond; see
``elastic_recovery_torchft.py``, whose docstring lists them).

Measured from the replicas' own step logs (each replica's rank 0 appends one line per step: time, step,
committed, the quorum's replicas, torchrun's restart count):

* committed steps of the faulty run / of the failure-free one, within the window (target >= 90 %), and the
  committed steps per second of each outside the faults (equal when the machine was equally busy);
* recovery: the kill -> the survivors' first committed step without the killed replica; rejoin: the kill ->
  the killed replica's first committed step (torchrun's restart, interpreter and torch start-up, admission and
  healing included); medians over the kills. hsdp's job also logs when its new incarnation started, imported,
  built its mesh, its model and its optimizer (admitted and healed): the rejoin part by part.

After the window the driver waits until all three replicas commit together, then asks every replica to stop
at a step 20 ahead (a file they check each step), so all of them end at the same step and the launch exits 0.
Writes ``benchmarks/results/elastic_recovery_<date>.{json,md}`` (one table, a column per system) with the
commands.

    sudo python benchmarks/elastic_recovery.py                          # 5 min per run, a kill every 60 s
    sudo python benchmarks/elastic_recovery.py --minutes 2 --kill-every 30 --systems hsdp
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import elastic_recovery_torchft as torchft_side

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = Path(__file__).resolve().parents[1]
NODES, NPROC = 3, 2
MARKER_ENV = "ELASTIC_BENCH_MARKER"  # tells this run's ranks from any other process
SYSTEMS = ("hsdp", "torchft")


def seed(step: int, replica: int, rank: int) -> int:
    """The seed of the batch of ``rank`` of ``replica`` at ``step``: the same data for every system."""
    return 1000 * step + NPROC * replica + rank


# ---------------------------------------------------------------------------------------------------------
# One rank of hsdp's job (under torchrun, one job per node); torchft's is in elastic_recovery_torchft.py.
# ---------------------------------------------------------------------------------------------------------
def job(preset_name: str, out: Path) -> None:
    phases = {"started": _process_start()}  # when this incarnation reached each point: the rejoin's parts
    import torch
    import torch._dynamo  # DTensor's constructor imports it on first use: counted as an import
    import torch.distributed.tensor

    import hsdp
    from hsdp.models.gpt import GPT, preset

    phases["imported"] = time.time()
    torch.set_num_threads(1)
    mesh = hsdp.init_mesh(elastic=True)
    phases["mesh"] = time.time()
    replica, restart = int(os.environ["HSDP_REPLICA_ID"]), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    cfg = preset(preset_name)
    torch.manual_seed(0)
    model = hsdp.ShardedModel(GPT(cfg), mesh=mesh)
    phases["model"] = time.time()
    opt = hsdp.ShardedOptimizer(model, torch.optim.AdamW(model.parameters(), lr=3e-4))
    phases["admitted"] = time.time()  # the coordinator admitted it and a live replica healed it
    log = open(out / f"steps_r{replica}.jsonl", "a") if mesh.shard_rank == 0 else None  # noqa: SIM115
    if log is not None:
        log.write(json.dumps({"phases": phases, "restart": restart}) + "\n")
    step = model.last_step.step + 1 if model.last_step is not None else 0
    stop_file, stop_at = out / "stop", None
    while stop_at is None or step <= stop_at:
        if stop_at is None and stop_file.exists():
            stop_at = int(stop_file.read_text())
        g = torch.Generator().manual_seed(seed(step, replica, mesh.shard_rank))
        ids = torch.randint(0, cfg.vocab_size, (2, cfg.block_size + 1), generator=g)
        _, loss = model(ids[:, :-1], ids[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        last = model.last_step
        if log is not None:
            log.write(json.dumps({"t": time.time(), "step": last.step, "committed": last.committed,
                                  "replicas": list(last.replicas), "restart": restart}) + "\n")
            log.flush()
        step = last.step + 1


def _process_start() -> float:
    """This process's start, wall-clock seconds (Linux: its start tick after boot, placed against the clock by
    /proc/uptime's hundredths, not /proc/stat's whole-second boot time, which put it up to 1 s off)."""
    with open("/proc/self/stat") as f:
        ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as f:
        uptime = float(f.read().split()[0])
    return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")


# ---------------------------------------------------------------------------------------------------------
# The driver.
# ---------------------------------------------------------------------------------------------------------
def _records(out: Path) -> dict[int, list[dict]]:
    """Each replica's step records (``phases``: an incarnation's start-up, kept apart under ``"phases"``)."""
    records: dict[int, list[dict]] = {}
    for replica in range(NODES):
        path = out / f"steps_r{replica}.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        records[replica] = [json.loads(line) for line in lines if line.endswith("}")]  # a line being written
    return records


def _steps(records: list[dict]) -> list[dict]:
    return [r for r in records if "step" in r]


def _ranks_of(replica: int, marker: str) -> list[int]:
    """The running ranks of node ``replica`` of this run (torchrun's workers: they have a restart count)."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        except OSError:
            continue
        if (env.get(MARKER_ENV.encode()) == marker.encode() and b"TORCHELASTIC_RESTART_COUNT" in env
                and env.get(b"HSDP_REPLICA_ID") == str(replica).encode()):
            found.append(int(entry))
    return found


def _wait_for(what: str, predicate: Callable[[], bool], timeout_s: float, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if proc.poll() is not None:
            raise RuntimeError(f"the launch ended (status {proc.returncode}) before {what}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"no {what} within {timeout_s:.0f} s")
        time.sleep(0.2)


def _all_together(out: Path, after: float) -> bool:
    return any(r["committed"] and len(r["replicas"]) == NODES and r["t"] > after
               for r in _steps(_records(out).get(0, [])))


def _job_args(system: str, port: int | None) -> list[str]:
    return [] if system == "hsdp" else ["--system", system, "--lighthouse-port", str(port)]


def _launch_command(args: argparse.Namespace, out: Path, stats: Path, system: str = "hsdp",
                    port: int | None = None) -> list[str]:
    cpus = ["--node-cpus", args.node_cpus] if args.node_cpus else []
    return [sys.executable, "-m", "hsdp", "launch", "--elastic", "--nodes", str(NODES), "--nproc-per-node",
            str(NPROC), "--max-restarts", str(args.max_restarts), "--inter-node-bandwidth", args.bandwidth, *cpus,
            "--stats-json", str(stats), "--", str(Path(__file__).resolve()), "--job", "--preset", args.preset,
            "--out", str(out), *_job_args(system, port)]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_once(args: argparse.Namespace, kills: bool, tmp: Path, system: str = "hsdp") -> dict:
    """One launch of ``system``: its records, kill times and victims, the window start, the exit status and
    emulation."""
    out, marker = tmp / f"{system}_{'faulty' if kills else 'clean'}", uuid.uuid4().hex
    out.mkdir()
    stats, log = out / "links.json", out / "launch.log"
    env = {**os.environ, MARKER_ENV: marker,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    window = args.minutes * 60
    port = _free_port() if system == "torchft" else None  # the lighthouse's (free in node 0's namespace too)
    lighthouse = None
    with open(log, "w") as sink, open(out / "lighthouse.log", "w") as lighthouse_sink:
        proc = subprocess.Popen(_launch_command(args, out, stats, system, port), cwd=ROOT, env=env, stdout=sink,
                                stderr=subprocess.STDOUT)
        try:
            if port is not None:
                lighthouse = torchft_side.start_lighthouse(MARKER_ENV, marker, port, lighthouse_sink,
                                                           alive=lambda: proc.poll() is None)
            _wait_for("first committed step", lambda: any(r["committed"] for r in _steps(_records(out)[0])), 600, proc)
            t0 = min(r["t"] for r in _steps(_records(out)[0]) if r["committed"])
            events = []
            k = 1
            while kills and k * args.kill_every <= window - args.margin:
                time.sleep(max(0.0, t0 + k * args.kill_every - time.time()))
                victim = (k - 1) % NODES
                pids = _ranks_of(victim, marker)
                at = time.time()
                for pid in pids:
                    os.kill(pid, signal.SIGKILL)
                events.append({"t": at, "victim": victim, "ranks_killed": len(pids)})
                print(f"[bench] {system} {'faulty' if kills else 'clean'}: killed replica {victim} ({len(pids)} "
                      f"ranks) at +{at - t0:.1f} s", flush=True)
                k += 1
            time.sleep(max(0.0, t0 + window - time.time()))
            _wait_for("step of all three replicas", lambda: _all_together(out, t0 + window - 1), 300, proc)
            (out / "stop.tmp").write_text(str(max(r["step"] for r in _steps(_records(out)[0])) + 20))
            (out / "stop.tmp").replace(out / "stop")  # atomic: a rank never reads it half written
            code = proc.wait(timeout=600)
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=60)
            if lighthouse is not None and lighthouse.poll() is None:
                lighthouse.terminate()
                lighthouse.wait(timeout=30)
    return {"records": _records(out), "kills": events, "t0": t0, "window": window, "code": code,
            "emulated": json.loads(stats.read_text())["emulated"] if stats.exists() else None,
            "log_tail": log.read_text()[-3000:]}


def _committed_in_window(run: dict) -> int:
    steps = {r["step"] for rs in run["records"].values() for r in _steps(rs)
             if r["committed"] and run["t0"] <= r["t"] <= run["t0"] + run["window"]}
    return len(steps)


def _recoveries(run: dict) -> tuple[list[float], list[float]]:
    recovery, rejoin = [], []
    for kill in run["kills"]:
        t, victim = kill["t"], kill["victim"]
        # Without the victim: a step whose votes were all in before the kill may still commit just after it.
        survivors = [r["t"] for q, rs in run["records"].items() if q != victim for r in _steps(rs)
                     if r["committed"] and r["t"] > t and victim not in r["replicas"]]
        back = _back(run["records"][victim], t)
        if survivors:
            recovery.append(min(survivors) - t)
        if back:
            rejoin.append(back[0]["t"] - t)
    return recovery, rejoin


def _back(records: list[dict], kill_t: float) -> list[dict]:
    """The victim's committed steps after the kill at ``kill_t``, by its later incarnations (a higher restart)."""
    steps = _steps(records)
    restart_before = max((r["restart"] for r in steps if r["t"] <= kill_t), default=-1)
    return [r for r in steps if r["committed"] and r["t"] > kill_t and r["restart"] > restart_before]


# The rejoin's parts, each the time from the previous point of the killed node's next incarnation (the kill first).
REJOIN_PARTS = (("restart", "started"), ("imports", "imported"), ("mesh and admission wait", "mesh"),
                ("model", "model"), ("optimizer and heal", "admitted"), ("first committed step", "step"))


def _rejoin_parts(run: dict) -> dict[str, float]:
    """The median seconds of each part of the rejoins (:data:`REJOIN_PARTS`), over the kills whose restart logged
    its start-up (hsdp's job does; an empty dict otherwise)."""
    parts: dict[str, list[float]] = {name: [] for name, _ in REJOIN_PARTS}
    for kill in run["kills"]:
        records, t = run["records"][kill["victim"]], kill["t"]
        back = _back(records, t)
        phases = next((r["phases"] for r in records if "phases" in r and back and r["restart"] == back[0]["restart"]),
                      None)
        if phases is None:
            continue
        points = [t] + [phases[key] if key != "step" else back[0]["t"] for _, key in REJOIN_PARTS]
        for (name, _), a, b in zip(REJOIN_PARTS, points, points[1:]):
            parts[name].append(b - a)
    return {name: round(statistics.median(v), 2) for name, v in parts.items() if v}


def _steady_rate(run: dict, busy: list[tuple[float, float]]) -> float:
    """Committed steps per second of the window outside the ``busy`` intervals (kill -> rejoin + 2 s)."""
    t0, end = run["t0"], run["t0"] + run["window"]
    outside = [t for t in {r["step"]: r["t"] for rs in run["records"].values() for r in _steps(rs)
                           if r["committed"]}.values()
               if t0 <= t <= end and not any(a <= t <= b for a, b in busy)]
    span = run["window"] - sum(min(b, end) - a for a, b in busy)
    return len(outside) / span if span > 0 else 0.0


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 2) if values else None


def measure(clean: dict, faulty: dict) -> dict:
    """One system's figures from its two runs' records (see the module docstring)."""
    recovery, rejoin = _recoveries(faulty)
    committed = {"clean": _committed_in_window(clean), "faulty": _committed_in_window(faulty)}
    busy = [(k["t"], k["t"] + back + 2.0) for k, back in zip(faulty["kills"], rejoin)]
    rates = {"clean": round(committed["clean"] / clean["window"], 2), "faulty_outside_faults": round(
        _steady_rate(faulty, busy), 2)}
    return {"steps_per_s": rates, "committed_steps": committed,
            "committed_ratio": round(committed["faulty"] / max(1, committed["clean"]), 4),
            "kills": len(faulty["kills"]), "ranks_killed": [k["ranks_killed"] for k in faulty["kills"]],
            "victims": [k["victim"] for k in faulty["kills"]],
            "recovery_s": [round(x, 2) for x in recovery], "rejoin_s": [round(x, 2) for x in rejoin],
            "recovery_median_s": _median(recovery), "rejoin_median_s": _median(rejoin),
            "rejoin_parts_median_s": _rejoin_parts(faulty), "emulated": faulty["emulated"]}


def _check_systems(systems: list[str]) -> None:
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown or not systems:
        raise SystemExit(f"--systems {','.join(systems)}: choose from {','.join(SYSTEMS)}")
    if "torchft" in systems and importlib.util.find_spec("torchft") is None:
        raise SystemExit("torchft is not installed: pip install -e .[peers] (or --systems hsdp)")


def drive(args: argparse.Namespace) -> None:
    systems = [s for s in args.systems.split(",") if s]
    _check_systems(systems)
    measured = {}
    for system in systems:
        with tempfile.TemporaryDirectory() as tmp:
            where = args.keep / system if args.keep else Path(tmp)  # --keep: the step logs and launch logs stay
            where.mkdir(parents=True, exist_ok=True)
            clean = run_once(args, False, where, system)
            faulty = run_once(args, True, where, system)
        for name, run in (("failure-free", clean), ("faulty", faulty)):
            if run["code"] != 0:
                print(run["log_tail"], file=sys.stderr)
                raise SystemExit(f"{system}: the {name} launch exited with status {run['code']}")
        measured[system] = measure(clean, faulty)
    job = "benchmarks/elastic_recovery.py --job --preset {preset} --out RUN_DIR"
    result = {
        "date": datetime.date.today().isoformat(), "preset": args.preset, "nodes": NODES, "nproc_per_node": NPROC,
        "minutes": args.minutes, "kill_every_s": args.kill_every, "margin_s": args.margin,
        "bandwidth": args.bandwidth, "max_restarts": args.max_restarts,
        "emulated": next(iter(measured.values()))["emulated"], "node_cpus": args.node_cpus or None,
        "timeouts_s": torchft_side.timeouts(),
        "torchft_version": torchft_side.installed_version() if "torchft" in systems else None,
        "systems": measured,
        "command": shlex.join(["sudo", "python", "benchmarks/elastic_recovery.py", "--minutes", f"{args.minutes:g}",
                               "--kill-every", f"{args.kill_every:g}", "--margin", f"{args.margin:g}", "--preset",
                               args.preset, "--max-restarts", str(args.max_restarts), "--bandwidth", args.bandwidth,
                               "--node-cpus", args.node_cpus, "--systems", ",".join(systems)]),
        "launch": "hsdp launch --elastic --nodes 3 --nproc-per-node 2 --max-restarts "
                  f"{args.max_restarts} --inter-node-bandwidth {args.bandwidth}"
                  + (f" --node-cpus {args.node_cpus}" if args.node_cpus else "") + " --stats-json links.json -- "
                  + job.format(preset=args.preset)
                  + (" [--system torchft --lighthouse-port PORT]" if "torchft" in systems else ""),
    }
    _write(result, args.tag)


_ROWS = (
    ("committed steps, failure-free", lambda m: m["committed_steps"]["clean"]),
    ("committed steps, with the kills", lambda m: m["committed_steps"]["faulty"]),
    ("ratio (target >= 0.90)", lambda m: f"{m['committed_ratio']:.3f}"),
    ("recovery: kill -> survivors' first committed step without it, median (s)", lambda m: m["recovery_median_s"]),
    ("rejoin: kill -> killed replica's first committed step, median (s)", lambda m: m["rejoin_median_s"]),
    ("committed steps/s: failure-free; faulty run outside kill -> rejoin + 2 s",
     lambda m: f"{m['steps_per_s']['clean']}; {m['steps_per_s']['faulty_outside_faults']}"),
    ("kills (ranks killed each)", lambda m: f"{m['kills']} ({', '.join(map(str, m['ranks_killed']))})"),
)


def _write(result: dict, tag: str) -> None:
    RESULTS.mkdir(exist_ok=True)
    stem = RESULTS / f"elastic_recovery_{result['date']}{'_' + tag if tag else ''}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    systems = result["systems"]
    mode = {True: "emulated nodes (network namespaces, shaped links)", False: "loopback nodes (no emulation)",
            None: "unknown"}[result["emulated"]]
    t = result["timeouts_s"]
    victims = next(iter(systems.values()))["victims"]
    lines = [f"# Elastic recovery: {result['nodes']} replicas x {result['nproc_per_node']} ranks, a kill every "
             f"{result['kill_every_s']:g} s ({', '.join(systems)})", "",
             f"GPT `{result['preset']}`, AdamW, the same batches, {result['minutes']:g} min window per run (from its "
             f"first committed step), {mode} at {result['bandwidth']}; each node its own torchrun job "
             f"(`--max-restarts {result['max_restarts']}`), the coordinator on node 0. Each kill: SIGKILL of every "
             f"rank of one node (replicas {victims} in turn).", "",
             f"- hsdp: default `ElasticPolicy` (heartbeat {t['heartbeat_interval']:g} s, timeout "
             f"{t['heartbeat_timeout']:g} s, and the coordinator's liveness probe of a failed reduction's ranks).",
             ]
    if "torchft" in systems:
        lines.append(f"- torchft {result['torchft_version']}: FSDP2 in each node, `torchft.Manager` + "
                     f"`ProcessGroupGloo` across nodes, the lighthouse on node 0 (heartbeat "
                     f"{t['heartbeat_interval']:g} s, timeout {t['heartbeat_timeout']:g} s, join timeout "
                     f"{t['start_grace']:g} s; collectives {t['hop_timeout']:g} s, quorum {t['join_timeout']:g} s, "
                     f"connect {t['connect_timeout']:g} s: hsdp's values; see benchmarks/elastic_recovery_torchft.py).")
    lines += ["", "```", result["command"], result["launch"], "```", "",
              "| | " + " | ".join(systems) + " |", "|---|" + "---|" * len(systems)]
    lines += [f"| {name} | " + " | ".join(str(value(m)) for m in systems.values()) + " |" for name, value in _ROWS]
    lines.append("")
    for name, m in systems.items():
        lines.append(f"{name}: per kill, recovery (s): {m['recovery_s']}; rejoin (s): {m['rejoin_s']}.")
        if m.get("rejoin_parts_median_s"):
            lines.append(f"{name}: the rejoin, part by part (medians, s): " + ", ".join(
                f"{part} {seconds:g}" for part, seconds in m["rejoin_parts_median_s"].items()) + ".")
    lines += ["", "The two rates of a system tell whether the machine was as busy in both its runs (the emulated "
              "nodes share its CPUs" + (f"; each node capped and weighted at {result['node_cpus']} CPU"
                                         if result["node_cpus"] else "") + ")."]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", action="store_true", help="run one rank of the job (what the launch starts)")
    parser.add_argument("--system", default="hsdp", choices=SYSTEMS, help="--job: whose rank (default: hsdp)")
    parser.add_argument("--lighthouse-port", type=int, help="--job --system torchft: the lighthouse's port on node 0")
    parser.add_argument("--out", type=Path, help="--job: the run's folder (step logs, the stop file)")
    parser.add_argument("--systems", default=",".join(SYSTEMS),
                        help=f"the systems to run, in order, comma-separated (default: {','.join(SYSTEMS)})")
    parser.add_argument("--preset", default="tiny", help="a GPT preset of hsdp.models.gpt (default: tiny)")
    parser.add_argument("--minutes", type=float, default=5.0, help="window of each run (default: 5)")
    parser.add_argument("--kill-every", type=float, default=60.0, help="seconds between kills (default: 60)")
    parser.add_argument("--margin", type=float, default=25.0,
                        help="no kill in the window's last this many seconds (default: 25)")
    parser.add_argument("--max-restarts", type=int, default=20, help="torchrun restarts per node (default: 20)")
    parser.add_argument("--bandwidth", default="1gbit", help="each node link's rate (default: 1gbit)")
    parser.add_argument("--node-cpus", default="0.6",
                        help="hsdp launch --node-cpus: each node's CPU budget, so a restarting node slows only "
                             "itself, as on separate machines, and other work on this one counts less; '' for none "
                             "(default: 0.6)")
    parser.add_argument("--keep", type=Path, help="keep each run's folder (step and launch logs) under this one")
    parser.add_argument("--tag", default="", help="suffix of the result files' names")
    args = parser.parse_args()
    if args.job and args.system == "torchft":
        torchft_side.job(args.preset, args.out, args.lighthouse_port, seed)
    elif args.job:
        job(args.preset, args.out)
    else:
        drive(args)


if __name__ == "__main__":
    main()
