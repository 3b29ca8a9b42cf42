"""Named GPUs, interconnects and model sizes for ``hsdp plan``.

Numbers are datasheet values (dense bf16 peak, HBM size and bandwidth; link rate per direction); the
planner multiplies the peak by an achieved fraction (``--mfu``, 0.45 by default: what large dense
transformers typically reach). Latencies are per ring step, order-of-magnitude figures: they matter only
for small units on large rings, and ``hsdp tune`` replaces them with measured ones.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, replace

from hsdp.tools.planner.model import ModelSpec, TransformerShape, transformer
from hsdp.tools.quantities import parse_bandwidth

GiB = 2**30
OPTIMIZER_BYTES_PER_ELEMENT = 36  # AdamW reads param, grad, two moments and writes three: about 36 B/element


@dataclass(frozen=True)
class GPU:
    """One accelerator: memory (bytes), dense bf16 peak (FLOP/s), HBM bandwidth (bytes/s), its NVLink."""

    memory: float
    peak_flops: float
    hbm_bandwidth: float
    intra_link: str


@dataclass(frozen=True)
class Link:
    """An interconnect: bytes/s per direction (per GPU inside a node, per NIC between nodes) and the
    latency of one ring step."""

    bandwidth: float
    latency: float


# Dense (no sparsity) bf16 tensor-core peaks from each vendor datasheet; where a datasheet prints only the
# "with sparsity" figure, half of it.
GPUS: dict[str, GPU] = {
    "v100-32": GPU(32 * GiB, 125e12, 0.9e12, "nvlink2"),
    "a10g": GPU(24 * GiB, 125e12, 0.6e12, "pcie4"),
    "l4": GPU(24 * GiB, 121e12, 0.3e12, "pcie4"),  # NVIDIA L4 datasheet: bf16 242 TFLOPS with sparsity, 300 GB/s
    "a40": GPU(48 * GiB, 149.7e12, 0.696e12, "pcie4"),  # NVIDIA A40 datasheet: bf16 149.7 TFLOPS, 696 GB/s GDDR6
    "l40": GPU(48 * GiB, 181e12, 0.864e12, "pcie4"),  # NVIDIA L40 datasheet: bf16 362 TFLOPS with sparsity
    "l40s": GPU(48 * GiB, 362e12, 0.864e12, "pcie4"),  # NVIDIA L40S datasheet: bf16 362.05 TFLOPS, 864 GB/s
    "a100-40": GPU(40 * GiB, 312e12, 1.555e12, "nvlink3"),  # NVIDIA A100 datasheet: bf16 312 TFLOPS, 1,555 GB/s
    "a100-80": GPU(80 * GiB, 312e12, 2.039e12, "nvlink3"),  # A100 80GB SXM: 2,039 GB/s
    "h100": GPU(80 * GiB, 989e12, 3.35e12, "nvlink4"),  # NVIDIA H100 SXM datasheet: bf16 1,979 with sparsity
    "h100-pcie": GPU(80 * GiB, 756e12, 2.0e12, "pcie5"),
    "h100-nvl": GPU(94 * GiB, 835e12, 3.9e12, "nvlink4"),  # H100 NVL datasheet: bf16 1,671 with sparsity, 3.9 TB/s
    "h200": GPU(141 * GiB, 989e12, 4.8e12, "nvlink4"),
    "b200": GPU(180 * GiB, 2250e12, 8.0e12, "nvlink5"),
    "mi250x": GPU(128 * GiB, 383e12, 3.2e12, "infinity-fabric"),  # AMD Instinct MI250X: bf16 383 TFLOPS, 3.2 TB/s
    "mi300x": GPU(192 * GiB, 1307e12, 5.3e12, "infinity-fabric"),
}
# Other spellings of the same presets (memory written out, as cloud instance pages name them).
GPU_ALIASES: dict[str, str] = {"a100-40gb": "a100-40", "a100-80gb": "a100-80", "h100-sxm": "h100",
                               "h100-80gb": "h100", "v100": "v100-32"}

INTRA_LINKS: dict[str, Link] = {
    "nvlink2": Link(150e9, 3e-6),
    "nvlink3": Link(300e9, 3e-6),
    "nvlink4": Link(450e9, 3e-6),
    "nvlink": Link(450e9, 3e-6),
    "nvlink5": Link(900e9, 3e-6),
    "infinity-fabric": Link(448e9, 3e-6),
    "pcie4": Link(25e9, 10e-6),
    "pcie5": Link(50e9, 10e-6),
}

INTER_LINKS: dict[str, Link] = {
    "ib200": Link(25e9, 5e-6),  # HDR InfiniBand, 200 Gbit/s
    "ib400": Link(50e9, 5e-6),  # NDR InfiniBand, 400 Gbit/s
    "ib800": Link(100e9, 5e-6),  # XDR
    "400gbe": Link(50e9, 10e-6),
    "200gbe": Link(25e9, 10e-6),
    "100gbe": Link(12.5e9, 10e-6),
    "25gbe": Link(3.125e9, 20e-6),
    "10gbe": Link(1.25e9, 30e-6),
    "1gbe": Link(0.125e9, 50e-6),
}


def inter_link(name: str) -> Link:
    """``"ib400"`` or ``"8xib400"`` (eight NICs per node: eight times the bandwidth per node)."""
    match = re.match(r"^(?:(\d+)x)?([a-z0-9]+)$", name.lower())
    count, base = (match.group(1) or "1", match.group(2)) if match else ("0", "")
    if base not in INTER_LINKS or int(count) < 1:
        raise ValueError(f"unknown inter-node link {name!r}: use one of {sorted(INTER_LINKS)}, optionally "
                         f"with a NIC count such as '8xib400', or a rate such as '50GB/s'")
    link = INTER_LINKS[base]
    return Link(link.bandwidth * int(count), link.latency)


def intra_link(name: str) -> Link:
    if name.lower() not in INTRA_LINKS:
        raise ValueError(f"unknown intra-node link {name!r}: use one of {sorted(INTRA_LINKS)} or a rate "
                         f"such as '450GB/s'")
    return INTRA_LINKS[name.lower()]


def link_or_rate(text: str, presets: Callable[[str], Link]) -> tuple[float, float | None]:
    """(bytes/s, the preset's latency or ``None``) of a link preset name (looked up by ``presets``:
    :func:`inter_link` or :func:`intra_link`) or of a rate such as ``50GB/s``."""
    try:
        link = presets(text)
        return link.bandwidth, link.latency
    except ValueError:
        try:
            return parse_bandwidth(text), None
        except ValueError as e:
            raise ValueError(f"{text!r} is neither a link preset nor a rate ({e})") from None


def gpu_names() -> list[str]:
    """Every preset name ``gpu`` accepts, aliases included, sorted."""
    return sorted([*GPUS, *GPU_ALIASES])


def gpu_key(name: str) -> str:
    """The preset's own name of ``name`` (``"a100-40gb"`` -> ``"a100-40"``); ``ValueError`` naming the known ones."""
    key = GPU_ALIASES.get(name.lower(), name.lower())
    if key not in GPUS:
        raise ValueError(f"unknown GPU {name!r}: use one of {gpu_names()}, or give --gpu-memory and --compute")
    return key


def gpu(name: str) -> GPU:
    return GPUS[gpu_key(name)]


# Decoder shapes: GPT-3 (Brown et al. 2020, table 2.1) for the small sizes, Llama 2 for 7b-70b.
_GPT3_VOCAB = 50304  # 50257 padded to a multiple of 64
MODEL_SHAPES: dict[str, tuple[TransformerShape, int]] = {
    "125m": (TransformerShape(12, 768, 12, _GPT3_VOCAB, positions=2048), 2048),
    "350m": (TransformerShape(24, 1024, 16, _GPT3_VOCAB, positions=2048), 2048),
    "1.3b": (TransformerShape(24, 2048, 16, _GPT3_VOCAB, positions=2048), 2048),
    "7b": (TransformerShape(32, 4096, 32, 32000, ffn=11008, gated=True, tied=False, bias=False), 4096),
    "13b": (TransformerShape(40, 5120, 40, 32000, ffn=13824, gated=True, tied=False, bias=False), 4096),
    "70b": (TransformerShape(80, 8192, 64, 32000, ffn=28672, kv_heads=8, gated=True, tied=False, bias=False,
                             fused_qkv=False), 4096),
}


def _gpt_presets() -> dict[str, tuple[TransformerShape, int]]:
    # The repo's own GPT presets (hsdp.models): imported lazily, as hsdp.models needs torch.
    from hsdp.models.gpt import PRESETS

    return {name: (TransformerShape(c.n_layer, c.n_embd, c.n_head, c.vocab_size, tied=c.tie_embeddings,
                                    bias=c.bias, positions=c.block_size), c.block_size)
            for name, c in PRESETS.items()}


def model_names() -> list[str]:
    return [*MODEL_SHAPES, *_gpt_presets()]


def model_preset(name: str, seq_len: int | None = None, micro_batch: int = 1) -> ModelSpec:
    """The spec of a named size (``7b``) or repo GPT preset (``gpt2-124m``, ``small``); ``seq_len``
    defaults to the preset's context length."""
    shapes = MODEL_SHAPES if name.lower() in MODEL_SHAPES else _gpt_presets()
    key = name.lower() if name.lower() in MODEL_SHAPES else name
    if key not in shapes:
        raise ValueError(f"unknown model {name!r}: use one of {model_names()}")
    shape, default_seq = shapes[key]
    spec = transformer(key, shape, seq_len or default_seq, micro_batch)
    return replace(spec, description=f"{spec.params / 1e9:.3g}B params, {shape.layers} layers, "
                                     f"hidden {shape.hidden}")
