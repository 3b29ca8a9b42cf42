"""Ready-made tensor-parallel plans: hsdp's GPT and Hugging Face Llama-style decoders on a 1-D TP mesh.

Each plan calls PyTorch's own ``parallelize_module`` on every decoder block, in place, the Megatron way: the
attention input projections and the MLP's first layer(s) are column-parallel (each rank holds whole heads and a
slice of the hidden units, no communication), the attention output and the MLP's last layer are row-parallel
(one all-reduce, or with sequence parallel one reduce-scatter, per sub-layer). The result is a module with
DTensor parameters that ``hsdp.ShardedModel`` shards further over the data-parallel ranks.

Sequence parallel (the default) also splits the norms and residual adds along the sequence: inside the block
stack the residual stream is each rank's contiguous ``1/T`` of the sequence (a plain local tensor), the norms run
on that slice with replicated weights, and each sub-layer gathers the full sequence before its column-parallel
projections and reduce-scatters it after its row-parallel one. Communication volume equals plain TP's (an
all-reduce is a reduce-scatter plus an all-gather) while norm and residual activations shrink ``T`` times. The
first block takes the full replicated stream and keeps its own slice; the last block gathers it back, so what
follows the blocks sees the ordinary full tensor.

The embeddings, the final norm and the LM head stay plain modules, replicated on every TP rank: GPT ties its LM
head to the token embedding (one Parameter in two modules), and parallelizing the embedding row-wise and the head
column-wise would distribute that one Parameter twice, into two different DTensors, silently untying them. The
price is the vocabulary-sized matmul and its gradient, computed whole on every TP rank.

Requirements: every TP rank builds the model from the same seed (column/row-parallel weights are scattered from
the mesh's first rank, but sequence-parallel norm weights are taken as they are on each rank), and the mesh is
the 1-D TP sub-mesh (``mesh.device_mesh["tp"]``). With dropout, ranks draw masks for their own slices, so a
TP run's masks differ from a single process's (same distribution, different draws).
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.parallel.style import ParallelStyle

from hsdp.models.gpt import GPT, GPTConfig

_SEQ = 1  # the sequence dimension of a (batch, sequence, hidden) activation


def gpt_plan(model: GPT, tp_mesh: DeviceMesh, *, sequence_parallel: bool = True) -> GPT:
    """Tensor-parallelize ``model``'s blocks over the 1-D ``tp_mesh`` of ``T`` ranks, in place; returns it.

    ``attn.q/k/v`` and ``mlp.fc`` become column-parallel, ``attn.proj`` and ``mlp.proj`` row-parallel; with
    ``sequence_parallel`` ``ln_1``/``ln_2`` run on sequence slices (see the module docstring). The embeddings,
    ``ln_f`` and the tied ``lm_head`` stay replicated. ``ValueError`` (before anything changes) when ``n_head`` or
    ``n_embd`` is not divisible by ``T`` or the model or mesh is unsuitable; with ``sequence_parallel`` every
    forward's sequence length must be divisible by ``T`` too, else the forward raises ``ValueError``.
    """
    tp = check_mesh(tp_mesh)
    check_not_parallelized(model)
    check_gpt_divisible(model.cfg, tp)
    for block in model.blocks:
        parallelize_module(block, tp_mesh, _gpt_block_plan(sequence_parallel))
    if sequence_parallel:
        _sequence_ends(model.blocks, tp_mesh)
    return model


def llama_plan(model: nn.Module, tp_mesh: DeviceMesh, *, sequence_parallel: bool = True) -> nn.Module:
    """Tensor-parallelize a Hugging Face Llama-style causal LM (``model.model.layers[i]`` with ``self_attn.
    {q,k,v,o}_proj``, ``mlp.{gate,up,down}_proj``, ``input_layernorm``, ``post_attention_layernorm``) over the
    1-D ``tp_mesh`` of ``T`` ranks, in place; returns it.

    Same layout as :func:`gpt_plan` (q/k/v, gate and up column-parallel; o and down row-parallel; the two
    RMSNorms sequence-parallel by default); ``embed_tokens``, the final ``norm`` and ``lm_head`` stay replicated.
    The attention must derive its head count from the projection width (transformers' ``LlamaAttention`` views
    ``(..., -1, head_dim)``), so each rank runs ``heads / T`` query and ``kv_heads / T`` key/value heads with the
    grouping unchanged. ``ValueError`` when ``num_attention_heads``, ``num_key_value_heads`` or
    ``intermediate_size`` is not divisible by ``T``; with ``sequence_parallel`` each forward's sequence length
    must be divisible by ``T`` too.
    """
    tp = check_mesh(tp_mesh)
    check_not_parallelized(model)
    layers = _llama_layers(model)
    check_llama_divisible(model.config, tp)
    for layer in layers:
        parallelize_module(layer, tp_mesh, _llama_layer_plan(sequence_parallel))
    if sequence_parallel:
        _sequence_ends(layers, tp_mesh)
    return model


# ---------------------------------------------------------------------------------------------------------
# Validation: pure functions, so they run (and are tested) without a process group.
# ---------------------------------------------------------------------------------------------------------
def check_mesh(tp_mesh: Any) -> int:
    """The TP degree of ``tp_mesh``; ``ValueError`` unless the mesh is 1-D."""
    if tp_mesh.ndim != 1:
        raise ValueError(f"a TP plan needs the 1-D tensor-parallel mesh, got a {tp_mesh.ndim}-D mesh: pass "
                         f"its TP dimension, e.g. mesh.device_mesh['tp']")
    return tp_mesh.size()


def check_not_parallelized(model: nn.Module) -> None:
    """``ValueError`` when ``model`` already has DTensor parameters (a plan applied twice, or a model already
    sharded): parallelizing those again would nest layouts."""
    names = [n for n, p in model.named_parameters() if isinstance(p, DTensor)]
    if names:
        raise ValueError(f"the model already has DTensor parameters (e.g. {names[0]}): apply a TP plan once, to "
                         f"a freshly built model, before wrapping it in ShardedModel")


def check_gpt_divisible(cfg: GPTConfig, tp: int) -> None:
    """``ValueError`` unless ``tp`` divides the GPT's heads, width and MLP width (whole heads per rank)."""
    _check_divisible(tp, {"n_head": cfg.n_head, "n_embd": cfg.n_embd, "4 * n_embd": 4 * cfg.n_embd})


def check_llama_divisible(config: Any, tp: int) -> None:
    """``ValueError`` unless ``tp`` divides a Llama config's query heads, key/value heads and MLP width."""
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    _check_divisible(tp, {"num_attention_heads": config.num_attention_heads, "num_key_value_heads": kv_heads,
                          "intermediate_size": config.intermediate_size})


def check_sequence_length(seq_len: int, tp: int) -> None:
    """``ValueError`` unless ``tp`` divides ``seq_len``: sequence parallel gives each rank an equal slice."""
    if seq_len % tp:
        raise ValueError(f"sequence parallel splits the sequence over {tp} TP ranks, but this batch has length "
                         f"{seq_len}: use a length divisible by {tp}, or sequence_parallel=False")


def _check_divisible(tp: int, sizes: dict[str, int]) -> None:
    if tp < 1:
        raise ValueError(f"the TP degree must be positive, got {tp}")
    bad = {name: n for name, n in sizes.items() if n % tp}
    if bad:
        listed = ", ".join(f"{name}={n}" for name, n in bad.items())
        raise ValueError(f"tensor parallel degree {tp} must divide {listed}: choose a TP degree dividing "
                         f"{', '.join(bad)}")


def _llama_layers(model: nn.Module) -> nn.ModuleList:
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList) or not hasattr(model, "config"):
        raise ValueError(f"llama_plan expects a Hugging Face Llama-style causal LM (model.config and "
                         f"model.model.layers), got {type(model).__name__}: use gpt_plan for hsdp's GPT")
    return layers


# ---------------------------------------------------------------------------------------------------------
# The plans
# ---------------------------------------------------------------------------------------------------------
def _gpt_block_plan(sequence_parallel: bool) -> dict[str, ParallelStyle]:
    if not sequence_parallel:
        return {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
                "attn.proj": RowwiseParallel(), "mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel()}
    return {
        "ln_1": SequenceParallel(),
        "attn": _gather_sequence(),
        "attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
        "attn.proj": RowwiseParallel(output_layouts=Shard(_SEQ)),
        "ln_2": SequenceParallel(),
        "mlp": _gather_sequence(),
        "mlp.fc": ColwiseParallel(),
        "mlp.proj": RowwiseParallel(output_layouts=Shard(_SEQ)),
    }


def _llama_layer_plan(sequence_parallel: bool) -> dict[str, ParallelStyle]:
    if not sequence_parallel:
        return {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
                "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
                "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
                "mlp.down_proj": RowwiseParallel()}
    return {
        "input_layernorm": SequenceParallel(),
        # The decoder layer passes the attention's input by keyword.
        "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(_SEQ)},
                                        desired_input_kwarg_layouts={"hidden_states": Replicate()}),
        "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(_SEQ)),
        "post_attention_layernorm": SequenceParallel(),
        "mlp": _gather_sequence(),
        "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(output_layouts=Shard(_SEQ)),
    }


def _gather_sequence() -> PrepareModuleInput:
    # The norm's sequence-sharded output -> the full sequence, kept a DTensor so the column-parallel
    # projections' input-gradient partial sums add up first and are reduce-scattered once in backward.
    return PrepareModuleInput(input_layouts=(Shard(_SEQ),), desired_input_layouts=(Replicate(),))


def _sequence_ends(blocks: nn.ModuleList, tp_mesh: DeviceMesh) -> None:
    """Enter sequence parallel at the first block (keep this rank's slice of the replicated stream: no
    communication; its backward all-gathers) and leave it after the last (all-gather the slices)."""
    tp = tp_mesh.size()
    # Registered before the plan's pre-hook so that it runs first, with the full tensor.
    blocks[0].register_forward_pre_hook(lambda _module, args: check_sequence_length(args[0].shape[_SEQ], tp))
    parallelize_module(blocks[0], tp_mesh, PrepareModuleInput(input_layouts=(Replicate(),),
                                                              desired_input_layouts=(Shard(_SEQ),),
                                                              use_local_output=True))
    parallelize_module(blocks[-1], tp_mesh, PrepareModuleOutput(output_layouts=Shard(_SEQ),
                                                                desired_output_layouts=Replicate(),
                                                                use_local_output=True))


__all__ = ["check_gpt_divisible", "check_llama_divisible", "check_mesh", "check_not_parallelized",
           "check_sequence_length", "gpt_plan", "llama_plan"]
