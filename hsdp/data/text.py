"""A byte-level text corpus that needs no download: the Python standard library's own sources.

Every Python installation carries a few MB of ``.py`` files, so demos and tests can train a language model
on real text anywhere. Tokens are bytes (vocabulary 256). :class:`TokenStream` gives every data-parallel
rank its own contiguous part of the tokens and samples windows from it deterministically.
"""

from __future__ import annotations

import os
import sysconfig
from collections.abc import Iterable, Iterator

import torch

from hsdp.data.sampler import data_parallel_rank, data_parallel_size
from hsdp.engine.mesh import HSDPMesh

DEFAULT_CORPUS_BYTES = 2_000_000
# Third-party packages may live under the stdlib directory; skipping them keeps the corpus the same on
# every installation of one Python version.
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


def stdlib_sources() -> Iterator[str]:
    """Paths of the standard library's ``.py`` files in a deterministic (sorted, depth-first) order."""
    root = sysconfig.get_paths()["stdlib"]
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        for name in sorted(filenames):
            if name.endswith(".py"):
                yield os.path.join(dirpath, name)


def default_corpus_bytes(max_bytes: int = DEFAULT_CORPUS_BYTES) -> bytes:
    """The first ``max_bytes`` bytes of the concatenated standard library sources."""
    if max_bytes < 1:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    chunks: list[bytes] = []
    total = 0
    for path in stdlib_sources():
        try:
            with open(path, "rb") as f:
                data = f.read(max_bytes - total)
        except OSError:
            continue  # unreadable file (permissions, broken link): the corpus is best effort
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if not chunks:
        raise RuntimeError(f"found no readable .py files under {sysconfig.get_paths()['stdlib']}")
    return b"".join(chunks)


class ByteTokenizer:
    """Bytes as tokens: ``encode`` gives the UTF-8 bytes of a text, ``decode`` inverts it (invalid
    sequences, e.g. a multi-byte character cut by sampling, become U+FFFD)."""

    vocab_size = 256

    def encode(self, text: str | bytes) -> list[int]:
        return list(text.encode("utf-8") if isinstance(text, str) else text)

    def decode(self, ids: Iterable[int] | torch.Tensor) -> str:
        values = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        return bytes(values).decode("utf-8", errors="replace")


def as_tokens(data: bytes) -> torch.Tensor:
    """A 1-D ``uint8`` tensor of the bytes (1 byte per token keeps a big corpus small in memory)."""
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def split_tokens(tokens: torch.Tensor, eval_fraction: float = 0.05) -> tuple[torch.Tensor, torch.Tensor]:
    """``(train, held_out)``: the held-out split is the last ``eval_fraction`` of the tokens."""
    if not 0.0 < eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must lie in (0, 1), got {eval_fraction}")
    cut = int(len(tokens) * (1.0 - eval_fraction))
    return tokens[:cut], tokens[cut:]


def _mix_seed(seed: int, step: int, rank: int) -> int:
    # A fixed integer mix (not hash()): the same (seed, step, rank) gives the same batch on every run.
    mask = (1 << 63) - 1
    return (((seed * 0x9E3779B1 + step) & mask) * 0x85EBCA77 + rank) & mask


class TokenStream:
    """Batches of ``(x, y)`` windows (``y`` is ``x`` shifted by one token), each ``(batch_size, block_size)``.

    The tokens are cut into ``world_size`` equal contiguous parts and data-parallel rank ``r`` samples only
    from part ``r``, so no two ranks ever read the same token. Window starts depend only on
    ``(seed, step, rank)``: a step's batch is the same on every run and independent of earlier steps.
    ``rank`` and ``world_size`` default to :func:`hsdp.data_parallel_rank` / ``data_parallel_size`` of
    ``mesh`` (or of the default process group).
    """

    def __init__(self, tokens: torch.Tensor, block_size: int, batch_size: int, *, seed: int = 0,
                 mesh: HSDPMesh | None = None, rank: int | None = None,
                 world_size: int | None = None) -> None:
        self.rank = data_parallel_rank(mesh) if rank is None else rank
        self.world_size = data_parallel_size(mesh) if world_size is None else world_size
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside [0, world_size={self.world_size})")
        part = len(tokens) // self.world_size
        if part < block_size + 1:
            raise ValueError(
                f"{len(tokens)} tokens give each of {self.world_size} ranks {part} tokens, fewer than "
                f"block_size + 1 = {block_size + 1}: use a larger corpus or a smaller block_size"
            )
        self.part = tokens[self.rank * part: (self.rank + 1) * part]
        self.block_size = block_size
        self.batch_size = batch_size
        self.seed = seed

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's batch for ``step``: int64 ``(x, y)`` of shape ``(batch_size, block_size)``."""
        g = torch.Generator().manual_seed(_mix_seed(self.seed, step, self.rank))
        starts = torch.randint(0, len(self.part) - self.block_size, (self.batch_size,), generator=g)
        offsets = torch.arange(self.block_size + 1)
        windows = self.part[starts[:, None] + offsets].long()
        return windows[:, :-1], windows[:, 1:]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        step = 0
        while True:
            yield self.batch(step)
            step += 1
