"""A small GPT-style decoder (nanoGPT-like): token + position embeddings, pre-norm blocks, tied LM head.

The blocks live in ``GPT.blocks`` (an ``nn.ModuleList``), so hsdp's default wrap policy makes each block
one unit and leaves the embeddings, the final norm and the tied head in the root unit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from hsdp.models import sampling


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a GPT decoder. ``tie_embeddings`` makes the LM head reuse the token embedding matrix."""

    vocab_size: int = 256
    block_size: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 64
    dropout: float = 0.0
    bias: bool = True
    tie_embeddings: bool = True

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} must be divisible by n_head={self.n_head}")
        if min(self.vocab_size, self.block_size, self.n_layer, self.n_head, self.n_embd) < 1:
            raise ValueError(f"every size of a GPTConfig must be positive, got {self}")


# Named shapes. The byte-level ones (vocab 256) train on hsdp.data.text; the GPT-2-like ones use GPT-2's
# vocabulary (padded to 50304, a multiple of 64) and are meant for memory and throughput studies.
PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=64),  # ~0.2M
    "small": GPTConfig(vocab_size=256, block_size=256, n_layer=6, n_head=8, n_embd=256),  # ~4.8M
    "bench": GPTConfig(vocab_size=256, block_size=512, n_layer=8, n_head=8, n_embd=512),  # ~25.6M
    "gpt2-124m": GPTConfig(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768),
    "gpt2-350m": GPTConfig(vocab_size=50304, block_size=1024, n_layer=24, n_head=16, n_embd=1024),
    "gpt2-774m": GPTConfig(vocab_size=50304, block_size=1024, n_layer=36, n_head=20, n_embd=1280),
    "gpt-1b": GPTConfig(vocab_size=50304, block_size=1024, n_layer=18, n_head=16, n_embd=2048),
}


def preset(name: str) -> GPTConfig:
    """The named :data:`PRESETS` entry; ``ValueError`` listing the names otherwise."""
    if name not in PRESETS:
        raise ValueError(f"unknown GPT preset {name!r}: choose one of {sorted(PRESETS)}")
    return PRESETS[name]


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention through ``scaled_dot_product_attention``.

    ``q``, ``k`` and ``v`` are separate ``n_embd -> n_embd`` projections rather than one packed ``3 * n_embd``
    matrix, so a column-wise tensor-parallel split of each gives every rank whole heads of all three (a split
    of the packed rows would hand rank 0 all of q and half of k). The head count is read from the
    projection's output width (``head_dim`` is fixed), so the same forward runs unsharded and with q/k/v
    column-parallel and ``proj`` row-parallel, each rank then computing its local heads
    (:func:`hsdp.models.tp_plans.gpt_plan`). The function, parameter count and initialization are those of
    the packed form: ``q``, ``k``, ``v`` are its three row blocks.
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.head_dim = cfg.n_embd // cfg.n_head
        self.dropout = cfg.dropout
        self.q = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.k = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.v = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # (B, T, H*D) -> (B, H, T, D): heads become a batch dimension for the attention kernel. H is -1: the
        # local head count, all heads unsharded, H / T under tensor parallelism.
        q, k, v = (lin(x).view(b, t, -1, self.head_dim).transpose(1, 2) for lin in (self.q, self.k, self.v))
        drop = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=drop, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(b, t, -1)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    """The position-wise feed-forward layer: 4x expansion with GELU."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """A pre-norm transformer block. Its output is a fresh tensor (out-of-place residual adds), which a
    sharded unit needs: autograd hooks on the output must not land on a view of the input."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """A decoder-only language model. ``forward(idx, targets)`` returns ``(logits, loss)``; ``loss`` is
    the mean next-token cross entropy when ``targets`` is given, else ``None``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)])
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight  # one Parameter, registered in two modules
        self.apply(self._init_weights)
        # GPT-2: scale the residual projections so the residual stream's variance does not grow with depth.
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self, non_embedding: bool = False) -> int:
        """Distinct parameters (a tied matrix counts once); ``non_embedding`` drops the position table."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.pos_emb.weight.numel() if non_embedding else n

    def forward(self, idx: torch.Tensor,
                targets: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        _, t = idx.shape
        if t > self.cfg.block_size:
            raise ValueError(f"sequence length {t} exceeds block_size={self.cfg.block_size}")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss

    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
        """Append ``max_new_tokens`` sampled tokens to ``idx`` (B, T) and return it.

        Exactly one forward per new token, so under a ShardedModel every rank must call ``generate`` with
        the same ``max_new_tokens`` (each forward runs collectives). ``temperature`` divides the logits;
        ``top_k`` keeps only the k most likely tokens; ``generator`` makes sampling reproducible. See
        :func:`hsdp.models.sampling.generate`.
        """
        return sampling.generate(lambda context: self(context)[0], idx, max_new_tokens, self.cfg.block_size,
                                 temperature=temperature, top_k=top_k, generator=generator)
