"""A process that watches its launcher as a rank does (``hsdp.engine.faults.launcher``), without any ranks.

``python launcher_child.py``: prints ``armed <pid>`` once the parent-death signal is set, then sleeps (60 s
at most). hsdp ends it, with a message on stderr and exit status 75, when its parent process dies.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from hsdp.engine.faults.launcher import watch_launcher
from hsdp.engine.faults.policy import FaultPolicy


class StandInWatchdog:
    """What ``watch_launcher`` uses of a watchdog: the rank for messages, the policy and ``add_check``."""

    rank = 0
    policy = FaultPolicy()

    def __init__(self) -> None:
        self.checks: list[Callable[[], str | None]] = []

    def add_check(self, check: Callable[[], str | None]) -> None:
        self.checks.append(check)


def main() -> None:
    watch_launcher(StandInWatchdog())  # type: ignore[arg-type]
    print(f"armed {os.getpid()}", flush=True)
    time.sleep(60)


if __name__ == "__main__":
    main()
