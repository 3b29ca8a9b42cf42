"""What the planner knows about a model: its units (parameter shapes), FLOPs and activations per micro-batch.

A :class:`ModelSpec` mirrors how hsdp splits a model: ``units[0]`` is the root unit (embeddings, final norm,
head), every other unit is one block of the repeated stack. Each parameter is kept as ``(rows, row_numel)``
because the engine pads dim-0 chunks to ``ceil(rows / S)`` rows per rank: a 3-row bias on 4 ranks costs
4 rows everywhere, and that padding is what makes small models' per-rank bytes differ from ``P / S``.

Specs come from :func:`transformer` (any decoder shape, used by the size presets), from
:func:`hsdp.tools.planner.presets.model_preset` (``7b``, ``gpt2-124m``, ...), or from a live ``nn.Module`` via
:func:`hsdp.tools.planner.introspect.spec_from_module` (exact shapes, what ``hsdp tune`` uses). This module is pure
Python: planning for a 70B model must not need torch or the memory to build it.
"""

from __future__ import annotations

from dataclasses import dataclass

Shape = tuple[int, int]  # (rows, elements per row) of one parameter


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class UnitSpec:
    """One unit: the parameters one all-gather moves, and the forward FLOPs per token it costs."""

    name: str
    shapes: tuple[Shape, ...]
    forward_flops_per_token: float = 0.0
    frozen: tuple[Shape, ...] = ()  # stored and gathered, but no gradient, optimizer state or reduction

    @property
    def numel(self) -> int:
        return sum(r * c for r, c in self.shapes + self.frozen)

    @property
    def tensors(self) -> int:
        """Trainable tensors: each adds one flag to the reductions and one ``step`` to AdamW's state."""
        return len(self.shapes)

    def slot(self, sharding_degree: int) -> int:
        """Elements each rank stores: padded chunks of ``ceil(rows / S)`` rows, back to back."""
        return sum(-(-r // sharding_degree) * c for r, c in self.shapes + self.frozen)

    def trainable_slot(self, sharding_degree: int) -> int:
        """The part of :meth:`slot` with gradients: what the reduce-scatter and the hop carry."""
        return sum(-(-r // sharding_degree) * c for r, c in self.shapes)

    def slice_slot(self, sharding_degree: int, replicas: int) -> int:
        """With the optimizer sharded across replicas: the elements of :meth:`trainable_slot` the largest rank
        steps, each chunk's ``ceil(rows / S)`` rows split again in ``ceil(. / R)`` per replica (so the
        padding of both splits is counted; ``replicas=1`` is :meth:`trainable_slot`)."""
        return sum(_ceil(_ceil(r, sharding_degree), replicas) * c for r, c in self.shapes)


@dataclass(frozen=True)
class ModelSpec:
    """A model as the cost model sees it, for one micro-batch shape.

    ``micro_batch`` sequences of ``seq_len`` tokens per rank per micro-batch. ``activation_elements`` is the
    estimate of elements autograd keeps per micro-batch (at the compute dtype), for the transformer
    shapes from the standard per-layer count with memory-efficient attention; ``checkpoint_elements`` what
    stays when each unit's forward is recomputed in backward (its input). Both are estimates: a measured
    profile (:class:`ComputeProfile`) overrides them.

    For tensor parallelism (:mod:`hsdp.tools.planner.tensor_parallel`): ``hidden`` is the width of the
    activations between blocks, what TP's collectives move (0: unknown, and TP cannot be estimated);
    ``root_activation_elements`` the part of both activation counts that belongs to the root unit
    (embeddings, final norm, logits), which stays whole on every TP rank unless ``tensor_parallel_root``
    (vocabulary-parallel embedding and head, as torchtitan's Llama plan) splits the root too.
    """

    name: str
    units: tuple[UnitSpec, ...]
    seq_len: int = 1
    micro_batch: int = 1
    activation_elements: float = 0.0
    checkpoint_elements: float = 0.0
    description: str = ""
    hidden: int = 0
    root_activation_elements: float = 0.0
    tensor_parallel_root: bool = False

    def __post_init__(self) -> None:
        if not self.units:
            raise ValueError("a ModelSpec needs at least the root unit: pass units=(UnitSpec('root', ...),)")
        if self.seq_len < 1 or self.micro_batch < 1:
            raise ValueError(f"seq_len={self.seq_len} and micro_batch={self.micro_batch} must be at least 1")

    @property
    def params(self) -> int:
        return sum(u.numel for u in self.units)

    @property
    def tokens(self) -> int:
        """Tokens per rank per micro-batch."""
        return self.seq_len * self.micro_batch

    @property
    def root(self) -> UnitSpec:
        return self.units[0]

    @property
    def blocks(self) -> tuple[UnitSpec, ...]:
        return self.units[1:]

    def forward_flops(self) -> float:
        """Forward FLOPs of one micro-batch on one rank (backward is about twice that)."""
        return self.tokens * sum(u.forward_flops_per_token for u in self.units)


@dataclass(frozen=True)
class ComputeProfile:
    """Compute measured on one rank (under the same contention as training): seconds of one micro-batch's
    forward and backward on the unwrapped model, the optimizer's seconds per parameter element, and
    optionally the activation bytes of one micro-batch. Overrides FLOP-based estimates."""

    forward_s: float
    backward_s: float
    optimizer_s_per_element: float = 0.0
    activation_bytes: float | None = None

    def __post_init__(self) -> None:
        if self.forward_s <= 0 or self.backward_s <= 0 or self.optimizer_s_per_element < 0:
            raise ValueError(f"a ComputeProfile needs positive forward/backward seconds, got {self}: measure "
                             f"at least one micro-batch after a warm-up")


@dataclass(frozen=True)
class TransformerShape:
    """A decoder-only transformer: enough to count every parameter, FLOP and activation.

    ``ffn`` is the MLP width; ``gated`` makes the MLP three matrices (SwiGLU, Llama) instead of two (GELU,
    GPT). ``kv_heads`` < ``heads`` is grouped-query attention. ``positions`` > 0 is a learned position table
    of that many rows (GPT); 0 means rotary (no parameters). ``tied`` shares embedding and head.
    """

    layers: int
    hidden: int
    heads: int
    vocab: int
    ffn: int = 0
    kv_heads: int = 0
    gated: bool = False
    tied: bool = True
    bias: bool = True
    positions: int = 0
    fused_qkv: bool = True

    @property
    def mlp_width(self) -> int:
        return self.ffn or 4 * self.hidden

    @property
    def kv_width(self) -> int:
        return (self.kv_heads or self.heads) * (self.hidden // self.heads)


def _linear(out_f: int, in_f: int, bias: bool) -> list[Shape]:
    return [(out_f, in_f), *([(out_f, 1)] if bias else [])]


def _norm(h: int, bias: bool) -> list[Shape]:
    return [(h, 1), *([(h, 1)] if bias else [])]


def _block_shapes(t: TransformerShape) -> list[Shape]:
    h, b = t.hidden, t.bias
    if t.fused_qkv and t.kv_width == h:
        attn = _linear(3 * h, h, b)
    else:
        attn = _linear(h, h, b) + _linear(t.kv_width, h, b) + _linear(t.kv_width, h, b)
    attn += _linear(h, h, b)
    mlp = _linear(t.mlp_width, h, b)
    if t.gated:
        mlp += _linear(t.mlp_width, h, b)
    mlp += _linear(h, t.mlp_width, b)
    return _norm(h, b) + attn + _norm(h, b) + mlp


def _block_flops_per_token(t: TransformerShape, seq_len: int) -> float:
    matmul = sum(r * c for r, c in _block_shapes(t) if c > 1)
    # 2 FLOPs per weight per token, plus QK^T and AV (2 * 2 * seq * hidden): the PaLM convention.
    return 2.0 * matmul + 4.0 * seq_len * t.hidden


def _root_shapes(t: TransformerShape) -> list[Shape]:
    shapes: list[Shape] = [(t.vocab, t.hidden)]
    if t.positions:
        shapes.append((t.positions, t.hidden))
    shapes += _norm(t.hidden, t.bias)
    if not t.tied:
        shapes.append((t.vocab, t.hidden))
    return shapes


def transformer(name: str, t: TransformerShape, seq_len: int, micro_batch: int = 1,
                description: str = "") -> ModelSpec:
    """The :class:`ModelSpec` of a decoder with one unit per block (hsdp's default wrapping)."""
    block = UnitSpec("block", tuple(_block_shapes(t)), _block_flops_per_token(t, seq_len))
    root = UnitSpec("root", tuple(_root_shapes(t)), 2.0 * t.vocab * t.hidden)
    tokens = seq_len * micro_batch
    # Per block: norm in/out x2, qkv, attention out, MLP in/act/out (Korthikanti et al. without the
    # s^2 score matrix, which memory-efficient attention does not keep). Root: embeddings, final norm,
    # logits and their fp32 softmax for the loss.
    per_block = tokens * (9 * t.hidden + (3 if t.gated else 2) * t.mlp_width)
    root_act = tokens * (3 * t.hidden + 2 * t.vocab)
    units = (root, *[UnitSpec(f"block{i}", block.shapes, block.forward_flops_per_token) for i in range(t.layers)])
    return ModelSpec(name, units, seq_len, micro_batch, per_block * t.layers + root_act,
                     tokens * t.hidden * t.layers + root_act, description, hidden=t.hidden,
                     root_activation_elements=root_act)


def uniform(name: str, params: float, units: int, seq_len: int = 1, micro_batch: int = 1,
            root_fraction: float = 0.0, width: int = 1024) -> ModelSpec:
    """A model of ``units`` equal blocks plus a root holding ``root_fraction`` of ``params``: for unit tests
    of the closed forms and for models known only by size. Rows are ``width`` elements, so padding is
    negligible unless the counts are tiny; ``width`` is also the hidden size tensor parallelism moves."""
    if units < 1 or params <= 0 or not 0 <= root_fraction < 1:
        raise ValueError(f"uniform model needs units >= 1, params > 0, root_fraction in [0, 1); got "
                         f"units={units}, params={params}, root_fraction={root_fraction}")
    root_rows = round(params * root_fraction / width)
    block_rows = round(params * (1 - root_fraction) / units / width)
    root = UnitSpec("root", ((root_rows, width),) if root_rows else (), 2.0 * root_rows * width)
    blocks = tuple(UnitSpec(f"block{i}", ((block_rows, width),), 2.0 * block_rows * width) for i in range(units))
    return ModelSpec(name, (root, *blocks), seq_len, micro_batch, hidden=width)
