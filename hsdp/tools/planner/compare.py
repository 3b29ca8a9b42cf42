"""Measured against predicted: calibrate on the tuning runs, then line up every layout side by side.

Three predictions per measured layout, so the report shows how much each step of the method earns:
``nominal`` (datasheet constants, before calibration), ``calibrated`` (constants fitted to all measured
layouts) and ``held_out`` (constants fitted to the *other* layouts only: how well the model predicts a
layout it has never seen). The recommendation comes from the calibrated plan over every valid degree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from hsdp.tools.planner.balance import WeightProposal
from hsdp.tools.planner.calibrate import Calibrated, calibrate, leave_one_out
from hsdp.tools.planner.cluster import ClusterSpec
from hsdp.tools.planner.cost import estimate_step
from hsdp.tools.planner.memory import estimate_memory
from hsdp.tools.planner.options import Precision, TrainOptions
from hsdp.tools.planner.plan import Plan, make_plan
from hsdp.tools.planner.tune import Measured
from hsdp.tools.quantities import parse_bandwidth

# What the emulated CPU cluster looks like before calibration: gloo over loopback inside a node (a few
# hundred MB/s, CPU-bound), the shaped link between nodes (about 94% of the rate carries payload after
# TCP/IP headers), a millisecond per collective plus 50 us per ring step, gloo's reduce-scatter-as-all-reduce
# inside a node (across nodes hsdp's Comm reduce-scatters with an all-to-all: the ring's bytes).
CPU_INTRA_BANDWIDTH = 200e6
LINK_EFFICIENCY = 0.94
CPU_COLLECTIVE_OVERHEAD = 1e-3
CPU_HOST_S_PER_BYTE = 1e-9
CPU_STEP_LATENCY = 50e-6  # one ring step of gloo over TCP: a send and a receive through the kernel


def emulated_cluster(nodes: int, nproc_per_node: int, bandwidth: str, gpu_memory: float = math.inf) -> ClusterSpec:
    """Nominal constants of ``hsdp launch``'s emulated cluster (``bandwidth`` as ``hsdp launch`` reads it,
    e.g. ``1gbit`` or ``1GB/s``)."""
    return ClusterSpec(nodes, nproc_per_node, gpu_memory, CPU_INTRA_BANDWIDTH,
                       parse_bandwidth(bandwidth) * LINK_EFFICIENCY, 1e12, intra_latency=CPU_STEP_LATENCY,
                       inter_latency=CPU_STEP_LATENCY,
                       collective_overhead=CPU_COLLECTIVE_OVERHEAD, host_s_per_intra_byte=CPU_HOST_S_PER_BYTE,
                       host_s_per_inter_byte=CPU_HOST_S_PER_BYTE,
                       reduce_scatter_factor=2.0, name="emulated")


def options_from_metrics(metrics: dict[str, Any]) -> TrainOptions:
    """The run's training options; ``shard_optimizer_across_replicas`` stays off here: it differs between
    the candidates, and each :class:`Measurement` carries its own."""
    o = metrics.get("options", {})
    precision = Precision("measured", param_bytes=o.get("param_bytes", 4), grad_bytes=o.get("param_bytes", 4),
                          compute_bytes=o.get("compute_bytes", 4), reduce_bytes=o.get("reduce_bytes", 4))
    return TrainOptions(precision, micro_batches=o.get("micro_batches", 1),
                        reshard_after_forward=o.get("reshard_after_forward", True),
                        replicate_dtype=o.get("replicate_dtype", "same"), sync=o.get("sync", "deferred"))


@dataclass(frozen=True)
class Row:
    """One measured layout: step seconds measured and predicted three ways; bytes measured and predicted."""

    shard: int
    measured_s: float
    nominal_s: float
    calibrated_s: float
    held_out_s: float | None
    measured_inter_node_bytes: float | None
    predicted_inter_node_bytes: float
    measured_state_bytes: float | None
    predicted_state_bytes: float
    run_medians: tuple[float, ...] = ()
    shard_optimizer: bool = False  # measured with shard_optimizer_across_replicas

    @property
    def error(self) -> float:
        return self.calibrated_s / self.measured_s - 1

    @property
    def held_out_error(self) -> float | None:
        return None if self.held_out_s is None else self.held_out_s / self.measured_s - 1


@dataclass(frozen=True)
class TuneReport:
    measured: Measured
    nominal: ClusterSpec
    calibrated: Calibrated
    options: TrainOptions
    rows: tuple[Row, ...]
    plan: Plan
    weights: WeightProposal | None = None  # batch weights from the recommended layout's per-rank times

    @property
    def measured_fastest(self) -> Row:
        return min(self.rows, key=lambda r: r.measured_s)

    @property
    def recommended_shard(self) -> int | None:
        return None if self.plan.best is None else self.plan.best.layout.shard

    @property
    def recommended_shard_optimizer(self) -> bool:
        """Whether the recommendation shards the optimizer across replicas."""
        return self.plan.best is not None and self.plan.best.shard_optimizer

    def is_recommended(self, row: Row) -> bool:
        return (row.shard, row.shard_optimizer) == (self.recommended_shard, self.recommended_shard_optimizer)

    def recommended_vs_fastest(self) -> float | None:
        """Measured step of the recommendation over the measured fastest, minus 1 (None: not measured)."""
        rec = [r for r in self.rows if self.is_recommended(r)]
        return rec[0].measured_s / self.measured_fastest.measured_s - 1 if rec else None

    def as_dict(self) -> dict[str, Any]:
        rows = [{**vars(r), "error": r.error, "held_out_error": r.held_out_error} for r in self.rows]
        return {"world_size": self.measured.world_size, "nproc_per_node": self.measured.nproc_per_node,
                "model": self.measured.model.name, "params": self.measured.model.params,
                "profile": None if self.measured.profile is None else vars(self.measured.profile),
                "calibrated_constants": self.calibrated.values, "rows": rows,
                "recommended_shard": self.recommended_shard,
                "recommended_shard_optimizer_across_replicas": self.recommended_shard_optimizer,
                "measured_fastest_shard": self.measured_fastest.shard,
                "measured_fastest_shard_optimizer_across_replicas": self.measured_fastest.shard_optimizer,
                "recommended_vs_fastest": self.recommended_vs_fastest(), "reasons": list(self.plan.reasons),
                "failures": list(self.measured.failures), "plan": self.plan.as_dict(),
                "batch_weights": None if self.weights is None else self.weights.as_dict()}


def analyse(measured: Measured, nominal: ClusterSpec, options: TrainOptions,
            shard_optimizer: str = "auto") -> TuneReport:
    """Calibrate ``nominal`` on ``measured`` and compare; the plan covers every valid degree
    (``shard_optimizer`` as for :func:`hsdp.tools.planner.plan.make_plan`; each measured row is predicted
    with the setting it ran with)."""
    model, profile, data = measured.model, measured.profile, measured.measurements
    cal = calibrate(model, nominal, options, data, profile)
    held_out = leave_one_out(model, nominal, options, data, profile) if len(data) > 2 else {}
    rows = []
    for m in data:
        o = m.options(options)
        step = estimate_step(model, cal.cluster, m.shard, o, cal.profile)
        state = estimate_memory(model, m.shard, o, replicate=measured.world_size // m.shard).state
        rows.append(Row(m.shard, m.step_s, estimate_step(model, nominal, m.shard, o, profile).step_s,
                        step.step_s, held_out.get(m.key), m.inter_node_bytes, step.inter_node_bytes,
                        m.state_bytes, state, m.run_medians, m.shard_optimizer))
    plan = make_plan(model, cal.cluster, options, cal.profile, headroom=0.0, shard_optimizer=shard_optimizer)
    return TuneReport(measured, nominal, cal, options, tuple(rows), plan)
