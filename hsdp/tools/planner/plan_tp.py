"""The plan's sentence about tensor parallelism: why the recommendation uses TP, or why it does not."""

from __future__ import annotations

from collections.abc import Sequence

from hsdp.tools.planner.cluster import ClusterSpec
from hsdp.tools.planner.estimate import LayoutEstimate
from hsdp.tools.planner.model import ModelSpec
from hsdp.tools.planner.tensor_parallel import spans_nodes
from hsdp.tools.quantities import format_bytes, format_seconds


def _label(e: LayoutEstimate) -> str:
    t = f", T={e.layout.tp}" if e.layout.tp > 1 else ""
    return f"{e.layout.label} (S={e.layout.shard}{t})"


def _against_plain(best: LayoutEstimate, estimates: Sequence[LayoutEstimate]) -> str:
    plain = [e for e in estimates if e.layout.tp == 1]
    fitting = [e for e in plain if e.fits]
    if fitting:
        fastest = min(fitting, key=lambda e: e.step.step_s)
        return (f"the fastest layout without TP, {_label(fastest)}, takes "
                f"{fastest.step.step_s / best.step.step_s - 1:+.1%} step time")
    if not plain:
        return "layouts without TP were not estimated"
    smallest = min(plain, key=lambda e: e.memory.total)
    return f"no layout fits without TP (the smallest, {_label(smallest)}, needs {format_bytes(smallest.memory.total)})"


def init_mesh_call(shard: int, tp: int, cluster: ClusterSpec) -> str:
    """The engine call that builds the ``R x S x T`` mesh: shard groups spanning nodes must be allowed."""
    cross = ", allow_cross_node_shards=True" if spans_nodes(cluster, shard, tp) else ""
    return f"hsdp.init_mesh(sharding_degree={shard}, tensor_parallel_degree={tp}{cross})"


def tp_reason(best: LayoutEstimate, estimates: Sequence[LayoutEstimate], model: ModelSpec,
              cluster: ClusterSpec) -> str | None:
    """One sentence on TP when the plan considered T > 1 (``None`` otherwise)."""
    tp_layouts = [e for e in estimates if e.layout.tp > 1]
    if best.layout.tp > 1:
        s, t = best.layout.shard, best.layout.tp
        return (f"Tensor parallel T={t} ({init_mesh_call(s, t, cluster)}, the blocks "
                f"parallelized with parallelize_module and hsdp.tp_plans, then hsdp.ShardedModel): block state, "
                f"gathered blocks and activations split {t} ways; {format_seconds(best.step.tp_comm_s)} per step "
                f"of TP collectives inside the node, on the critical path; each of the "
                f"{best.layout.data_parallel_size} data-parallel ranks runs {best.micro_batches} micro-batches of "
                f"{model.micro_batch} (the global batch of {best.global_batch} sequences held); "
                f"{_against_plain(best, estimates)}.")
    if not tp_layouts:
        return None
    fitting = [e for e in tp_layouts if e.fits]
    if not fitting:
        return "Tensor parallelism does not help here: no T > 1 layout fits."
    r = min(fitting, key=lambda e: e.step.step_s)
    return (f"Tensor parallelism does not pay here: the fastest T > 1 layout, {_label(r)}, takes "
            f"{r.step.step_s / best.step.step_s - 1:+.1%} step time ({format_seconds(r.step.tp_comm_s)} of TP "
            f"collectives per step, not overlapped).")
