"""The typed configuration of ``hsdp train``: one frozen dataclass per TOML section.

Every field has a default, so ``hsdp train`` runs with no configuration at all. Each section validates
itself on construction and raises ``ValueError`` naming the field as it is written in TOML or on the
command line (``train.steps = 0: must be at least 1``) and how to fix it. Reading TOML files and
``section.field=value`` overrides lives in :mod:`hsdp.apps.train.config_io`.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, ClassVar

from hsdp.apps.train.config_replica_sync import check_parallel
from hsdp.apps.train.config_rules import at_least as _at_least
from hsdp.apps.train.config_rules import fail as _fail
from hsdp.apps.train.config_rules import one_of as _one_of
from hsdp.engine.replicate.combinations import SPELLINGS, Feature, first_refused, reason

if TYPE_CHECKING:
    from hsdp.models import GPTConfig

TOKENIZERS = ("auto", "byte", "char")
DATA_FORMATS = ("auto", "text", "jsonl", "parquet", "dataset")
HF_FOLDER_KIND = "hf"  # model.kind whose model, tokenizer and vocabulary come from the folder model.path
PRECISIONS = ("fp32", "bf16")
WANDB_MODES = ("online", "offline")
BATCH_WEIGHT_MODES = ("even", "auto")
DEFAULT_OUT_DIR = "runs/train"
STDLIB = "stdlib"


@dataclass(frozen=True)
class ModelConfig:
    """What to train. ``kind``: ``gpt`` (hsdp's own GPT), ``hf-gpt2`` (Hugging Face ``GPT2LMHeadModel`` of the
    preset's shape, random weights; needs the ``hf`` extra) or ``hf`` (any local Hugging Face causal-LM folder
    ``path``: its ``config.json``, its weights when it holds ``model.safetensors`` or an index, else random
    weights from its initialiser, and its own tokenizer; needs the ``hf`` extra). ``preset`` names a shape of
    :data:`hsdp.models.PRESETS` (``tiny`` ... ``gpt-1b``) for ``gpt`` and ``hf-gpt2``, whose vocabulary is
    replaced by the tokenizer's; ``hf`` ignores it. ``block_size`` 0 keeps the preset's context length (for
    ``hf``: the folder's ``max_position_embeddings``, at most 1024). ``dropout`` applies to ``gpt`` and
    ``hf-gpt2``; an ``hf`` folder keeps the dropout of its ``config.json``. ``path`` is made absolute, so the
    saved configuration (resume, ``hsdp export``) finds the folder from any directory."""

    SECTION: ClassVar[str] = "model"
    preset: str = "tiny"
    kind: str = "gpt"
    block_size: int = 0
    dropout: float = 0.0
    path: str = ""

    def __post_init__(self) -> None:
        # Deferred: both import torch, and configs load without it (`hsdp train --help` stays fast).
        from hsdp.apps.train.lm import LANGUAGE_MODELS
        from hsdp.models import PRESETS

        _one_of(self.SECTION, "preset", self.preset, tuple(sorted(PRESETS)))
        _one_of(self.SECTION, "kind", self.kind, tuple(LANGUAGE_MODELS))
        _at_least(self.SECTION, self, ("block_size",), 0)
        if not 0.0 <= self.dropout < 1.0:
            _fail(self.SECTION, "dropout", self.dropout, "must lie in [0, 1)")
        self._check_path()

    def _check_path(self) -> None:
        if self.kind != HF_FOLDER_KIND:
            if self.path:
                _fail(self.SECTION, "path", self.path, f"is read only with model.kind = {HF_FOLDER_KIND!r}: set "
                                                       f"model.kind = {HF_FOLDER_KIND!r}, or drop model.path")
            return
        if not self.path:
            _fail(self.SECTION, "path", self.path, "model.kind = 'hf' trains a local Hugging Face model folder: "
                                                   "set model.path = DIR (with config.json and a tokenizer)")
        if self.dropout:
            _fail(self.SECTION, "dropout", self.dropout, "model.kind = 'hf' keeps the dropout of the folder's "
                                                         "config.json: set it there, and model.dropout = 0")
        object.__setattr__(self, "path", os.path.abspath(os.path.expanduser(self.path)))

    def shape(self, vocab_size: int) -> GPTConfig:
        """The preset's shape with the tokenizer's vocabulary and the configured context and dropout."""
        from hsdp.models import preset  # torch import deferred, as above

        base = preset(self.preset)
        return dataclasses.replace(base, vocab_size=vocab_size, block_size=self.block_size or base.block_size,
                                   dropout=self.dropout)


@dataclass(frozen=True)
class DataConfig:
    """Where the text comes from. ``source``: ``stdlib`` (the Python standard library's sources, present on
    every machine), a text file, a folder (every file whose name ends in one of ``extensions``, sorted), a
    ``.jsonl`` file with a ``text_field`` per line, a ``.parquet`` file or a folder of them (column
    ``text_field``; needs ``pyarrow``), or a ``datasets`` directory (``save_to_disk``; needs the ``datasets``
    package). ``format`` ``auto`` tells these apart by the path (a folder holding ``.parquet`` files is
    parquet). The first ``max_bytes`` bytes of text are used; the last ``eval_fraction`` of the tokens is held
    out for evaluation. ``tokenizer``: ``auto`` is the model folder's own for ``model.kind = "hf"`` (each
    document, i.e. file or record, ends with its end-of-text token) and bytes otherwise; ``byte`` (vocabulary
    256) or ``char`` (the corpus's distinct characters) for the other kinds."""

    SECTION: ClassVar[str] = "data"
    source: str = STDLIB
    format: str = "auto"
    tokenizer: str = "auto"
    max_bytes: int = 2_000_000
    eval_fraction: float = 0.05
    text_field: str = "text"
    extensions: tuple[str, ...] = (".py", ".txt", ".md", ".rst")

    def __post_init__(self) -> None:
        if not self.source:
            _fail(self.SECTION, "source", self.source, f"name a file or folder, or {STDLIB!r}")
        _one_of(self.SECTION, "format", self.format, DATA_FORMATS)
        _one_of(self.SECTION, "tokenizer", self.tokenizer, TOKENIZERS)
        _at_least(self.SECTION, self, ("max_bytes",), 1)
        if not 0.0 < self.eval_fraction < 1.0:
            _fail(self.SECTION, "eval_fraction", self.eval_fraction, "must lie in (0, 1), e.g. 0.05")
        if not self.extensions:
            _fail(self.SECTION, "extensions", list(self.extensions), 'list at least one, e.g. [".txt"]')


@dataclass(frozen=True)
class OptimConfig:
    """AdamW with linear warm-up then cosine decay from ``lr`` to ``min_lr`` at the last step (a warm-up
    longer than the run is cut to the run). Weight decay applies to matrices only (not biases, norms).
    ``grad_clip`` 0 disables clipping."""

    SECTION: ClassVar[str] = "optim"
    lr: float = 2e-3
    min_lr: float = 2e-4
    warmup_steps: int = 20
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0

    def __post_init__(self) -> None:
        _at_least(self.SECTION, self, ("min_lr", "warmup_steps", "weight_decay", "grad_clip"), 0)
        if self.lr <= 0:
            _fail(self.SECTION, "lr", self.lr, "must be positive, e.g. 3e-4")
        if self.min_lr > self.lr:
            _fail(self.SECTION, "min_lr", self.min_lr, f"must not exceed optim.lr = {self.lr}")
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                _fail(self.SECTION, name, getattr(self, name), "must lie in [0, 1)")


@dataclass(frozen=True)
class TrainConfig:
    """The loop. ``batch_size`` is sequences per rank and micro-batch; ``grad_accum`` micro-batches make a
    step (the inter-node hop runs once per step). Every ``eval_every`` steps the held-out loss is measured
    on ``eval_batches`` batches per rank, every ``checkpoint_every`` steps a checkpoint is saved (the
    newest ``keep_checkpoints`` are kept; one more at the last step); 0 disables either. ``stop_after`` N
    ends the job after step N as an interruption would (the schedule still plans for ``steps``; continue
    with ``--resume``). ``profile`` records ``profile_steps`` steps with ``torch.profiler``. With
    ``save_on_signal`` a SIGTERM (preemption) ends the job after the current step with a checkpoint there
    and exit status 143; false leaves SIGTERM's default (the process dies at once)."""

    SECTION: ClassVar[str] = "train"
    steps: int = 300
    batch_size: int = 8
    grad_accum: int = 1
    seed: int = 0
    out_dir: str = DEFAULT_OUT_DIR
    resume: bool = False
    log_every: int = 10
    eval_every: int = 100
    eval_batches: int = 4
    checkpoint_every: int = 100
    keep_checkpoints: int = 3
    stop_after: int = 0
    sample_tokens: int = 200
    sample_prompt: str = "def "
    profile: bool = False
    profile_steps: int = 3
    save_on_signal: bool = True

    def __post_init__(self) -> None:
        _at_least(self.SECTION, self, ("steps", "batch_size", "grad_accum", "log_every", "eval_batches",
                                       "keep_checkpoints", "profile_steps"), 1)
        _at_least(self.SECTION, self, ("seed", "eval_every", "checkpoint_every", "stop_after",
                                       "sample_tokens"), 0)
        if not self.out_dir:
            _fail(self.SECTION, "out_dir", self.out_dir, f"name a directory, e.g. {DEFAULT_OUT_DIR!r}")
        if self.sample_tokens and not self.sample_prompt:
            _fail(self.SECTION, "sample_prompt", self.sample_prompt, "give a prompt, or set train.sample_tokens = 0")


@dataclass(frozen=True)
class ParallelConfig:
    """How the ranks are laid out. ``nodes`` x ``nproc_per_node`` are the processes ``hsdp train`` starts
    itself (emulated nodes on this machine) when it is not already running under torchrun or ``hsdp
    launch``. ``sharding_degree`` 0 means the ranks per node (HSDP); 1 is DDP, the world size full
    sharding. ``mixed_precision`` ``bf16`` computes and reduces in bfloat16 over fp32 master shards;
    ``replica_hop`` picks the inter-node gradient hop (``int8`` compresses with error feedback).
    ``shard_optimizer_across_replicas`` splits gradients and AdamW state over all R x S ranks (parameters stay split
    over S): optimizer state and step / R, the same inter-node bytes with an fp32 hop (with a bf16 hop the
    all-gather after the step stays fp32: 1.5x; with the int8 hop the reduce-scatter is int8 blocks with error
    feedback, the all-gather fp32). No effect with one replica. ``tensor_parallel`` T > 1 also splits each block's
    layers over T adjacent ranks of a node (Megatron-style, with sequence parallel norms: :mod:`hsdp.tp_plans`) on
    an R x S x T mesh; the T ranks read the same batch (R x S data-parallel readers). T must divide
    ``nproc_per_node`` and ``sharding_degree`` x T fit in a node (``sharding_degree`` 0 then means
    ``nproc_per_node`` / T); only for hsdp's GPT (``model.kind = "gpt"``), with a context divisible by T.
    Which of these combine (elastic, DiLoCo, lists of degrees, the hops, the replica-sharded optimizer, batch
    weights) is the one table's: ``hsdp.engine.replicate.combinations``.

    Heterogeneous clusters: ``sharding_degree`` may be a list, one degree per replica in rank order
    (``[8, 4, 4]``: a replica of 8 ranks, then two of 4; their sum is the world), passed as it is to
    ``hsdp.init_mesh``. ``batch_weights`` splits each micro-batch's global batch (``train.batch_size`` x the
    data-parallel ranks, the even split's) by ``hsdp.distributed_sampler``: ``"even"`` (default) keeps the
    plain per-rank stream; a list gives one positive weight per data-parallel rank or per replica (a faster
    rank reads more sequences of the same global batch, and its gradient counts as many: the training math
    is the even split's); ``"auto"`` runs the first ``CALIBRATION_STEPS`` steps at the even split, timing each
    rank's busy seconds (its step less the time it waited in collectives; CPU ranks, where a wait blocks),
    then weights each rank by 1 / its median (:func:`hsdp.tools.planner.balance.balanced_weights`), logged
    and saved in ``summary.json``.

    ``elastic``: this torchrun job is one replica of an elastic job (``hsdp.init_mesh(elastic=True)``, rules in
    :mod:`hsdp.apps.train.elastic_run`): replicas leave and rejoin between steps; start it with ``hsdp launch
    --elastic -- -m hsdp.apps.train parallel.elastic=true``. Each replica is sharded over its own job's ranks
    (``sharding_degree`` 0 or that count, divided by ``tensor_parallel``); a list of batch weights splits every
    configured replica's data as above, and a step's gradient weighs its members' pieces only (a replica that is
    absent reads nothing and weighs nothing). Replicas of different degrees are nodes of different rank counts
    (``hsdp launch --elastic --nproc-per-node 2,1,1``, which declares them to the coordinator); a list of
    degrees then names them (per replica id), checked against the coordinator's declaration. The
    replica-sharded optimizer and ``batch_weights = "auto"`` (its calibration gathers over every rank) are
    refused with it.
    ``replica_sync``: ``"every_step"`` (the hop above) or ``"diloco"`` (weights synced every ``diloco_every``
    steps, not DDP's math; its options and refusals: :mod:`hsdp.apps.train.replica_sync`)."""

    SECTION: ClassVar[str] = "parallel"
    nodes: int = 2
    nproc_per_node: int = 2
    sharding_degree: int | tuple[int, ...] = 0
    mixed_precision: str = "fp32"
    replica_hop: str = "fp32"
    reshard_after_forward: bool = True
    shard_optimizer_across_replicas: bool = False
    tensor_parallel: int = 1
    batch_weights: str | tuple[float, ...] = "even"
    elastic: bool = False
    replica_sync: str = "every_step"
    diloco_every: int = 40
    diloco_outer_lr: float = 0.7
    diloco_outer_momentum: float = 0.9
    diloco_wire_dtype: str = "fp32"
    diloco_fragments: int = 1
    diloco_delay: int = 0
    diloco_mix: float = 0.0

    def __post_init__(self) -> None:
        from hsdp.engine.hops import HOP_NAMES  # torch import deferred, as above

        _at_least(self.SECTION, self, ("nodes", "nproc_per_node", "tensor_parallel"), 1)
        self._check_degrees()
        self._check_batch_weights()
        _one_of(self.SECTION, "mixed_precision", self.mixed_precision, PRECISIONS)
        _one_of(self.SECTION, "replica_hop", self.replica_hop, HOP_NAMES)
        self._check_combinations()
        if self.elastic and self.batch_weights == "auto":
            _fail(self.SECTION, "batch_weights", "auto", "not with parallel.elastic = true: the calibration gathers "
                                                         "every rank's busy seconds, and an elastic replica's ranks "
                                                         "reach their own replica only: give the weights as a list "
                                                         "(one per data-parallel rank or per replica, e.g. from hsdp "
                                                         "tune)")
        check_parallel(self)

    def _check_combinations(self) -> None:
        # The one table of what combines (hsdp/engine/replicate/combinations.py), here before any rank starts:
        # every rank's init_mesh or ShardedModel would refuse the pair alike, later.
        fields = {Feature.HETEROGENEOUS: ("sharding_degree", self.degree_list is not None),
                  Feature.ELASTIC: ("elastic", self.elastic),
                  Feature.DILOCO: ("replica_sync", self.replica_sync == "diloco"),
                  Feature.TENSOR_PARALLEL: ("tensor_parallel", self.tensor_parallel > 1),
                  Feature.SLICED_OPTIMIZER: ("shard_optimizer_across_replicas", self.shard_optimizer_across_replicas),
                  Feature.INT8_HOP: ("replica_hop", self.replica_hop == "int8"),
                  Feature.BF16_HOP: ("replica_hop", self.replica_hop == "bf16"),
                  Feature.BATCH_WEIGHTS: ("batch_weights", self.batch_weights != "even")}
        found = first_refused({f for f, (_, on) in fields.items() if on})
        if found is None:
            return
        option, mode, rule = found
        name = fields[option][0]
        value = getattr(self, name)
        _fail(self.SECTION, name, list(value) if isinstance(value, tuple) else value,
              f"does not combine with {SPELLINGS[mode].config}: {reason(rule)}: {SPELLINGS[option].config_off}, "
              f"or {SPELLINGS[mode].config_off}")

    @property
    def degree_list(self) -> tuple[int, ...] | None:
        """The per-replica shard degrees of a heterogeneous mesh, ``None`` for one degree."""
        return self.sharding_degree if isinstance(self.sharding_degree, tuple) else None

    def _check_degrees(self) -> None:
        degrees = self.degree_list
        if degrees is None:
            _at_least(self.SECTION, self, ("sharding_degree",), 0)
            return
        if not degrees or min(degrees) < 1:
            _fail(self.SECTION, "sharding_degree", list(degrees),
                  "give one degree >= 1 per replica in rank order, e.g. [4, 2, 2], or one integer (0: the ranks "
                  "per node)")

    def _check_batch_weights(self) -> None:
        weights = self.batch_weights
        if isinstance(weights, str):
            if weights not in BATCH_WEIGHT_MODES:
                _fail(self.SECTION, "batch_weights", weights, "choose 'even', 'auto' or a list of positive weights "
                                                              "(per data-parallel rank or per replica), e.g. [1, 2]")
            return
        if not weights or not all(math.isfinite(w) and w > 0 for w in weights):
            _fail(self.SECTION, "batch_weights", list(weights),
                  "give one finite positive weight per data-parallel rank or per replica, e.g. [1, 2], or 'even' "
                  "or 'auto'")


@dataclass(frozen=True)
class LogConfig:
    """Where rank 0's per-step records go besides ``metrics.jsonl``/``.csv`` (and TensorBoard when installed).
    ``wandb`` also logs them, and the whole configuration, to Weights & Biases (``pip install
    'hsdp[wandb]'``): project ``wandb_project``, run name the run directory's name; ``wandb_mode``
    ``offline`` writes the W&B run under the run directory (or ``$WANDB_DIR``) for ``wandb sync`` later,
    ``online`` needs ``wandb login`` (or ``WANDB_API_KEY``) on the node of rank 0."""

    SECTION: ClassVar[str] = "log"
    wandb: bool = False
    wandb_project: str = "hsdp"
    wandb_mode: str = "online"

    def __post_init__(self) -> None:
        _one_of(self.SECTION, "wandb_mode", self.wandb_mode, WANDB_MODES)
        if not self.wandb_project:
            _fail(self.SECTION, "wandb_project", self.wandb_project, "name a project, e.g. 'hsdp'")


@dataclass(frozen=True)
class RunConfig:
    """A whole ``hsdp train`` configuration: the six sections, checked together on construction."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def __post_init__(self) -> None:
        if self.train.stop_after > self.train.steps:
            _fail("train", "stop_after", self.train.stop_after, f"exceeds train.steps = {self.train.steps}")
        if self.model.kind == HF_FOLDER_KIND and self.data.tokenizer != "auto":
            _fail("data", "tokenizer", self.data.tokenizer, "model.kind = 'hf' trains with the model folder's own "
                                                            "tokenizer: set data.tokenizer = 'auto'")
        if self.parallel.tensor_parallel > 1:
            self._check_tensor_parallel_model()
        if self.parallel.elastic:
            self._check_elastic_run()

    def _check_elastic_run(self) -> None:
        if self.train.resume:
            _fail("train", "resume", True, "not with parallel.elastic = true yet: a replica that joins is healed from "
                                           "a live one, never from disk, and a new elastic job starts at step 1: "
                                           "start it in a new run directory (--out), or continue this one without "
                                           "elastic (hsdp train --resume parallel.elastic=false)")
        if self.log.wandb:
            _fail("log", "wandb", True, "not with parallel.elastic = true yet (the replica writing the run changes "
                                        "with the membership): set log.wandb = false")

    def _check_tensor_parallel_model(self) -> None:
        """The model must have a tensor-parallel plan that splits its shape over T ranks, and sequence
        parallel needs every batch's length (the context) divisible by T. The ranks per node are checked
        where they are known: :func:`hsdp.apps.train.command.layout_problem` for the ranks ``hsdp train``
        starts itself, ``hsdp.init_mesh`` under torchrun."""
        from hsdp.apps.train.lm import LANGUAGE_MODELS
        from hsdp.models import preset  # torch import deferred, as above

        tp, model = self.parallel.tensor_parallel, self.model
        problem = LANGUAGE_MODELS[model.kind].tp_problem(model.shape(preset(model.preset).vocab_size), tp)
        if problem:
            _fail("parallel", "tensor_parallel", tp, f"{problem} (model.kind = {model.kind!r}, model.preset = "
                                                     f"{model.preset!r})")
        block = model.block_size or preset(model.preset).block_size
        if block % tp:
            _fail("parallel", "tensor_parallel", tp,
                  f"sequence parallel splits each sequence over the {tp} tensor-parallel ranks, but the context "
                  f"is {block} tokens (model.block_size; 0 is the preset's): set model.block_size to a multiple "
                  f"of {tp}, or a parallel.tensor_parallel dividing {block}")


SECTIONS: dict[str, type] = {f.name: f.default_factory for f in fields(RunConfig)}  # type: ignore[misc]
