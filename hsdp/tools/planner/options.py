"""Training options that change memory or traffic: precision, micro-batches and hsdp's performance features.

Each field maps to one engine setting, so a plan can be followed literally:

| option | engine |
|---|---|
| ``precision.compute_bytes`` | ``MixedPrecision(param_dtype=...)``: all-gather and activations |
| ``precision.reduce_bytes`` | ``MixedPrecision(reduce_dtype=...)``: the intra-node reduce-scatter |
| ``replicate_dtype`` | ``replica_hop=AllReduceHop(torch.bfloat16)`` / ``Int8ErrorFeedbackHop()`` |
| ``reshard_after_forward`` | ``ShardedModel(..., reshard_after_forward=...)`` |
| ``sync="deferred"`` | ``with model.no_sync():`` on all but the last micro-batch |
| ``sync="local"`` | ``model.set_requires_gradient_sync(False)`` on all but the last micro-batch |
| ``activation_checkpointing`` | ``torch.utils.checkpoint`` around each block |
| ``shard_optimizer_across_replicas`` | ``ShardedModel(..., shard_optimizer_across_replicas=True)`` |
| ``inter_node_hop=False`` | ``ShardedModel(..., replica_sync=hsdp.DiLoCo(...))``: its inner steps (``diloco.py``) |
"""

from __future__ import annotations

from dataclasses import dataclass

from hsdp.engine.replicate.combinations import Feature, refused

SYNC_MODES = ("deferred", "every", "local")
REPLICATE_DTYPES = ("same", "fp32", "bf16", "int8")
INT8_BLOCK = 256  # Int8ErrorFeedbackHop's default block: one fp32 scale per 256 int8 values


@dataclass(frozen=True)
class Precision:
    """Bytes per element of each copy of the model a rank holds or sends.

    ``param_bytes``/``grad_bytes``: the sharded parameters and gradients; ``master_bytes``: a separate
    master copy (0 when the sharded parameters are the master, as in hsdp); ``optimizer_bytes``: optimizer
    state (AdamW: two fp32 moments = 8); ``compute_bytes``: all-gathered parameters, activations;
    ``reduce_bytes``: the reduce-scatter's wire dtype. The state per parameter is the sum of the first four:
    16 for every preset here, the ``16P`` of the closed forms.
    """

    name: str
    param_bytes: int = 4
    grad_bytes: int = 4
    master_bytes: int = 0
    optimizer_bytes: int = 8
    compute_bytes: int = 4
    reduce_bytes: int = 4

    @property
    def state_bytes_per_param(self) -> int:
        return self.param_bytes + self.grad_bytes + self.master_bytes + self.optimizer_bytes


PRECISIONS: dict[str, Precision] = {
    # hsdp defaults: fp32 everywhere.
    "fp32": Precision("fp32"),
    # hsdp MixedPrecision(param_dtype=bf16): fp32 shards are the master; gathers and reductions in bf16.
    "bf16": Precision("bf16", compute_bytes=2, reduce_bytes=2),
    # bf16 compute with fp32 reductions (MixedPrecision(param_dtype=bf16, reduce_dtype=fp32)).
    "bf16-fp32-reduce": Precision("bf16-fp32-reduce", compute_bytes=2, reduce_bytes=4),
    # The textbook accounting (ZeRO paper): bf16 params and grads, fp32 master and Adam = 2+2+4+8.
    "bf16-master": Precision("bf16-master", param_bytes=2, grad_bytes=2, master_bytes=4, compute_bytes=2,
                             reduce_bytes=2),
}


def precision(name: str) -> Precision:
    if name not in PRECISIONS:
        raise ValueError(f"unknown precision {name!r}: choose one of {sorted(PRECISIONS)}")
    return PRECISIONS[name]


@dataclass(frozen=True)
class TrainOptions:
    """How one optimizer step runs: ``micro_batches`` forward/backward passes, then one optimizer step.

    ``sync``: ``"deferred"`` reduce-scatters every micro-batch and crosses nodes once per step (hsdp's
    ``no_sync``: the inter-node floor, plus an fp32 partial sum of P/S); ``"every"`` crosses nodes every
    micro-batch (what torchtitan does); ``"local"`` communicates nothing until the last micro-batch and
    keeps fp32 unsharded gradient sums (least traffic, 4 bytes x P more memory per rank).
    ``replicate_dtype``: the inter-node hop's dtype (``"same"``: the reduce dtype).
    ``shard_optimizer_across_replicas``: gradients, optimizer state (and a master copy) sharded over all
    R x S ranks, parameters still over S; the inter-node all-reduce becomes a reduce-scatter (hop dtype)
    plus, after the step, an all-gather of the stepped slices in the *parameter* dtype. It changes nothing
    when R = 1. With the int8 hop the reduce-scatter is an all-to-all of int8 blocks (``1 + 4/256`` bytes per
    element, whatever R).
    ``inter_node_hop=False``: no gradient hop across replicas at all (DiLoCo's inner steps, whose replicas sync
    their weights every H steps instead: :mod:`hsdp.tools.planner.diloco`).
    """

    precision: Precision = PRECISIONS["fp32"]
    micro_batches: int = 1
    reshard_after_forward: bool = True
    replicate_dtype: str = "same"
    sync: str = "deferred"
    prefetch: bool = True
    activation_checkpointing: bool = False
    shard_optimizer_across_replicas: bool = False
    inter_node_hop: bool = True

    def __post_init__(self) -> None:
        if self.micro_batches < 1:
            raise ValueError(f"micro_batches={self.micro_batches} must be at least 1")
        if self.sync not in SYNC_MODES:
            raise ValueError(f"sync={self.sync!r}: choose one of {SYNC_MODES}")
        if self.replicate_dtype not in REPLICATE_DTYPES:
            raise ValueError(f"replicate_dtype={self.replicate_dtype!r}: choose one of {REPLICATE_DTYPES}")
        # The pairs refused by the one table of combinations (hsdp/engine/replicate/combinations.py).
        if self.shard_optimizer_across_replicas and not self.inter_node_hop \
                and refused(Feature.SLICED_OPTIMIZER, Feature.DILOCO):
            raise ValueError("without an inter-node hop (DiLoCo) each replica steps its own whole optimizer state: "
                             "turn shard_optimizer_across_replicas off")

    def shards_optimizer(self, replicate: int) -> bool:
        """Whether the option is in effect on a layout with ``replicate`` replicas (R = 1: nothing to split)."""
        return self.shard_optimizer_across_replicas and replicate > 1

    @property
    def replicate_bytes(self) -> float:
        """Wire bytes per gradient element of the inter-node hop (int8: payload plus one scale per block)."""
        return {"same": float(self.precision.reduce_bytes), "fp32": 4.0, "bf16": 2.0,
                "int8": 1.0 + 4.0 / INT8_BLOCK}[self.replicate_dtype]

    def syncs_replicas(self, micro_batch: int) -> bool:
        """Does micro-batch ``micro_batch`` (0-based) run the inter-node hop?"""
        return self.inter_node_hop and (self.sync == "every" or micro_batch == self.micro_batches - 1)

    def reduces_shards(self, micro_batch: int) -> bool:
        """Does micro-batch ``micro_batch`` reduce-scatter inside the node?"""
        return self.sync != "local" or micro_batch == self.micro_batches - 1


@dataclass(frozen=True)
class Layout:
    """``replicate`` x ``shard`` x ``tp`` ranks: the mesh ``init_mesh(sharding_degree=shard,
    tensor_parallel_degree=tp)`` builds (TP ranks adjacent, inside a node; ``allow_cross_node_shards=True``
    when ``shard x tp`` exceeds the ranks per node)."""

    replicate: int
    shard: int
    tp: int = 1

    @property
    def world_size(self) -> int:
        return self.replicate * self.shard * self.tp

    @property
    def data_parallel_size(self) -> int:
        """Ranks that read different batches, ``R x S``: the ``T`` ranks of a TP group read the same one."""
        return self.replicate * self.shard

    @property
    def label(self) -> str:
        """``16x8`` (R x S), or ``16x4x2`` (R x S x T) with tensor parallelism."""
        return f"{self.replicate}x{self.shard}" + (f"x{self.tp}" if self.tp > 1 else "")

    def kind(self, gpus_per_node: int) -> str:
        """Plain words for the layout: DDP, HSDP (shard group vs node), full shard; ``+ TP`` with T > 1."""
        if self.tp > 1:
            return self._tp_kind(gpus_per_node)
        if self.shard == 1:
            return "DDP"
        if self.replicate == 1:
            return "full shard"
        if self.shard == gpus_per_node:
            return "HSDP, shard = node"
        return "HSDP, shard < node" if self.shard < gpus_per_node else "HSDP, shard > node"

    def _tp_kind(self, gpus_per_node: int) -> str:
        if self.shard == 1:
            return "DDP + TP"
        if self.replicate == 1:
            return "full shard + TP"
        span = self.shard * self.tp
        if span > gpus_per_node:  # shard groups span whole nodes, like "HSDP, shard > node"
            return "HSDP + TP, shard > node"
        return "HSDP + TP, S x T " + ("= node" if span == gpus_per_node else "< node")
