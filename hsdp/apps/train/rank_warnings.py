"""Every rank's Python warnings reach the user once, on rank 0, with the ranks that raised them.

Without this, N ranks print the same warning N times (interleaved with the progress output), or, on the
ranks whose output a launcher hides, not at all. Inside :class:`RankWarnings` each rank records its
warnings instead of printing them; :meth:`RankWarnings.flush` (a collective, called at fixed steps) gathers
what is new on every rank and rank 0 prints each distinct warning once. Capture can start before the
process group exists (``init_mesh`` may warn); only ``flush`` needs the ranks::

    warning [ranks 0-3] .../module.py:12: UserWarning: something happened
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from hsdp.apps.train.ranks import RankChannel


def rank_ranges(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"``."""
    out: list[str] = []
    for r in sorted(set(ranks)):
        if out and out[-1].split("-")[-1] == str(r - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{r}"
        else:
            out.append(str(r))
    return ",".join(out)


class RankWarnings:
    """Capture warnings on this rank while active; ``flush`` shows them once across all ranks via ``emit``
    (rank 0 only)."""

    def __init__(self, emit: Callable[[str], None]) -> None:
        self.emit = emit
        self._pending: list[str] = []
        self._seen: set[str] = set()  # this rank's warnings already sent
        self._shown: set[str] = set()  # rank 0: warnings already printed
        self._saved: Any = None

    def _capture(self, message: Any, category: type[Warning], filename: str, lineno: int,
                 file: Any = None, line: str | None = None) -> None:
        text = f"{filename}:{lineno}: {category.__name__}: {message}"
        if text not in self._seen:
            self._seen.add(text)
            self._pending.append(text)

    def __enter__(self) -> RankWarnings:
        self._saved = warnings.catch_warnings()
        self._saved.__enter__()
        warnings.showwarning = self._capture
        return self

    def __exit__(self, *exc: object) -> None:
        self._saved.__exit__(*exc)

    def flush(self, channel: RankChannel) -> list[str]:
        """Gather every rank's new warnings; rank 0 emits each distinct one once. Returns the lines emitted
        (on rank 0; empty elsewhere). A collective: every rank calls it at the same point."""
        pending, self._pending = self._pending, []
        by_text: dict[str, list[int]] = {}
        for rank, texts in enumerate(channel.gather(pending)):
            for text in texts:
                by_text.setdefault(text, []).append(rank)
        if not channel.is_root:
            return []
        lines = []
        for text, ranks in by_text.items():
            if text not in self._shown:
                self._shown.add(text)
                label = "rank" if len(ranks) == 1 else "ranks"
                lines.append(f"warning [{label} {rank_ranges(ranks)}] {text}")
        for line in lines:
            self.emit(line)
        return lines
