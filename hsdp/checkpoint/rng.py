"""Capture and restore this process's random number generators as JSON-serialisable data.

For an exact resume, put ``capture_rng_state()`` into ``save_checkpoint(..., extra=...)`` on every rank
(ranks usually differ: each seeds its own dropout) and call ``restore_rng_state`` on what
``load_checkpoint`` returns. Covered: torch's CPU generator, every CUDA device's generator (when CUDA is
initialised), Python's ``random`` and numpy's global ``np.random`` state. Generators you create yourself
(``torch.Generator``, ``np.random.default_rng``) are yours to save (``get_state()`` / ``bit_generator.state``).
"""

from __future__ import annotations

import base64
import random
from typing import Any

import numpy as np
import torch


def _tensor_to_text(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode()


def _text_to_tensor(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8).clone()


def capture_rng_state() -> dict[str, Any]:
    """This process's RNG states (torch CPU, CUDA when initialised, ``random``, ``np.random``) as JSON data."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "torch": _tensor_to_text(torch.get_rng_state()),
        "python": {"version": version, "state": list(internal), "gauss": gauss},
        "numpy": {"kind": kind, "keys": keys.tolist(), "pos": int(pos), "has_gauss": int(has_gauss),
                  "cached": float(cached)},
    }
    # Reading a CUDA generator would initialise CUDA in processes that never used it.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [_tensor_to_text(s) for s in torch.cuda.get_rng_state_all()]
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Put back what :func:`capture_rng_state` returned; the next random draws repeat the captured ones."""
    if not isinstance(state, dict) or "torch" not in state:
        raise ValueError("restore_rng_state expects the dict returned by capture_rng_state (passed through "
                         f"save_checkpoint's extra), got {type(state).__name__}")
    torch.set_rng_state(_text_to_tensor(state["torch"]))
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss"]))
    npy = state["numpy"]
    np.random.set_state((npy["kind"], np.asarray(npy["keys"], dtype=np.uint32), npy["pos"], npy["has_gauss"],
                         npy["cached"]))
    if "cuda" in state and torch.cuda.is_available():
        saved = state["cuda"]
        if len(saved) != torch.cuda.device_count():
            raise ValueError(f"the RNG state holds {len(saved)} CUDA generators but this process sees "
                             f"{torch.cuda.device_count()} devices: restore on the same CUDA_VISIBLE_DEVICES")
        torch.cuda.set_rng_state_all([_text_to_tensor(s) for s in saved])
