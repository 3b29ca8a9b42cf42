"""Run a function on N gloo ranks in fresh processes (forked from a server that imported torch once), with a hard
timeout (a hang fails, never stalls CI); or start a program's ranks from the same server, each as the
interpreter would run ``python program.py ...`` (:func:`start_program`)."""

from __future__ import annotations

import atexit
import os
import pickle
import runpy
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Ranks start from a fork server that imported torch and hsdp once per test session, not from a fresh
# interpreter each (importing torch is most of a rank's start-up, and the suite starts a few hundred ranks on 2
# cores). What a spawned process would inherit from the test at the time of the call, the environment, is
# passed along explicitly (the fork server's own is from its start); the working directory and sys.path travel
# with multiprocessing's preparation data as for spawn.
_CONTEXT = mp.get_context("forkserver")
_CONTEXT.set_forkserver_preload(["torch", "torch.distributed", "torch.distributed.tensor", "numpy", "hsdp",
                                 "hsdp.engine.model", "hsdp.checkpoint", "harness",
                                 "transformers.models.llama.modeling_llama", "lightning.pytorch", "lightning.fabric",
                                 "accelerate", "transformers.trainer"])


def _worker(rank: int, fn: Callable[..., Any], world_size: int, tmp: str, args: tuple, env: dict,
            base_env: dict[str, str]) -> None:
    os.environ.clear()
    os.environ.update(base_env)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank), **env})
    torch.set_num_threads(1)
    out = os.path.join(tmp, f"result_{rank}.pkl")
    try:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=90))
        # Every rank's connections are up before any runs ``fn``: a rank whose ``fn`` returns at once would
        # otherwise exit while a slower peer still connects to it ("Connection closed by peer" in its init).
        dist.barrier()
        result = ("ok", fn(rank, world_size, *args))
    except BaseException:  # report, do not hang the others silently
        result = ("error", traceback.format_exc())
    with open(out, "wb") as f:
        pickle.dump(result, f)
    if dist.is_initialized():
        dist.destroy_process_group()


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 240,
                    env: dict[str, str] | None = None) -> list[Any]:
    """``[fn(rank, world_size, *args) for rank]``, each in its own process; raises with every rank's error."""
    with tempfile.TemporaryDirectory() as tmp:
        procs = [_CONTEXT.Process(target=_worker, args=(r, fn, world_size, tmp, args, env or {}, dict(os.environ)),
                                  daemon=True)
                 for r in range(world_size)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        alive = [p for p in procs if p.is_alive()]
        for p in alive:
            p.kill()
            p.join()
        results, errors = [], []
        for rank in range(world_size):
            path = os.path.join(tmp, f"result_{rank}.pkl")
            if not os.path.exists(path):
                errors.append(f"rank {rank}: no result (exit code {procs[rank].exitcode}; hung or crashed)")
                continue
            with open(path, "rb") as f:
                status, value = pickle.load(f)
            if status == "error":
                errors.append(f"rank {rank}:\n{value}")
            results.append(value)
        if alive or errors:
            raise AssertionError(f"distributed run failed (timeout {timeout}s):\n" + "\n".join(errors))
        return results


class RankProcess:
    """A program started by :func:`start_program`: what the tests use of ``subprocess.Popen``."""

    def __init__(self, process: BaseProcess, args: list[str], log: Path) -> None:
        self._process, self.args, self.log = process, args, log

    @property
    def pid(self) -> int | None:
        return self._process.pid

    @property
    def returncode(self) -> int | None:
        """The exit status as ``Popen`` gives it (``-N``: killed by signal N); ``None`` while it runs."""
        return self._process.exitcode

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """The exit status; raises ``subprocess.TimeoutExpired`` when it still runs after ``timeout`` seconds."""
        self._process.join(timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def kill(self) -> None:
        self._process.kill()

    def output(self) -> str:
        """Everything it wrote to stdout and stderr (read it once it has ended)."""
        return self.log.read_text(errors="replace")


def start_program(path: str | os.PathLike, argv: list[str], env: dict[str, str], log: str | os.PathLike) -> RankProcess:
    """``python path *argv`` with environment ``env`` and stdout and stderr in the file ``log``, as a process of
    the fork server: it starts in a tenth of a second instead of importing torch for seconds. Daemonic, as the
    ranks of :func:`run_distributed` (ended with the test session), so it cannot start multiprocessing children."""
    path, log = os.path.abspath(path), Path(log)
    log.write_bytes(b"")  # there even if the process dies before writing anything
    process = _CONTEXT.Process(target=_run_program, args=(path, argv, env, str(log)), daemon=True)
    process.start()
    return RankProcess(process, [sys.executable, path, *argv], log)


def _run_program(path: str, argv: list[str], env: dict[str, str], log: str) -> NoReturn:
    """The process of :func:`start_program`. The fork server's child already has a fresh interpreter's signal
    dispositions and mask (multiprocessing restores the SIGINT and SIGCHLD handlers the server changed); what
    multiprocessing does differently at the end, this does as the interpreter does: see :func:`_run_main`."""
    os.environ.clear()
    os.environ.update(env)
    fd = os.open(log, os.O_WRONLY | os.O_APPEND)
    for std in (1, 2):
        os.dup2(fd, std)
    os.close(fd)
    sys.argv = [path, *argv]
    sys.path.insert(0, os.path.dirname(path))  # as `python path` puts the script's directory first
    code = _run_main(path)
    # The interpreter's finalization. multiprocessing would skip the atexit handlers (its children leave with
    # os._exit), and hsdp's watchdog marks a rank that finished normally done in one.
    threading._shutdown()  # type: ignore[attr-defined]  # waits for non-daemon threads, as the interpreter does
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    if code == -signal.SIGINT:  # the interpreter ends an uncaught KeyboardInterrupt by dying of SIGINT
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code)


def _run_main(path: str) -> int:
    """Run ``path`` as ``__main__``; the exit status the interpreter would give (``-SIGINT`` for an uncaught
    KeyboardInterrupt, which it ends by dying of that signal)."""
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return (e.code or 0) & 0xFF  # what the parent sees of exit(code)
        print(e.code, file=sys.stderr)
        return 1
    except BaseException as e:
        _excepthook(path, e)
        return -signal.SIGINT if isinstance(e, KeyboardInterrupt) else 1
    return 0


def _excepthook(path: str, error: BaseException) -> None:
    """Hand an uncaught exception to ``sys.excepthook`` as the interpreter does (hsdp chains its own hook there;
    multiprocessing would print the traceback itself), without this module's and runpy's frames."""
    tb = error.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename != path:
        tb = tb.tb_next
    # The hook prints the exception's own traceback: cut there. Raised before the program ran (a syntax error): all.
    tb = error.__traceback__ = tb or error.__traceback__
    sys.last_type, sys.last_value, sys.last_traceback = type(error), error, tb
    try:
        sys.excepthook(type(error), error, tb)
    except BaseException:
        print("Error in sys.excepthook:", file=sys.stderr)
        traceback.print_exc()
