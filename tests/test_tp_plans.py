"""Tensor-parallel plans without processes: their validation, and the GPT attention split into q/k/v
computing what the packed-qkv attention computed. (Multi-rank parity of the plans is tested with hsdp.)"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from torch.nn import functional as F

import hsdp
from hsdp.models import tp_plans
from hsdp.models.gpt import GPT, GPTConfig

CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32)


def _mesh(ndim: int, size: int) -> SimpleNamespace:
    # The plans read only ndim and size() before touching the mesh's process group.
    return SimpleNamespace(ndim=ndim, size=lambda: size)


def _llama_config(heads: int = 4, kv_heads: int | None = 2, ffn: int = 64) -> SimpleNamespace:
    return SimpleNamespace(num_attention_heads=heads, num_key_value_heads=kv_heads, intermediate_size=ffn)


def test_the_plans_are_a_lazy_public_submodule() -> None:
    assert hsdp.tp_plans is tp_plans and hsdp.tp_plans.gpt_plan is tp_plans.gpt_plan
    assert "tp_plans" in dir(hsdp)


def test_gpt_divisibility_names_every_size_the_degree_does_not_divide() -> None:
    tp_plans.check_gpt_divisible(CFG, 4)  # 4 heads, width 32, MLP 128
    with pytest.raises(ValueError, match=r"degree 4 must divide n_head=6: ") as e:
        tp_plans.check_gpt_divisible(GPTConfig(n_head=6, n_embd=48), 4)
    assert "n_embd" not in str(e.value)
    with pytest.raises(ValueError, match=r"degree 3 must divide n_head=4, n_embd=32, 4 \* n_embd=128"):
        tp_plans.check_gpt_divisible(CFG, 3)
    with pytest.raises(ValueError, match="must be positive"):
        tp_plans.check_gpt_divisible(CFG, 0)


def test_llama_divisibility_checks_query_and_key_value_heads() -> None:
    tp_plans.check_llama_divisible(_llama_config(), 2)
    with pytest.raises(ValueError, match=r"degree 4 must divide num_key_value_heads=2: "):
        tp_plans.check_llama_divisible(_llama_config(), 4)
    with pytest.raises(ValueError, match=r"num_attention_heads=6, num_key_value_heads=6"):
        tp_plans.check_llama_divisible(_llama_config(heads=6, kv_heads=None, ffn=64), 4)  # None: MHA


def test_sequence_parallel_needs_a_divisible_length() -> None:
    tp_plans.check_sequence_length(16, 4)
    with pytest.raises(ValueError, match="length 15: use a length divisible by 2, or sequence_parallel=False"):
        tp_plans.check_sequence_length(15, 2)


def test_a_plan_refuses_before_changing_anything() -> None:
    model = GPT(CFG)
    with pytest.raises(ValueError, match=r"1-D tensor-parallel mesh, got a 3-D mesh: .*device_mesh\['tp'\]"):
        tp_plans.gpt_plan(model, _mesh(3, 8))
    with pytest.raises(ValueError, match="degree 3 must divide n_head=4"):
        tp_plans.gpt_plan(model, _mesh(1, 3))
    with pytest.raises(ValueError, match=r"Llama-style causal LM .* got GPT: use gpt_plan"):
        tp_plans.llama_plan(model, _mesh(1, 2))
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())
    tp_plans.check_not_parallelized(model)  # plain tensors only: accepted


def test_gpt_parameter_count_is_the_packed_attentions() -> None:
    c = CFG.n_embd
    per_block = (3 * c * c + 3 * c) + (c * c + c) + (4 * c * c + 4 * c) + (4 * c * c + c) + 2 * 2 * c
    expected = CFG.vocab_size * c + CFG.block_size * c + CFG.n_layer * per_block + 2 * c
    model = GPT(CFG)
    assert model.num_params() == expected
    assert [n for n, _ in model.blocks[0].attn.named_parameters()] == [
        "q.weight", "q.bias", "k.weight", "k.bias", "v.weight", "v.bias", "proj.weight", "proj.bias"]


def _packed_forward(model: GPT, idx: torch.Tensor) -> torch.Tensor:
    """GPT's forward written out with one packed [q; k; v] projection, the layout before the split."""
    cfg, (b, t) = model.cfg, idx.shape
    x = model.tok_emb(idx) + model.pos_emb(torch.arange(t))
    for block in model.blocks:
        attn = block.attn
        weight = torch.cat([attn.q.weight, attn.k.weight, attn.v.weight])
        bias = torch.cat([attn.q.bias, attn.k.bias, attn.v.bias])
        q, k, v = F.linear(block.ln_1(x), weight, bias).split(cfg.n_embd, dim=2)
        q, k, v = (z.view(b, t, cfg.n_head, cfg.n_embd // cfg.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, cfg.n_embd)
        x = x + attn.proj(y)
        x = x + block.mlp.proj(F.gelu(block.mlp.fc(block.ln_2(x))))
    return model.lm_head(model.ln_f(x))


def test_split_attention_computes_the_packed_attention() -> None:
    torch.manual_seed(0)
    model = GPT(CFG).eval()
    for p in model.parameters():  # nonzero biases, so a bias in the wrong slot would show
        torch.nn.init.normal_(p, std=0.3)
    idx = torch.randint(0, CFG.vocab_size, (3, CFG.block_size))
    with torch.no_grad():
        logits, _ = model(idx)
        torch.testing.assert_close(logits, _packed_forward(model, idx), rtol=0, atol=1e-5)


def test_split_attention_keeps_the_gpt2_initialization() -> None:
    torch.manual_seed(0)
    attn = GPT(GPTConfig(n_layer=8, n_embd=128)).blocks[0].attn
    for lin in (attn.q, attn.k, attn.v):
        assert abs(lin.weight.std().item() - 0.02) < 0.002 and not lin.bias.any()
    scaled = 0.02 / math.sqrt(2 * 8)  # only the residual projection is scaled down with depth
    assert abs(attn.proj.weight.std().item() - scaled) < 0.1 * scaled
