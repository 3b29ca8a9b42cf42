"""The run directory: ``step_000010/`` checkpoints, the ``latest`` marker, atomic commits and retention.

Layout::

    run/
      latest                      "step_000010": moved (atomically) only after a complete, verified save
      step_000005/                a committed checkpoint (DCP files + manifest.json + extra.json)
      step_000010/
      step_000015.tmp-<nonce>/    a save in progress, or the leftover of an interrupted one (ignored)

A checkpoint is written into a temporary directory and renamed to its final name only after every rank
finished writing and rank 0 wrote the manifest; ``rename`` within one file system is atomic, so a final
name never holds a partial checkpoint (unless the storage itself loses data, which the manifest catches).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil

LATEST = "latest"
STEP_PREFIX = "step_"
TMP_MARK = ".tmp-"
OLD_MARK = ".old-"
_STEP_RE = re.compile(r"^step_(\d+)$")


def step_dir_name(step: int) -> str:
    return f"{STEP_PREFIX}{step:06d}"


def parse_step(name: str) -> int | None:
    """The step of a committed checkpoint directory name, ``None`` for anything else."""
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


def set_aside_step(name: str) -> int | None:
    """The step of a committed checkpoint moved aside while the same step was saved again (``.old-``)."""
    base, mark, _ = name.partition(OLD_MARK)
    return parse_step(base) if mark else None


def is_temporary(name: str) -> bool:
    return TMP_MARK in name or OLD_MARK in name


def list_steps(run_dir: str) -> list[tuple[int, str]]:
    """``(step, name)`` of every committed-looking checkpoint directory, oldest first."""
    out = []
    for name in os.listdir(run_dir):
        step = parse_step(name)
        if step is not None and os.path.isdir(os.path.join(run_dir, name)):
            out.append((step, name))
    return sorted(out)


def next_step(run_dir: str) -> int:
    steps = list_steps(run_dir) if os.path.isdir(run_dir) else []
    return steps[-1][0] + 1 if steps else 0


def read_latest(run_dir: str) -> str | None:
    """The directory name ``latest`` points to, ``None`` when absent or not a plain step name."""
    try:
        with open(os.path.join(run_dir, LATEST), encoding="utf-8") as f:
            name = f.read(256).strip()
    except OSError:
        return None
    return name if parse_step(name) is not None else None


def fsync_dir(path: str) -> None:
    """Make a rename or a new entry in ``path`` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str, data: bytes, nonce: str) -> None:
    """Write ``path`` so that readers see the old content or the new one, never a mix."""
    tmp = f"{path}{TMP_MARK}{nonce}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path) or ".")


def commit_dir(tmp: str, final: str, nonce: str) -> None:
    """Rename the finished temporary directory to its final name (replacing an older save of the step)."""
    fsync_dir(tmp)
    aside = None
    if os.path.exists(final):
        # rename() cannot replace a non-empty directory: move the old one aside first, drop it after.
        # A crash between the two renames leaves only the aside copy: loading falls back to it.
        aside = f"{final}{OLD_MARK}{nonce}"
        os.rename(final, aside)
    os.rename(tmp, final)
    fsync_dir(os.path.dirname(final))
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


def write_latest(run_dir: str, name: str, nonce: str) -> None:
    atomic_write(os.path.join(run_dir, LATEST), (name + "\n").encode(), nonce)


def prune(run_dir: str, keep_last: int | None, keep: str) -> list[str]:
    """Delete checkpoints beyond the newest ``keep_last`` and leftovers of interrupted saves.

    ``keep`` (the checkpoint just committed, which ``latest`` names) always survives. Only one save runs
    per run directory at a time (every rank takes part in it), so any temporary directory or file other
    than the current one is a leftover of a crash.
    """
    removed = []
    for name in os.listdir(run_dir):
        if is_temporary(name):
            path = os.path.join(run_dir, name)
            if os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    os.unlink(path)
            removed.append(name)
    if keep_last is not None:
        steps = [name for _, name in list_steps(run_dir) if name != keep]
        for name in steps[: max(0, len(steps) - (keep_last - 1))]:
            shutil.rmtree(os.path.join(run_dir, name), ignore_errors=True)
            removed.append(name)
    return removed

