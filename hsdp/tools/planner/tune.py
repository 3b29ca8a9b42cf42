"""``hsdp tune``: measure each candidate layout on the cluster, calibrate the cost model, recommend.

The script (default: :mod:`hsdp.tools.planner.workload`) is launched once per candidate shard degree and repeat,
through ``hsdp launch`` (emulated nodes, or loopback), with ``$HSDP_SHARDING_DEGREE`` selecting the layout
(``hsdp.init_mesh()`` reads it) and ``$HSDP_METRICS_FILE`` naming where it writes its measurements
(:mod:`hsdp.tools.planner.metrics`). With R > 1 a degree is also measured with the optimizer sharded across
replicas (``$HSDP_SHARD_OPTIMIZER_ACROSS_REPLICAS=1``: the script passes ``shard_optimizer_across_replicas``
to ``ShardedModel``; the built-in workload does), as the planner would consider it. Repeats run
round-robin over the candidates, so a burst of load from other programs on a shared machine lands on every
layout alike; a layout's step time is the median of all its measured steps. On a real cluster, run the
script yourself once per candidate with those variables and pass the files with ``--from-metrics``.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hsdp.tools.planner.calibrate import Measurement
from hsdp.tools.planner.cluster import valid_degrees
from hsdp.tools.planner.model import ComputeProfile, ModelSpec, UnitSpec

DEGREE_ENV = "HSDP_SHARDING_DEGREE"
METRICS_ENV = "HSDP_METRICS_FILE"
SHARD_OPTIMIZER_ENV = "HSDP_SHARD_OPTIMIZER_ACROSS_REPLICAS"  # "1": the script shards the optimizer over replicas
DEFAULT_SCRIPT = ("-m", "hsdp.tools.planner.workload", "--preset", "small", "--steps", "6", "--warmup", "2")


@dataclass(frozen=True)
class TuneRun:
    """How to measure: ``script_args`` on ``nodes`` x ``nproc_per_node`` ranks, ``repeats`` times per
    degree in ``degrees`` (default: every divisor of the world size). ``emulation``: ``"require"`` (network
    namespaces with shaped links; fail without root), ``"auto"`` (fall back to loopback) or ``"none"``.
    ``shard_optimizer``: ``"auto"`` measures every degree with R > 1 both without and with the optimizer
    sharded across replicas, ``"on"``/``"off"`` only one way."""

    script_args: tuple[str, ...] = DEFAULT_SCRIPT
    nodes: int = 2
    nproc_per_node: int = 2
    bandwidth: str = "1gbit"
    latency: str = "0"
    degrees: tuple[int, ...] = ()
    repeats: int = 2
    emulation: str = "require"
    timeout_s: float = 1800.0
    env: dict[str, str] = field(default_factory=dict)
    shard_optimizer: str = "auto"

    def __post_init__(self) -> None:
        world = self.nodes * self.nproc_per_node
        bad = [d for d in self.degrees if d < 1 or world % d]
        if bad:
            raise ValueError(f"degrees {bad} do not divide the world size {world}: choose from {valid_degrees(world)}")
        if self.repeats < 1:
            raise ValueError(f"repeats={self.repeats} must be at least 1")
        if self.emulation not in ("require", "auto", "none"):
            raise ValueError(f"emulation={self.emulation!r}: use 'require', 'auto' or 'none'")
        if self.shard_optimizer not in ("auto", "on", "off"):
            raise ValueError(f"shard_optimizer={self.shard_optimizer!r}: use 'auto', 'on' or 'off'")
        if not self.script_args:
            raise ValueError("nothing to run: pass a script after `--` (or leave it out for the built-in workload)")

    @property
    def candidate_degrees(self) -> list[int]:
        return list(self.degrees) or valid_degrees(self.nodes * self.nproc_per_node)

    @property
    def candidates(self) -> list[tuple[int, bool]]:
        """``(degree, shard the optimizer across replicas)`` per launch of one repeat; R = 1 only without."""
        world = self.nodes * self.nproc_per_node
        if self.shard_optimizer != "auto":
            return [(d, self.shard_optimizer == "on") for d in self.candidate_degrees]
        return [(d, flag) for d in self.candidate_degrees for flag in (False, True) if not flag or world > d]


def launch_command(run: TuneRun, stats_json: str) -> list[str]:
    cmd = [sys.executable, "-m", "hsdp", "launch", "--nodes", str(run.nodes), "--nproc-per-node",
           str(run.nproc_per_node), "--inter-node-bandwidth", run.bandwidth, "--inter-node-latency", run.latency]
    mode = {"require": ["--require-emulation"], "auto": [], "none": ["--no-emulation"]}[run.emulation]
    return [*cmd, *mode, "--stats-json", stats_json, "--", *run.script_args]


def candidate_label(degree: int, shard_optimizer: bool) -> str:
    return f"S={degree}{' +opt/R' if shard_optimizer else ''}"


def run_candidate(run: TuneRun, degree: int, metrics_path: Path, log_path: Path,
                  shard_optimizer: bool = False) -> dict[str, Any]:
    """One launch at ``degree``; the metrics the script wrote, or ``{"error": ...}`` with the log's tail."""
    env = {**os.environ, **run.env, DEGREE_ENV: str(degree), METRICS_ENV: str(metrics_path),
           SHARD_OPTIMIZER_ENV: "1" if shard_optimizer else "0"}
    stats = metrics_path.with_suffix(".traffic.json")
    with open(log_path, "w") as log:
        try:
            code = subprocess.run(launch_command(run, str(stats)), env=env, stdout=log, stderr=subprocess.STDOUT,
                                  timeout=run.timeout_s).returncode
        except subprocess.TimeoutExpired:
            code = -1
    if not metrics_path.exists():
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-15:])
        return {"sharding_degree": degree, "shard_optimizer_across_replicas": shard_optimizer,
                "error": f"exit {code}; last lines of {log_path}:\n{tail}"}
    result = json.loads(metrics_path.read_text())
    if code != 0:
        # Rank 0 writes the file only after every rank finished its measured steps: a rank that dies
        # while shutting down (seen once: an abort in teardown) does not spoil the measurements.
        result["warning"] = f"exit {code} after the metrics were written; see {log_path}"
    return result


def collect(run: TuneRun, workdir: Path, echo: Any = print) -> list[dict[str, Any]]:
    """Round-robin over repeats x degrees; every run's metrics (or error) in launch order."""
    workdir.mkdir(parents=True, exist_ok=True)
    results = []
    for rep in range(run.repeats):
        for degree, sliced in run.candidates:
            name = f"s{degree}{'_opt' if sliced else ''}_r{rep}"
            result = run_candidate(run, degree, workdir / f"{name}.json", workdir / f"{name}.log", sliced)
            echo(f"[tune] {candidate_label(degree, sliced)} repeat {rep + 1}/{run.repeats}: {_status(result)}")
            results.append(result)
    return results


def _status(result: dict[str, Any]) -> str:
    if "error" in result:
        return result["error"].splitlines()[0]
    warning = f" ({result['warning']})" if "warning" in result else ""
    return f"median step {result['median_step_s']:.3f} s{warning}"


def load_metrics(paths: Sequence[str | Path]) -> list[dict[str, Any]]:
    """Metrics files (or directories of them) written by earlier runs; a ``hsdp tune --out`` results file
    stands for the runs it holds."""
    files: list[Path] = []
    for p in map(Path, paths):
        files += sorted(f for f in p.glob("*.json") if not f.name.endswith(".traffic.json")) if p.is_dir() else [p]
    out: list[dict[str, Any]] = []
    bad = []
    for f in files:
        data = json.loads(f.read_text())
        runs = data["runs"] if isinstance(data.get("runs"), list) and "report" in data else [data]
        bad += [str(f) for r in runs if r.get("format") != "hsdp-metrics/1" and "error" not in r]
        out += runs
    if bad:
        raise ValueError(f"not hsdp metrics files: {bad}; write them with hsdp.tools.planner.metrics.StepRecorder")
    return out


@dataclass(frozen=True)
class Measured:
    """What the runs say, pooled per degree: the model, the compute profile and one measurement each."""

    model: ModelSpec
    profile: ComputeProfile | None
    world_size: int
    nproc_per_node: int
    micro_batches: int
    measurements: tuple[Measurement, ...]
    failures: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()


def spec_from_metrics(metrics: dict[str, Any]) -> ModelSpec:
    m = metrics["model"]
    units = tuple(UnitSpec(u["name"], tuple((int(r), int(c)) for r, c in u["shapes"]), float(u["flops_per_token"]),
                           tuple((int(r), int(c)) for r, c in u.get("frozen", ()))) for u in m["units"])
    return ModelSpec(m["name"], units, int(m["seq_len"]), int(m["micro_batch"]))


def _pooled_profile(runs: Sequence[dict[str, Any]]) -> ComputeProfile | None:
    profiles = [r["profile"] for r in runs if r.get("profile")]
    if not profiles:
        return None
    keys = ("forward_s", "backward_s", "optimizer_s_per_element")
    return ComputeProfile(*(statistics.median(p[k] for p in profiles) for k in keys))


def shards_optimizer(result: dict[str, Any]) -> bool:
    """Whether a run sharded the optimizer across replicas: what the model reported (a script may have
    ignored the request), else what was requested (a failed run)."""
    reported = result.get("options", {}).get("shard_optimizer_across_replicas")
    return bool(result.get("shard_optimizer_across_replicas", False) if reported is None else reported)


def _candidate(result: dict[str, Any]) -> tuple[int, bool]:
    return result["sharding_degree"], shards_optimizer(result)


def _measurement(key: tuple[int, bool], runs: Sequence[dict[str, Any]]) -> Measurement:
    steps = [t for r in runs for t in r["step_s"]]
    sent = [max(node[0] for node in r["inter_node_bytes_per_step"]) for r in runs]
    return Measurement(key[0], statistics.median(steps), statistics.median(sent) if any(sent) else None,
                       max(r["state_bytes"]["total"] for r in runs), tuple(r["median_step_s"] for r in runs),
                       key[1])


def summarise(results: Sequence[dict[str, Any]]) -> Measured:
    """Pool the runs per candidate (degree, and whether the optimizer was sharded across replicas);
    ``ValueError`` when no run succeeded."""
    ok = [r for r in results if "error" not in r]
    if not ok:
        details = "\n".join(r.get("error", "") for r in results)
        raise ValueError(f"no candidate layout ran successfully; fix the script and rerun:\n{details}")
    keys = sorted({_candidate(r) for r in ok})
    measurements = tuple(_measurement(k, [r for r in ok if _candidate(r) == k]) for k in keys)
    first = ok[0]
    return Measured(spec_from_metrics(first), _pooled_profile(ok), first["world_size"], first["nproc_per_node"],
                    first["micro_batches"], measurements,
                    tuple(f"{candidate_label(*_candidate(r))}: {r['error']}" for r in results if "error" in r),
                    tuple(f"{candidate_label(*_candidate(r))}: {r['warning']}" for r in ok if "warning" in r))


def default_workdir() -> Path:
    return Path(tempfile.mkdtemp(prefix="hsdp-tune-"))
