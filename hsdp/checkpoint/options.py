"""``CheckpointOptions``: how many checkpoints a run directory keeps and how hard loading checks them."""

from __future__ import annotations

from dataclasses import dataclass

VERIFY_MODES = ("checksum", "size")


@dataclass(frozen=True)
class CheckpointOptions:
    """Retention and verification settings for ``save_checkpoint`` / ``load_checkpoint``.

    ``keep_last``: after a successful save, keep the newest ``keep_last`` checkpoints of the run directory
    (by step) and delete the rest, plus leftovers of interrupted saves; the checkpoint ``latest`` names is
    never deleted. ``None`` keeps everything.

    ``verify``: ``"checksum"`` (default) re-reads every file of the checkpoint before loading it and
    compares SHA-256 digests with the manifest, spread over the ranks of replica 0 (other replicas read
    nothing); it catches bit rot and partial overwrites at the cost of one extra read of the checkpoint.
    ``"size"`` only compares file sizes: it catches truncation (the common failure of an interrupted
    copy) but not corrupted bytes.
    """

    keep_last: int | None = 3
    verify: str = "checksum"

    def __post_init__(self) -> None:
        if self.keep_last is not None and (not isinstance(self.keep_last, int) or self.keep_last < 1):
            raise ValueError(f"keep_last={self.keep_last!r}: use a positive number of checkpoints, or None to keep all")
        if self.verify not in VERIFY_MODES:
            raise ValueError(f"verify={self.verify!r}: use one of {VERIFY_MODES}")
