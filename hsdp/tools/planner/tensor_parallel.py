"""Tensor parallelism (TP) in the cost model: the grid's rules, the TP-local model a rank holds, and the
activation traffic TP adds to every block.

A layout is ``R x S x T`` ranks, rank ``(r x S + s) x T + t``: the ``T`` ranks of a TP group are adjacent,
inside one node (its fastest links), as ``init_mesh(sharding_degree=S, tensor_parallel_degree=T)`` lays
them out. Rules (:func:`check_layout`): with ``T > 1``, ``T`` divides the ranks per node and the ``S x T``
ranks of a replica tile the nodes: ``S x T`` divides the ranks per node (shard groups inside a node) or is a
multiple of them (shard groups spanning whole nodes, ``init_mesh(..., allow_cross_node_shards=True)``: their
all-gathers and reduce-scatters cross nodes, as at ``T = 1`` with ``S`` > ranks per node, while TP stays
inside the node); replicas that would straddle nodes partially are not considered. ``R = world / (S x T)``.
The ``T`` ranks of one data-parallel rank read the same micro-batch: the data-parallel size is ``R x S``.

What the planner assumes (Megatron-style TP with sequence parallel, torchtitan's Llama recipe):

* **Parameters.** In every block each matrix (a parameter with more than one element per row) is split
  ``T`` ways: column-parallel q/k/v, gate and up projections, row-parallel output and down projections;
  the planner cannot tell the two apart, so it counts a TP-local ``ceil(rows / T)`` rows (the padding of
  the shard group's dim-0 chunks may differ by a row). Vectors (norm weights, biases) stay whole on every
  TP rank. The root unit (embeddings, final norm, LM head) stays whole on every TP rank unless
  ``ModelSpec.tensor_parallel_root``. The shard group then splits each TP-local tensor in dim-0 chunks,
  FSDP2's 2-D composition: block state per rank ``16 P / (S x T)``, root ``16 P / S``.
* **Activations.** With sequence parallel every block activation is split ``T`` ways (the TP'd matmuls by
  heads and width, norms and residuals by sequence); the root's stay whole unless the root is TP'd.
* **Compute.** Block FLOPs / ``T``; a whole root is computed by every TP rank.
* **TP traffic.** Per block and micro-batch, forward two all-gathers and two reduce-scatters of the
  activation (``micro_batch x seq_len x hidden`` at the compute dtype: the bytes of two all-reduces),
  backward the same; a recomputed forward (activation checkpointing) repeats its share. The root adds one
  per direction (the all-gather of the last block's sequence shards for a whole head), two when it is TP'd.
  They are on the critical path: each waits for the matmul before it and the next waits for it, so they
  are added to compute, never overlapped.
* **Data-parallel traffic.** Shard and replicate groups carry the TP-local units: ``P / (S x T)`` per rank
  for blocks. A whole root is reduced by each of the ``T`` ranks, so its inter-node bytes count ``T`` times.
  With ``S x T`` > ranks per node each of the ``T`` shard rings of a replica spans its nodes: the node sends
  what a ``T = 1`` layout with shard groups over the same nodes sends for the TP-local model.

Not modelled: the TP all-reduce of the whole norm weights' gradients (tiny), and contention between TP and
shard-group collectives on the intra-node links.
"""

from __future__ import annotations

from dataclasses import replace

from hsdp.tools.planner.cluster import ClusterSpec
from hsdp.tools.planner.comm import GroupLinks, collective_seconds, rank_bytes
from hsdp.tools.planner.model import ComputeProfile, ModelSpec, Shape, UnitSpec
from hsdp.tools.planner.options import TrainOptions

BLOCK_COLLECTIVES = 4  # per block and direction: 2 all-gathers + 2 reduce-scatters (sequence parallel)


def tp_degrees(cluster: ClusterSpec) -> list[int]:
    """Every TP degree the grid accepts: the divisors of the ranks per node."""
    g = cluster.gpus_per_node
    return [t for t in range(1, g + 1) if g % t == 0]


def shard_degrees(cluster: ClusterSpec, tp: int) -> list[int]:
    """Shard degrees valid with ``tp``: every divisor of the world at ``T = 1``, else every ``S`` whose
    ``S x T`` divides the world and tiles nodes (divides the ranks per node, or is a multiple of them)."""
    w = cluster.world_size
    return [s for s in range(1, w // tp + 1) if w % (s * tp) == 0 and (tp == 1 or tiles_nodes(cluster, s * tp))]


def tiles_nodes(cluster: ClusterSpec, ranks: int) -> bool:
    """Whether groups of ``ranks`` consecutive ranks each lie inside one node or span whole nodes."""
    g = cluster.gpus_per_node
    return g % ranks == 0 or ranks % g == 0


def spans_nodes(cluster: ClusterSpec, shard: int, tp: int) -> bool:
    """Whether a replica's ``S x T`` ranks (its shard groups) span several nodes: the engine then needs
    ``init_mesh(..., allow_cross_node_shards=True)``."""
    return shard * tp > cluster.gpus_per_node


def check_layout(cluster: ClusterSpec, shard: int, tp: int) -> None:
    """``ValueError`` naming the fix when ``(S, T)`` is not a layout of ``cluster``."""
    g, w = cluster.gpus_per_node, cluster.world_size
    if tp < 1 or g % tp:
        raise ValueError(f"tensor_parallel_degree T={tp} does not divide the {g} ranks per node: TP groups stay "
                         f"inside a node, on its fastest links; choose T from {tp_degrees(cluster)}")
    if shard < 1 or w % (shard * tp):
        raise ValueError(f"S x T = {shard} x {tp} does not divide the world size {w}: choose S from "
                         f"{shard_degrees(cluster, tp)}")
    if tp > 1 and not tiles_nodes(cluster, shard * tp):
        # A replica straddling nodes partially puts uneven shares of its rings on the slow links: left out,
        # an S aligned to nodes is the layout to run.
        raise ValueError(f"S x T = {shard} x {tp} = {shard * tp} neither divides nor is a multiple of the {g} "
                         f"ranks per node, so shard groups would straddle nodes partially: choose S from "
                         f"{shard_degrees(cluster, tp)}")


def _split(shapes: tuple[Shape, ...], tp: int) -> tuple[Shape, ...]:
    return tuple((-(-r // tp), c) if c > 1 else (r, c) for r, c in shapes)


def _local_unit(u: UnitSpec, tp: int) -> UnitSpec:
    return UnitSpec(u.name, _split(u.shapes, tp), u.forward_flops_per_token / tp, _split(u.frozen, tp))


def local_model(model: ModelSpec, tp: int) -> ModelSpec:
    """The model one TP rank holds and computes (see the module docstring); ``tp=1``: ``model`` itself."""
    if tp == 1:
        return model
    if model.hidden < 1:
        raise ValueError(f"tensor parallelism needs the model's hidden size (ModelSpec.hidden) for its traffic; "
                         f"{model.name!r} has none: use a preset or --layers/--hidden, or T=1")
    root = _local_unit(model.root, tp) if model.tensor_parallel_root else model.root
    units = (root, *[_local_unit(u, tp) for u in model.blocks])
    return replace(model, units=units, activation_elements=_local_activations(model, model.activation_elements, tp),
                   checkpoint_elements=_local_activations(model, model.checkpoint_elements, tp),
                   root_activation_elements=_root_activations(model, tp))


def _root_activations(model: ModelSpec, tp: int) -> float:
    return model.root_activation_elements / (tp if model.tensor_parallel_root else 1)


def _local_activations(model: ModelSpec, elements: float, tp: int) -> float:
    # Sequence parallel: every block activation / T; the root's whole unless it is TP'd.
    return (elements - model.root_activation_elements) / tp + _root_activations(model, tp)


def local_profile(profile: ComputeProfile | None, model: ModelSpec, tp: int) -> ComputeProfile | None:
    """A profile measured at ``T = 1`` scaled to one TP rank: compute by the FLOPs it keeps, activation bytes
    by the activations it keeps (``1/T`` when the model has no activation estimate)."""
    if profile is None or tp == 1:
        return profile
    local = local_model(model, tp)
    flops = local.forward_flops() / model.forward_flops() if model.forward_flops() else 1.0 / tp
    acts = (local.activation_elements / model.activation_elements) if model.activation_elements else 1.0 / tp
    return ComputeProfile(profile.forward_s * flops, profile.backward_s * flops, profile.optimizer_s_per_element,
                          None if profile.activation_bytes is None else profile.activation_bytes * acts)


def _tp_links(tp: int) -> GroupLinks:
    return GroupLinks(tp, crosses_nodes=False, has_intra=True, node_out_edges=0)


def activation_bytes(model: ModelSpec, options: TrainOptions) -> float:
    """Bytes of one TP collective's buffer: the micro-batch's activation between layers."""
    return model.tokens * model.hidden * options.precision.compute_bytes


def tp_collectives(model: ModelSpec, options: TrainOptions, unit: UnitSpec) -> tuple[int, int]:
    """(forward, backward) TP collectives of ``unit`` per micro-batch; a recomputed forward adds its own."""
    if unit is model.root:
        n = 2 if model.tensor_parallel_root else 1
        return n, n
    return BLOCK_COLLECTIVES, BLOCK_COLLECTIVES * (2 if options.activation_checkpointing else 1)


def tp_collective_s(model: ModelSpec, cluster: ClusterSpec, options: TrainOptions, tp: int) -> float:
    """Seconds of one TP all-gather or reduce-scatter (equal on a ring; 0 at ``T = 1``)."""
    if tp == 1:
        return 0.0
    return collective_seconds(_tp_links(tp), cluster, "all_gather", activation_bytes(model, options))


def tp_rank_bytes(model: ModelSpec, cluster: ClusterSpec, options: TrainOptions, tp: int) -> float:
    """Bytes one rank sends to its TP neighbour in one collective: ``(T-1)/T`` of the activation."""
    return rank_bytes(_tp_links(tp), cluster, "all_gather", activation_bytes(model, options)) if tp > 1 else 0.0
