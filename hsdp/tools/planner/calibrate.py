"""Fit the cost model's constants to measured step times: regularised least squares in log space.

Fitted constants (what a datasheet does not tell you about *this* cluster and model):

| name | meaning | prior (centre, spread) |
|---|---|---|
| ``compute_scale`` | measured profile x this = compute in training (wrapping, hooks, contention) | 1, x1.6 |
| ``intra_bandwidth`` | effective bytes/s of a ring edge inside a node | given, x4.5 |
| ``inter_bandwidth`` | effective bytes/s out of a node | given, x1.2 |
| ``collective_overhead`` | fixed seconds per collective call | given, x7 |
| ``latency_scale`` | x the given per-ring-step latencies (long rings pay per step) | 1, x7 |
| ``host_s_per_intra_byte`` | compute seconds lost per byte sent inside a node (CPU ranks) | given, x7 |
| ``host_s_per_inter_byte`` | compute seconds lost per byte sent to another node (CPU ranks) | given, x7 |

Each measured layout contributes ``(log predicted - log measured) / 0.05``; each constant a prior term
``(log value - log centre) / log spread``. With as few layouts as constants the priors keep the fit
well-posed: a direction the measurements cannot see stays at its prior instead of wandering. The fit is a
Levenberg-Marquardt iteration on the log constants with a numeric Jacobian (a few hundred evaluations of
:func:`hsdp.tools.planner.cost.estimate_step`, well under a second).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from hsdp.tools.planner.cluster import ClusterSpec
from hsdp.tools.planner.cost import estimate_step
from hsdp.tools.planner.model import ComputeProfile, ModelSpec
from hsdp.tools.planner.options import TrainOptions

MEASUREMENT_SIGMA = 0.05  # log units: step-time medians on a shared machine are about this noisy
CLUSTER_PARAMS = ("intra_bandwidth", "inter_bandwidth", "collective_overhead", "host_s_per_intra_byte",
                  "host_s_per_inter_byte")
PRIOR_SPREAD = {"compute_scale": 1.6, "intra_bandwidth": 4.5, "inter_bandwidth": 1.2,
                "collective_overhead": 7.0, "host_s_per_intra_byte": 7.0, "host_s_per_inter_byte": 7.0,
                "latency_scale": 7.0}


@dataclass(frozen=True)
class Measurement:
    """One layout's measured median step time (and, when known, inter-node bytes per node per step and
    per-rank state bytes, reported side by side but not fitted)."""

    shard: int
    step_s: float
    inter_node_bytes: float | None = None
    state_bytes: float | None = None
    run_medians: tuple[float, ...] = ()  # each launch's own median: the spread shows the noise
    shard_optimizer: bool = False  # measured with shard_optimizer_across_replicas

    @property
    def key(self) -> tuple[int, bool]:
        return self.shard, self.shard_optimizer

    def options(self, base: TrainOptions) -> TrainOptions:
        """``base`` with this run's ``shard_optimizer_across_replicas``."""
        return replace(base, shard_optimizer_across_replicas=self.shard_optimizer)


@dataclass(frozen=True)
class Calibrated:
    """The fitted constants: predict with ``estimate_step(model, cluster, S, options, profile)``."""

    cluster: ClusterSpec
    profile: ComputeProfile | None
    compute_scale: float
    values: dict[str, float] = field(default_factory=dict)

    def predict(self, model: ModelSpec, shard: int, options: TrainOptions) -> float:
        return estimate_step(model, self.cluster, shard, options, self.profile).step_s


def apply(cluster: ClusterSpec, profile: ComputeProfile | None, values: dict[str, float]) -> Calibrated:
    """Constants ``values`` (by name, see the module table) applied to a cluster and profile."""
    scale = values.get("compute_scale", 1.0)
    fields = {k: v for k, v in values.items() if k in CLUSTER_PARAMS}
    latency = values.get("latency_scale", 1.0)
    fields.update(intra_latency=cluster.intra_latency * latency, inter_latency=cluster.inter_latency * latency)
    if profile is None:
        fields["compute_rate"] = cluster.compute_rate / scale
        fields["optimizer_s_per_element"] = cluster.optimizer_s_per_element * scale
        scaled = None
    else:
        scaled = ComputeProfile(profile.forward_s * scale, profile.backward_s * scale,
                                profile.optimizer_s_per_element * scale, profile.activation_bytes)
    return Calibrated(replace(cluster, **fields), scaled, scale, dict(values))


def _initial(cluster: ClusterSpec) -> dict[str, float]:
    return {"compute_scale": 1.0, "latency_scale": 1.0,
            **{k: max(getattr(cluster, k), 1e-12) for k in CLUSTER_PARAMS}}


def _residuals(model: ModelSpec, options: TrainOptions, cluster: ClusterSpec, profile: ComputeProfile | None,
               data: Sequence[Measurement], names: list[str], prior: np.ndarray) -> Callable[[np.ndarray], np.ndarray]:
    spreads = np.log([PRIOR_SPREAD[n] for n in names])

    def f(theta: np.ndarray) -> np.ndarray:
        cal = apply(cluster, profile, dict(zip(names, np.exp(theta).tolist())))
        fit = [math.log(cal.predict(model, m.shard, m.options(options)) / m.step_s) / MEASUREMENT_SIGMA
               for m in data]
        return np.concatenate([np.array(fit), (theta - prior) / spreads])

    return f


def _levenberg_marquardt(f: Callable[[np.ndarray], np.ndarray], theta: np.ndarray, iters: int = 60) -> np.ndarray:
    lam, r = 1e-2, f(theta)
    for _ in range(iters):
        jac = np.empty((r.size, theta.size))
        for j in range(theta.size):
            step = np.zeros_like(theta)
            step[j] = 1e-5
            jac[:, j] = (f(theta + step) - r) / 1e-5
        a = jac.T @ jac
        delta = np.linalg.solve(a + lam * np.diag(np.diag(a) + 1e-9), -jac.T @ r)
        r_new = f(theta + delta)
        if r_new @ r_new < r @ r:
            theta, r, lam = theta + delta, r_new, lam / 3
            if np.max(np.abs(delta)) < 1e-6:
                break
        else:
            lam *= 4
            if lam > 1e8:
                break
    return theta


def calibrate(model: ModelSpec, cluster: ClusterSpec, options: TrainOptions, data: Sequence[Measurement],
              profile: ComputeProfile | None = None, fit: Sequence[str] | None = None) -> Calibrated:
    """Constants that make the predictions match ``data`` (``fit`` names which; default all five).

    ``cluster`` supplies the starting values and priors (the nominal link rate, say). ``ValueError`` when
    there is nothing to fit or a measured time is not positive.
    """
    if not data:
        raise ValueError("calibration needs at least one measured layout: run `hsdp tune` first")
    bad = [m for m in data if not m.step_s > 0]
    if bad:
        raise ValueError(f"measured step times must be positive, got {bad}")
    names = list(fit or PRIOR_SPREAD)
    unknown = set(names) - set(PRIOR_SPREAD)
    if unknown:
        raise ValueError(f"cannot fit {sorted(unknown)}: choose from {sorted(PRIOR_SPREAD)}")
    start = _initial(cluster)
    prior = np.log([start[n] for n in names])
    theta = _levenberg_marquardt(_residuals(model, options, cluster, profile, data, names, prior), prior.copy())
    return apply(cluster, profile, dict(zip(names, np.exp(theta).tolist())))


def leave_one_out(model: ModelSpec, cluster: ClusterSpec, options: TrainOptions, data: Sequence[Measurement],
                  profile: ComputeProfile | None = None) -> dict[tuple[int, bool], float]:
    """For each measured layout (by :attr:`Measurement.key`): its step time predicted by a calibration on
    the *other* layouts only (how well the model extrapolates to a layout it has not seen)."""
    out = {}
    for m in data:
        rest = [d for d in data if d is not m]
        if rest:
            cal = calibrate(model, cluster, options, rest, profile)
            out[m.key] = cal.predict(model, m.shard, m.options(options))
    return out
