"""Where a tool's results go: ``<kind>_<date>[_<tag>]`` files whose metadata names the exact command and
the commit, so that every number in a results table traces back to what produced it."""

from __future__ import annotations

import datetime
import subprocess
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ResultsRun:
    """The name and metadata of one run's result files (JSON, Markdown, plot share the name)."""

    name: str  # ``<kind>_<date>[_<tag>]``, no extension
    meta: dict[str, Any]  # date, command, git commit (and whatever the tool adds)


def results_run(kind: str, tag: str | None, command: str, **extra: Any) -> ResultsRun:
    """Name and metadata for a run of ``kind`` (``bench``, ``tune``) made by ``command`` today."""
    stamp = datetime.date.today().isoformat()
    name = f"{kind}_{stamp}{'_' + tag if tag else ''}"
    return ResultsRun(name, {"date": stamp, "command": command, "git": git_commit(), **extra})


def git_commit() -> str:
    """The checkout's short commit, or ``unknown`` outside a git checkout."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=False).stdout.strip() or "unknown"
    except OSError:
        return "unknown"
