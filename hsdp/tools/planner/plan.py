"""Every valid layout of a cluster, estimated, and the recommendation with its reasons in plain words.

A layout is valid when its shard degree divides the world size (the engine's rule). It *fits* when its
peak memory per rank stays under ``gpu_memory x (1 - headroom)``; the headroom (10% by default) covers
what no formula sees: allocator fragmentation, the CUDA context, communication buffers. The recommendation
is the fitting layout with the shortest step. Layouts within 1% of it count as a tie (the model cannot
resolve less), broken toward the least inter-node traffic, the layout least hurt by a link slower or busier
than modelled, then toward less memory (on one node, where nothing crosses). Once shard groups span nodes
the least traffic is the smallest shard degree that fits; below a node it is ``S`` = ranks per node, as
smaller degrees send a little more (DDP's ring crosses nodes over all ranks) and hold more memory.
Breaking ties by memory alone would pick full sharding: the most traffic of all.

Each layout with R > 1 is also estimated with the optimizer sharded across replicas
(``shard_optimizer_across_replicas``: gradients and optimizer state / R, an all-gather across replicas in the
parameter dtype after the step) and shown with it when it fits only so or is more than the tie faster (:func:`_use`):
when it lets a faster layout fit (typically a smaller shard degree, whose traffic stays inside nodes) or makes one
faster (the optimizer step covers 1/R of the elements). The choice runs over both variants of every layout by the
rules above, the plainer setting winning a tie of equal traffic.

With tensor parallelism (``tensor_parallel``: the TP degrees to consider, :mod:`hsdp.tools.planner.tensor_parallel`)
the layouts are ``R x S x T``: every shard degree at ``T = 1``, and at ``T > 1`` (a divisor of the ranks per
node) every ``S`` whose ``S x T`` divides the ranks per node or spans whole nodes (the shard groups' traffic
then crosses nodes, as at ``T = 1`` with ``S`` > ranks per node; TP's stays inside the node). The plan holds
the global batch of ``T = 1`` (``micro_batch x micro_batches x world`` sequences per step): a data-parallel
rank of a ``T > 1`` layout stands for ``T`` GPUs, so it runs ``T x`` the micro-batches (each of the same
size, its activations split ``T`` ways), and step times compare directly. Ties prefer, after the least
inter-node traffic, the smaller ``T`` (the plainer setting: no TP plan to write).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from hsdp.tools.planner.cluster import ClusterSpec, valid_degrees
from hsdp.tools.planner.cost import estimate_step
from hsdp.tools.planner.estimate import LayoutEstimate
from hsdp.tools.planner.memory import estimate_memory
from hsdp.tools.planner.model import ComputeProfile, ModelSpec
from hsdp.tools.planner.options import Layout, TrainOptions
from hsdp.tools.planner.plan_tp import tp_reason
from hsdp.tools.planner.tensor_parallel import check_layout, shard_degrees, spans_nodes
from hsdp.tools.quantities import format_bytes, format_count, format_rate, format_seconds

TIE = 0.01
DEFAULT_HEADROOM = 0.10


@dataclass(frozen=True)
class Plan:
    """All layouts (by shard degree; each in the variant the planner would use), the recommended one
    (``None`` when nothing fits) and why; ``alternatives``: the variants not used (the same degree with
    the optimizer sharded across replicas, or without)."""

    model: ModelSpec
    cluster: ClusterSpec
    options: TrainOptions
    memory_limit: float
    layouts: tuple[LayoutEstimate, ...]
    best: LayoutEstimate | None
    reasons: tuple[str, ...]
    alternatives: tuple[LayoutEstimate, ...] = ()

    def layout(self, shard: int, shard_optimizer: bool | None = None, tp: int = 1) -> LayoutEstimate:
        """The estimate of degree ``shard`` (with TP degree ``tp``) the plan uses, or its variant with/without
        the optimizer sharded across replicas (``shard_optimizer``)."""
        for e in (*self.layouts, *self.alternatives):
            if (e.layout.shard, e.layout.tp) == (shard, tp) and shard_optimizer in (None, e.shard_optimizer):
                return e
        raise ValueError(f"shard degree {shard} with T={tp} is not in this plan: choose one of "
                         f"{[(e.layout.shard, e.layout.tp) for e in self.layouts]} (S, T)")

    def as_dict(self) -> dict[str, object]:
        return {
            "model": {"name": self.model.name, "params": self.model.params, "units": len(self.model.units),
                      "seq_len": self.model.seq_len, "micro_batch": self.model.micro_batch},
            "cluster": {k: (None if isinstance(v, float) and math.isinf(v) else v)
                        for k, v in vars(self.cluster).items()},
            "options": {**{k: v for k, v in vars(self.options).items() if k != "precision"},
                        "precision": vars(self.options.precision)},
            "memory_limit_bytes": None if math.isinf(self.memory_limit) else self.memory_limit,
            "recommended": None if self.best is None else {
                "replicate": self.best.layout.replicate, "shard": self.best.layout.shard,
                "tensor_parallel": self.best.layout.tp, "shard_optimizer_across_replicas": self.best.shard_optimizer},
            "reasons": list(self.reasons),
            "layouts": [e.as_dict() for e in self.layouts],
            "alternatives": [e.as_dict() for e in self.alternatives],
        }


def estimate_layout(model: ModelSpec, cluster: ClusterSpec, shard: int, options: TrainOptions,
                    profile: ComputeProfile | None = None, memory_limit: float = math.inf,
                    tp: int = 1) -> LayoutEstimate:
    """One ``R x S x T`` layout at the global batch of ``options`` at ``T = 1``: with ``tp > 1`` each
    data-parallel rank runs ``tp x options.micro_batches`` micro-batches (see the module docstring)."""
    check_layout(cluster, shard, tp)
    layout = Layout(cluster.world_size // (shard * tp), shard, tp)
    run = options if tp == 1 else replace(options, micro_batches=options.micro_batches * tp)
    memory = estimate_memory(model, shard, run, profile, layout.replicate, tp)
    step = estimate_step(model, cluster, shard, run, profile, tp)
    sequences = model.micro_batch * run.micro_batches * layout.data_parallel_size
    return LayoutEstimate(layout, layout.kind(cluster.gpus_per_node), memory, step, memory.total <= memory_limit,
                          sequences * model.seq_len / step.step_s, options.shards_optimizer(layout.replicate),
                          run.micro_batches, sequences)


SHARD_OPTIMIZER_MODES = ("auto", "on", "off")


def _variants(options: TrainOptions, replicate: int, mode: str) -> list[TrainOptions]:
    """The settings of ``shard_optimizer_across_replicas`` to estimate a layout with, plainest first."""
    off, on = (replace(options, shard_optimizer_across_replicas=v) for v in (False, True))
    if mode == "off" or replicate == 1:
        return [off]
    return [on] if mode == "on" else [off, on]


def _use(plain: LayoutEstimate, sliced: LayoutEstimate) -> LayoutEstimate:
    """The variant a layout uses: sharding the optimizer across replicas only when it fits and the plain
    one does not, or is slower by more than the tie."""
    if sliced.fits and (not plain.fits or plain.step.step_s > sliced.step.step_s * (1 + TIE)):
        return sliced
    return plain


def _choose(estimates: Sequence[LayoutEstimate]) -> LayoutEstimate | None:
    fitting = [e for e in estimates if e.fits]
    if not fitting:
        return None
    fastest = min(e.step.step_s for e in fitting)
    ties = [e for e in fitting if e.step.step_s <= fastest * (1 + TIE)]
    # Least traffic first (robust to a slow link; on one node all are 0), then the plainer settings (less
    # TP, optimizer not sharded across replicas), then least memory.
    return min(ties, key=lambda e: (e.step.inter_node_bytes, e.layout.tp, e.shard_optimizer, e.memory.total,
                                    e.step.step_s))


def make_plan(model: ModelSpec, cluster: ClusterSpec, options: TrainOptions, profile: ComputeProfile | None = None,
              degrees: Sequence[int] | None = None, headroom: float = DEFAULT_HEADROOM,
              shard_optimizer: str | None = None, tensor_parallel: Sequence[int] | None = None) -> Plan:
    """Estimate ``degrees`` (default: every divisor of the world size) and recommend one.

    ``shard_optimizer``: ``"auto"`` estimates every layout with R > 1 with and without
    ``shard_optimizer_across_replicas`` and uses the option where it pays (see the module docstring);
    ``"on"``/``"off"`` force it. Default: ``"on"`` when ``options.shard_optimizer_across_replicas``, else
    ``"auto"``. ``tensor_parallel``: the TP degrees to consider (default ``(1,)``: no TP; each ``T > 1``
    with every ``S`` of ``degrees`` whose ``S x T`` lies inside a node or spans whole nodes). ``ValueError``
    when a degree does not divide the world size, a TP degree does not divide the ranks per node,
    or ``headroom`` is outside [0, 1).
    """
    world = cluster.world_size
    if not 0 <= headroom < 1:
        raise ValueError(f"headroom={headroom} must be in [0, 1): the fraction of GPU memory kept free")
    mode = shard_optimizer or ("on" if options.shard_optimizer_across_replicas else "auto")
    if mode not in SHARD_OPTIMIZER_MODES:
        raise ValueError(f"shard_optimizer={mode!r}: choose one of {SHARD_OPTIMIZER_MODES}")
    chosen = list(degrees) if degrees else valid_degrees(world)
    bad = [d for d in chosen if d < 1 or world % d]
    if bad:
        raise ValueError(f"shard degrees {bad} do not divide the world size {world}: choose from "
                         f"{valid_degrees(world)}")
    limit = cluster.gpu_memory * (1 - headroom)
    used: list[LayoutEstimate] = []
    others: list[LayoutEstimate] = []
    for d, t in _grid(cluster, chosen, tensor_parallel or (1,)):
        variants = [estimate_layout(model, cluster, d, v, profile, limit, t)
                    for v in _variants(options, world // (d * t), mode)]
        pick = variants[0] if len(variants) == 1 else _use(*variants)
        used.append(pick)
        others += [v for v in variants if v is not pick]
    best = _choose(used + others)
    estimates, alternatives = _show(best, used, others)
    reasons = explain(estimates, best, cluster, model, options, limit, alternatives)
    return Plan(model, cluster, options, limit, estimates, best, tuple(reasons), alternatives)


def _grid(cluster: ClusterSpec, degrees: Sequence[int], tps: Sequence[int]) -> list[tuple[int, int]]:
    """(S, T) pairs to estimate, T = 1 first: each S of ``degrees`` that ``T`` allows (:func:`shard_degrees`;
    ``ValueError`` for a T that does not divide the ranks per node, or for a single T that allows none)."""
    pairs = []
    for t in sorted(set(tps)):
        check_layout(cluster, 1, t)
        valid = shard_degrees(cluster, t)
        ok = sorted(d for d in set(degrees) if d in valid)
        if not ok and len(set(tps)) == 1:
            raise ValueError(f"no shard degree of {sorted(set(degrees))} gives shard groups inside a node or "
                             f"over whole nodes at T={t}: choose S from {valid}")
        pairs += [(d, t) for d in ok]
    return pairs


def _show(best: LayoutEstimate | None, used: list[LayoutEstimate],
          others: list[LayoutEstimate]) -> tuple[tuple[LayoutEstimate, ...], tuple[LayoutEstimate, ...]]:
    """(rows, alternatives): the recommendation's layout shows the recommended variant."""
    if best is None or any(e is best for e in used):
        return tuple(used), tuple(others)
    i = next(i for i, e in enumerate(used) if e.layout == best.layout)
    return (tuple(best if j == i else e for j, e in enumerate(used)),
            tuple(used[i] if e is best else e for e in others))


def _degrees(e: LayoutEstimate) -> str:
    """``S=8``, or ``S=4, T=2`` with tensor parallelism."""
    return f"S={e.layout.shard}" + (f", T={e.layout.tp}" if e.layout.tp > 1 else "")


def _name(e: LayoutEstimate) -> str:
    sliced = ", optimizer sharded across replicas" if e.shard_optimizer else ""
    return f"{e.layout.label} ({_degrees(e)}, {e.kind}{sliced})"


def _gb(n: float) -> str:
    """Bytes that cross a link, in GB (``3.26e12`` -> ``"3,262 GB"``, ``2.53e10`` -> ``"25.3 GB"``)."""
    gb = n / 1e9
    return f"{gb:,.0f} GB" if gb >= 1000 else f"{gb:.3g} GB"


def _recommended_reason(estimates: Sequence[LayoutEstimate], best: LayoutEstimate, cluster: ClusterSpec) -> str:
    fitting = [e for e in estimates if e.fits]
    fastest = min(fitting, key=lambda e: e.step.step_s)
    head = (f"Recommended: {_name(best)}: {format_seconds(best.step.step_s)} per step, "
            f"{best.tokens_per_s:,.0f} tokens/s on {cluster.world_size} GPUs")
    if fastest is best:
        return f"{head}, the fastest of the {len({e.layout for e in fitting})} layouts that fit."
    tie = (f"{head}. {_name(fastest)} is {1 - fastest.step.step_s / best.step.step_s:.2%} faster, within the "
           f"{TIE:.0%} the model cannot resolve")
    if best.step.inter_node_bytes == fastest.step.inter_node_bytes:
        return f"{tie}; with equal inter-node traffic the tie goes to less memory."
    smallest = best.layout.shard == min(e.layout.shard for e in fitting)
    which = " (here the smallest shard degree that fits)" if smallest else ""
    return (f"{tie}; ties go to the least inter-node traffic{which}: {_gb(best.step.inter_node_bytes)} against "
            f"{_gb(fastest.step.inter_node_bytes)} per node per step, the layout least hurt by a link slower "
            f"than modelled.")


def _memory_reason(best: LayoutEstimate, limit: float, model: ModelSpec, options: TrainOptions) -> str:
    m = best.memory
    per = options.precision.state_bytes_per_param
    limit_text = "no memory limit" if math.isinf(limit) else f"{format_bytes(limit)} usable"
    acts = f"activations {format_bytes(m.activations)}" if m.activations else "activations not estimated"
    params = format_count(model.params)
    if best.layout.tp > 1:
        split = _tp_state_split(best, model, options)
    elif best.shard_optimizer:
        kept = options.precision.param_bytes
        split = (f"{kept} B x {params} params / S={best.layout.shard} + {per - kept} B x {params} / "
                 f"(R x S)={best.optimizer_shards}")
    else:
        split = f"{per} B x {params} params / S={best.layout.shard}"
    refresh = f", after the step the all-gathers across replicas {format_bytes(m.refresh)}" if m.refresh else ""
    return (f"Memory: {format_bytes(m.total)} per GPU of {limit_text}: model state {format_bytes(m.state)} "
            f"({split}), {acts}, gathered units {format_bytes(m.unsharded)}{refresh}.")


def _tp_state_split(best: LayoutEstimate, model: ModelSpec, options: TrainOptions) -> str:
    """``16 B x 68.5B block params / (S x T)=8 + 16 B x 524M root params / S=4`` (and with the optimizer
    sharded across replicas, the parameter bytes and the rest apart)."""
    s, t, r = best.layout.shard, best.layout.tp, best.layout.replicate
    per, kept = options.precision.state_bytes_per_param, options.precision.param_bytes
    root = model.root.numel
    parts = [(model.params - root, "block", s * t, "(S x T)"),
             (root, "root", *((s * t, "(S x T)") if model.tensor_parallel_root else (s, "S")))]
    if not best.shard_optimizer:
        return " + ".join(f"{per} B x {format_count(n)} {what} params / {den}={d}" for n, what, d, den in parts)
    return " + ".join(f"{kept} B x {format_count(n)} {what} params / {den}={d} + {per - kept} B x "
                      f"{format_count(n)} / (R x {den})={d * r}" for n, what, d, den in parts)


def _shard_optimizer_reason(best: LayoutEstimate, alternatives: Sequence[LayoutEstimate],
                            limit: float) -> str | None:
    """Why the recommendation does (or does not) shard the optimizer across replicas, against the same
    layout's other variant."""
    other = next((a for a in alternatives if a.layout == best.layout), None)
    if other is None:
        return None
    plain, sliced = (other, best) if best.shard_optimizer else (best, other)
    r = best.layout.replicate
    memory = (f"model state {format_bytes(sliced.memory.state)} instead of {format_bytes(plain.memory.state)} "
              f"per GPU (gradients and optimizer state / R={r})")
    how = "a reduce-scatter across replicas, then an all-gather of the stepped slices in the parameter dtype"
    same = abs(sliced.step.inter_node_bytes / max(plain.step.inter_node_bytes, 1.0) - 1) < 0.005
    traffic = (f"the same inter-node traffic, {_gb(sliced.step.inter_node_bytes)} per node per step ({how})" if same
               else f"inter-node {_gb(sliced.step.inter_node_bytes)} instead of {_gb(plain.step.inter_node_bytes)} "
                    f"per node per step ({how})")
    delta = plain.step.step_s / sliced.step.step_s - 1
    if best.shard_optimizer:
        why = (f"without it this layout needs {format_bytes(plain.memory.total)}, over the "
               f"{format_bytes(limit)} usable" if not plain.fits
               else f"without it this layout is {delta:.1%} slower (the optimizer step covers 1/R of the elements), "
                    f"outside the {TIE:.0%} tie of the fastest")
        return (f"Optimizer sharded across replicas (ShardedModel(..., shard_optimizer_across_replicas=True); "
                f"hsdp train: parallel.shard_optimizer_across_replicas = true): {why}; {memory}; {traffic}.")
    if not sliced.fits:
        return None
    why = ("slower here" if delta < 0 else f"within the {TIE:.0%} tie, which goes to the least inter-node traffic, "
           f"then to the plainer setting")
    return (f"Sharding the optimizer across replicas too (shard_optimizer_across_replicas) would give "
            f"{memory}, {-delta:+.1%} step time and {traffic}; not used: {why}.")


def _traffic_reason(best: LayoutEstimate, cluster: ClusterSpec) -> str:
    s = best.step
    if cluster.nodes == 1 or s.inter_node_bytes == 0:
        return "Traffic: nothing crosses nodes in this layout."
    hop = ("the gradient reduce-scatter and the all-gather of the stepped slices across replicas"
           if best.shard_optimizer else "the gradient all-reduce")
    crossing = (f"only {hop} cross{'' if best.shard_optimizer else 'es'} nodes"
                if not spans_nodes(cluster, best.layout.shard, best.layout.tp)
                else "its shard groups span nodes, so all-gathers and reduce-scatters cross nodes too")
    link_s = s.inter_node_bytes / cluster.inter_bandwidth
    return (f"Traffic: {crossing}: {_gb(s.inter_node_bytes)} per node per step, "
            f"{format_seconds(link_s)} at {format_rate(cluster.inter_bandwidth)}; "
            f"{format_seconds(s.exposed_comm_s)} of communication is left exposed after overlap "
            f"(step {format_seconds(s.step_s)}, compute {format_seconds(s.compute_s)}).")


def _rejected_reason(estimates: Sequence[LayoutEstimate], limit: float) -> str | None:
    over = [e for e in estimates if not e.fits]
    if not over:
        return None
    names = ", ".join(f"{_degrees(e)} ({format_bytes(e.memory.total)})" for e in over)
    return f"Does not fit in {format_bytes(limit)}: {names}."


def _runner_up_reason(estimates: Sequence[LayoutEstimate], best: LayoutEstimate) -> str | None:
    others = sorted((e for e in estimates if e.fits and e is not best), key=lambda e: e.step.step_s)
    if not others:
        return None
    r = others[0]
    delta = r.step.step_s / best.step.step_s - 1
    traffic = f"{_gb(r.step.inter_node_bytes)} per node per step, {format_seconds(r.step.exposed_comm_s)} exposed"
    if delta <= TIE:  # a tie the recommendation won on traffic or memory: say what the runner-up offers
        saves = best.memory.total - r.memory.total
        memory = (f"saves {format_bytes(saves)} per GPU" if saves > 0
                  else f"needs {format_bytes(-saves)} more per GPU")
        more = r.step.inter_node_bytes > best.step.inter_node_bytes
        return (f"Runner-up: {_name(r)}, tied at {delta:+.2%} step time; it {memory}"
                f"{' but sends more across nodes' if more else ''} ({traffic}).")
    why = ("more inter-node traffic" if r.step.inter_node_bytes > best.step.inter_node_bytes * 1.05
           else "more exposed communication" if r.step.exposed_comm_s > best.step.exposed_comm_s
           else "a longer optimizer step" if r.step.optimizer_s > best.step.optimizer_s else "the same traffic")
    return f"Runner-up: {_name(r)}, {delta:+.0%} step time ({why}: {traffic})."


def _advice(best: LayoutEstimate, model: ModelSpec, cluster: ClusterSpec, options: TrainOptions) -> str | None:
    """When communication is a large part of the step, which inter-node hop dtype would shorten it (each
    estimated, not guessed: an int8 hop all-gathers, so its bytes grow with R and it can lose to bf16)."""
    s = best.step
    if s.exposed_comm_s < 0.15 * s.step_s or best.layout.replicate == 1:
        return None
    gains = []
    for dtype in ("bf16", "int8"):
        variant = replace(options, replicate_dtype=dtype, shard_optimizer_across_replicas=best.shard_optimizer,
                          micro_batches=best.micro_batches)
        if variant.replicate_bytes >= options.replicate_bytes and dtype != "int8":
            continue
        step = estimate_step(model, cluster, best.layout.shard, variant, tp=best.layout.tp).step_s
        if step < 0.95 * s.step_s:
            gains.append(f"--inter-node-dtype {dtype} ({step / s.step_s - 1:+.0%} step time)")
    if not gains:
        return None
    return f"Communication is {s.exposed_comm_s / s.step_s:.0%} of the step; consider {' or '.join(gains)}."


def _memory_fixes(model: ModelSpec, options: TrainOptions, tried_tp: bool) -> str:
    """What shrinks memory per GPU, naming only the flags that are not already at their smallest setting."""
    fixes = ["add nodes (a larger shard degree splits the model state further)"]
    if not tried_tp and model.hidden:
        fixes.append("try tensor parallelism (--tp auto: blocks and their activations split inside the node)")
    if not options.activation_checkpointing:
        fixes.append("use --activation-checkpointing")
    if model.micro_batch > 1:
        fixes.append(f"a smaller --micro-batch (now {model.micro_batch})")
    else:  # already one sequence: only shorter sequences shrink the activations further
        fixes.append(f"shorter sequences (--seq-len, now {model.seq_len}; the micro-batch is already 1)")
    if not options.reshard_after_forward:
        fixes.append("drop --no-reshard-after-forward")
    return ", ".join(fixes[:-1]) + " or " + fixes[-1]


def explain(estimates: Sequence[LayoutEstimate], best: LayoutEstimate | None, cluster: ClusterSpec,
            model: ModelSpec, options: TrainOptions, limit: float,
            alternatives: Sequence[LayoutEstimate] = ()) -> list[str]:
    """The recommendation's reasons, one sentence each."""
    tried_tp = any(e.layout.tp > 1 for e in estimates)
    if best is None:
        smallest = min(estimates, key=lambda e: e.memory.total)
        return [f"No layout fits: the smallest, {_name(smallest)}, needs {format_bytes(smallest.memory.total)} per "
                f"GPU against {format_bytes(limit)} usable; {_memory_fixes(model, options, tried_tp)}."]
    lines = [_recommended_reason([*estimates, *alternatives], best, cluster),
             _memory_reason(best, limit, model, options),
             _traffic_reason(best, cluster)]
    lines += [x for x in (tp_reason(best, [*estimates, *alternatives], model, cluster),
                          _shard_optimizer_reason(best, alternatives, limit)) if x]
    lines += [x for x in (_runner_up_reason(estimates, best), _rejected_reason(estimates, limit),
                          _advice(best, model, cluster, options)) if x]
    return lines
