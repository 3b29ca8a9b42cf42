"""What several parity tests compare against, written out once (not the library's code): the int8 quantiser
of the error-feedback hops and wires, and the distance the 1e-5 tolerances bound."""

from __future__ import annotations

import torch


def int8_roundtrip(x: torch.Tensor, block: int) -> torch.Tensor:
    """Symmetric int8 in blocks of ``block`` values with one fp32 scale each, dequantised."""
    n = x.numel()
    padded = torch.zeros(-(-n // block) * block)
    padded[:n] = x
    blocks = padded.view(-1, block)
    scale = blocks.abs().amax(dim=1).clamp_min(1e-30) / 127.0
    return (torch.round(blocks / scale[:, None]).clamp(-127, 127) * scale[:, None]).view(-1)[:n]


def max_distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest elementwise difference over ``b``'s tensors: what a 1e-5 tolerance bounds."""
    return max((a[n] - b[n]).abs().max().item() for n in b)
