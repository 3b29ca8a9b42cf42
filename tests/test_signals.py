"""One owner installs signal handlers (hsdp.engine.faults.signals): for the block only, main thread only."""

from __future__ import annotations

import os
import signal
import threading

from hsdp.engine.faults.signals import handle_signals


def test_the_handler_runs_in_the_block_and_the_old_one_comes_back() -> None:
    seen: list[int] = []
    before = signal.getsignal(signal.SIGUSR1)
    with handle_signals([signal.SIGUSR1], lambda signum, frame: seen.append(signum)) as installed:
        os.kill(os.getpid(), signal.SIGUSR1)
    assert installed and seen == [signal.SIGUSR1]
    assert signal.getsignal(signal.SIGUSR1) is before


def test_off_the_main_thread_nothing_is_installed() -> None:
    outcome: list[bool] = []

    def body() -> None:
        with handle_signals([signal.SIGUSR1], signal.SIG_IGN) as installed:
            outcome.append(installed)

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    assert outcome == [False]
