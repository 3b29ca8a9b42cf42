"""Signal handlers for the length of a block: the one place hsdp installs and restores them.

Python runs signal handlers in the main thread only, and ``signal.signal`` raises anywhere else, so off the
main thread :func:`handle_signals` installs nothing and the block runs under the process's handlers. On
exit, however the block ends, every signal gets back the handler it had before.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

# A function of (signal number, frame), or signal.SIG_IGN / signal.SIG_DFL.
Handler = Callable[[int, FrameType | None], Any] | int | signal.Handlers


@contextmanager
def handle_signals(signals: Iterable[signal.Signals], handler: Handler) -> Iterator[bool]:
    """Within the block, ``handler`` handles each of ``signals``; yields whether it was installed (``False``
    off the main thread, where nothing changes)."""
    if threading.current_thread() is not threading.main_thread():
        yield False
        return
    previous: dict[signal.Signals, Any] = {}
    try:
        for sig in signals:
            previous[sig] = signal.signal(sig, handler)
        yield True
    finally:
        for sig, old in previous.items():
            # None: the old handler was not installed from Python; the default is the closest to it.
            signal.signal(sig, signal.SIG_DFL if old is None else old)
