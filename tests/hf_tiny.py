"""The tiny Hugging Face Llama and token data the accelerate and Trainer integration tests share."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import Dataset

VOCAB, HIDDEN, LAYERS, SEQ = 64, 32, 2, 16


def tiny_llama(seed: int = 0) -> nn.Module:
    """A 2-layer LlamaForCausalLM (tied embeddings, no dropout) with the weights of ``seed``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2 * SEQ,
                      tie_word_embeddings=True, use_cache=False)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg)


def token_batches(n: int, seed: int = 0) -> torch.Tensor:
    """``n`` sequences of ``SEQ`` random tokens, the same on every rank."""
    return torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(seed))


class CausalLMData(Dataset):
    """Token sequences as Trainer feeds them: ``{"input_ids", "labels"}`` per sample."""

    def __init__(self, tokens: torch.Tensor) -> None:
        self.tokens = tokens

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest element difference over the common keys (``inf`` when the keys differ)."""
    if a.keys() != b.keys():
        return float("inf")
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)
