"""Hangs in collectives hsdp does not issue (DTensor's full_tensor, a user's all_reduce, a barrier).

The sampler and the judgement are checked without processes (fake torch.distributed frames, crafted
snapshots); the end-to-end cases run 4 ranks of programs/foreign_worker.py with FaultPolicy(timeout=3).
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest
import torch.distributed as dist

from hsdp.engine.faults import stacks
from hsdp.engine.faults.foreign import foreign_report, judge_foreign, working_notice
from hsdp.engine.faults.hang import judge, report
from hsdp.engine.faults.stacks import MainThreadSampler, describe_record, main_thread_stack

PROGRAM = Path(__file__).parent / "programs" / "foreign_worker.py"
TIMEOUT = 3.0

# Stand-ins for DTensor's API and the functional collectives' wait, compiled under torch.distributed's own
# file names: the sampler knows code only by where it lives. The wait blocks in C (a lock), as a real one
# blocks in C++, so no other Python frame is inside it.
_FAKE_WAIT = "def wait_tensor(lock):\n    lock.acquire()\n    lock.release()\n"
_FAKE_API = ("class DTensor:\n"
             "    def full_tensor(self, lock):\n"
             "        return _ops_call(wait_tensor, lock)\n")
_FAKE_OPS = "def _ops_call(fn, lock):\n    return fn(lock)\n"
_FAKE_DISPATCH = ("class OpDispatcher:\n"
                  "    def dispatch(self, lock):\n"
                  "        return wait_tensor(lock)\n")


def _fake_torch() -> dict:
    names: dict = {}
    exec(compile(_FAKE_WAIT, stacks._BLOCKING[1], "exec"), names)
    exec(compile(_FAKE_OPS, os.path.join(stacks._TORCH, "_ops.py"), "exec"), names)
    exec(compile(_FAKE_API, os.path.join(stacks._DIST, "tensor", "_api.py"), "exec"), names)
    exec(compile(_FAKE_DISPATCH, stacks._DISPATCH, "exec"), names)
    return names


def _caller(api: object, lock: threading.Lock) -> None:
    api.full_tensor(lock)  # the user's line: the call site the sampler names


def test_the_sampler_sees_a_blocking_call_its_api_caller_and_how_long_it_stays_still(monkeypatch) -> None:
    fake, lock, issued = _fake_torch(), threading.Lock(), [0]
    monkeypatch.setattr(stacks, "issued_collectives", lambda: issued[0])
    lock.acquire()
    thread = threading.Thread(target=_caller, args=(fake["DTensor"](), lock), daemon=True)
    thread.start()
    time.sleep(0.2)
    sampler = MainThreadSampler(thread)
    first = sampler.sample()
    assert (first.entry, first.op, first.blocked) == ("DTensor.full_tensor", "wait_tensor", True), first
    assert first.site.startswith("tests/test_foreign_hangs.py:") and first.site.endswith("in _caller"), first
    assert sampler.sample().still_since == first.still_since  # one call, nothing issued: still
    issued[0] += 1  # a collective issued (a loop of short ones, sampled at the same line): not still
    moved = sampler.sample()
    assert moved.still_since > first.still_since and moved.moves == first.moves + 1
    text = main_thread_stack(thread=thread)
    assert "api.full_tensor(lock)" in text and "in full_tensor" in text and "in wait_tensor" in text, text
    assert "_ops_call" not in text and "... 1 frame(s) inside torch" in text, text
    lock.release()
    thread.join()
    assert describe_record(first.record(first.still_since + 4)) == (
        f"DTensor.full_tensor (waiting in wait_tensor), called from {first.site}")


def test_an_operator_on_a_dtensor_and_an_error_raised_in_a_collective_are_named() -> None:
    fake, lock = _fake_torch(), threading.Lock()
    lock.acquire()
    thread = threading.Thread(target=fake["OpDispatcher"]().dispatch, args=(lock,), daemon=True)
    thread.start()
    time.sleep(0.2)
    where = MainThreadSampler(thread).sample()
    lock.release()
    thread.join()
    assert (where.entry, where.op, where.blocked) == ("DTensor operator", "wait_tensor", True), where

    # Raised from C inside the wait, as gloo raises from C++ when a peer closed its connection.
    broken = types.SimpleNamespace(acquire=threading.Lock().release)  # releasing an unheld lock raises
    with pytest.raises(RuntimeError) as error:
        _caller(fake["DTensor"](), broken)
    raised = stacks.raised_in_collective(error.value.__traceback__)
    assert raised.startswith("DTensor.full_tensor (waiting in wait_tensor), called from tests/test_foreign_hangs.py:")
    assert raised.endswith("in _caller"), raised


def test_the_sampler_of_a_thread_outside_torch_distributed_sees_no_collective() -> None:
    event = threading.Event()
    thread = threading.Thread(target=event.wait, daemon=True)
    thread.start()
    where = MainThreadSampler(thread).sample()
    event.set()
    thread.join()
    assert (where.entry, where.op, where.blocked) == ("", "", False), where


def main(entry: str, op: str, seconds: float, blocked: bool = True) -> list:
    return [entry, op, "train.py:40 in save", blocked, seconds]


def snap(main_record: list | None = None, waiting: list | None = None, busy: list | None = None) -> dict:
    return {"seq": 9, "recent": [], "waiting": waiting, "busy": busy, "main": main_record, "t": 100.0}


GATHER = main("DTensor.full_tensor", "wait_tensor", 6.0)
BARRIER = main("dist.barrier", "barrier", 6.0)


def test_each_rank_is_classified_against_a_foreign_wait() -> None:
    snapshots = {
        0: snap(GATHER),
        1: snap(main("DTensor.full_tensor", "", 2.0, blocked=False)),  # same API, between two gathers: with it
        2: snap(BARRIER),  # blocked as long in another collective: a deadlock
        3: snap(main("dist.barrier", "barrier", 1.0)),  # only just arrived there: judged later
        4: snap(),  # exited
        5: snap(main("", "", 0.0, blocked=False)),  # in no collective: presumed working
        6: snap(busy=["writing the manifest", 7.0]),
        7: snap(waiting=[12, "hsdp::all_gather[shard] blocks.0", "", 5.0]),  # in hsdp's own for the bound
        8: None,  # no watchdog published anything
    }
    v = judge_foreign(0, snapshots, gone={4}, timeout=TIMEOUT, now=100.0)
    assert v.waiting == [0, 1] and list(v.elsewhere) == [2] and list(v.pending) == [3] and v.gone == [4]
    assert v.working == [5, 8] and list(v.busy) == [6] and list(v.in_hsdp) == [7]
    # Ranks still on their way (pending, working, busy) may be what everyone waits for: not a deadlock yet.
    assert not v.deadlocked
    settled = {r: s for r, s in snapshots.items() if r in (0, 1, 2, 4, 7)}
    assert judge_foreign(0, settled, gone={4}, timeout=TIMEOUT, now=100.0).deadlocked
    alone = judge_foreign(0, {0: snap(GATHER), 1: snap(main("", "", 9.0, blocked=False))}, set(), TIMEOUT, 100.0)
    assert not alone.deadlocked and alone.working == [1]  # rank 1 may be what rank 0 waits for: not a hang
    together = judge_foreign(0, {0: snap(GATHER), 1: snap(GATHER), 2: snap(GATHER)}, set(), TIMEOUT, 100.0)
    assert not together.deadlocked and together.waiting == [0, 1, 2]  # one long call on every rank
    # Ranks 2, 3 in a world all_reduce wait for ranks 0, 1, whose gather waits for rank 1, still computing.
    subgroup = {0: snap(GATHER), 1: snap(main("", "", 0.5, blocked=False)), 2: snap(BARRIER), 3: snap(BARRIER)}
    assert not judge_foreign(0, subgroup, set(), TIMEOUT, 100.0).deadlocked


def test_the_foreign_report_names_every_group_its_stack_and_the_cause() -> None:
    snapshots = {0: snap(GATHER), **{r: snap(BARRIER) for r in (1, 2, 3)}}
    v = judge_foreign(1, snapshots, gone=set(), timeout=TIMEOUT, now=101.0)
    stacks_ = {0: '  File "train.py", line 40, in save\n    p.full_tensor()', 1: '  File "train.py", line 44'}
    text = foreign_report(1, v, snapshots, stacks_, 101.0)
    first = text.splitlines()[0]
    assert first == ("hang: rank(s) 1, 2, 3 waited 7 s in dist.barrier, a collective hsdp does not issue; "
                     "in a different collective: rank(s) 0"), first
    assert ("rank(s) 0 are in a different collective: DTensor.full_tensor (waiting in wait_tensor), called "
            "from train.py:40 in save, for 7 s") in text
    assert "rank(s) 0 now at:" in text and "p.full_tensor()" in text
    assert "likely cause: ranks called different collectives (dist.barrier on rank(s) 1, 2, 3; " in text
    assert "DTensor.full_tensor on rank(s) 0)" in text and "write on rank 0 only" in text
    gone = judge_foreign(0, {0: snap(GATHER), 1: snap(), 2: snap()}, gone={1, 2}, timeout=TIMEOUT, now=100.0)
    text = foreign_report(0, gone, snapshots, {0: "stack"}, 100.0)
    assert text.splitlines()[0].endswith("exited: rank(s) 1, 2")
    assert ("DTensor.full_tensor is a collective: every rank must call it (rank(s) 0 did, rank(s) 1, 2 exited "
            "without calling it)") in text


def test_the_working_notice_and_hsdp_own_report_name_the_foreign_call() -> None:
    v = judge_foreign(1, {0: snap(main("", "", 9.0, blocked=False)), 1: snap(BARRIER)}, set(), TIMEOUT, 100.0)
    notice = working_notice(v, BARRIER, {0: '  File "train.py", line 12, in save\n    f.write(blob)'})
    assert notice.startswith("note: rank(s) 1 have waited 6 s in dist.barrier, called from train.py:40 in save; they "
                             "wait for rank(s) 0, which are in no collective"), notice
    assert "f.write(blob)" in notice
    waited = [12, "hsdp::all_gather[shard] root", "", 6.0]
    snapshots = {0: snap(waiting=waited), 1: {**snap(BARRIER), "seq": 11}}
    text = report(0, waited, judge(0, waited, snapshots, set()), snapshots, {}, 100.0)
    assert ("rank(s) 1 never entered it; it is in a collective hsdp does not issue: dist.barrier, called from "
            "train.py:40 in save") in text, text


@functools.cache
def _run(case: str) -> tuple[list[subprocess.Popen], list[str], float]:
    """Four ranks of foreign_worker.py (once per case: two tests read the first); the store lives in this
    process (as torchrun's agent hosts it). Returns the processes, their outputs, and the seconds from rank
    0's misuse to the last rank's exit."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    procs = []
    for rank in range(4):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(store.port), "TORCHELASTIC_USE_AGENT_STORE": "True", "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, str(PROGRAM), case, str(TIMEOUT)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    try:
        for p in procs:
            p.wait(timeout=120)
        end = time.time()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    outputs = [p.stdout.read() for p in procs]
    fault = re.search(r"misbehaving \(\w+\) at ([\d.]+)", outputs[0])
    return procs, outputs, end - float(fault.group(1)) if fault else float("nan")


# (case, what the report must say, exit codes of ranks 1-3): rank 0 alone in a foreign collective.
MISUSES = [
    ("full_tensor_barrier", ["waited", "DTensor.full_tensor", "dist.barrier", "p.full_tensor()", "in wait_tensor",
                             "likely cause: ranks called different collectives"], 75),
    ("all_reduce_barrier", ["dist.all_reduce", "dist.barrier", "dist.all_reduce(torch.ones(4))",
                            "likely cause: ranks called different collectives"], 75),
    # Either hsdp's report (exit 75) or, when gloo notices the closed connections first, the error it raises
    # (exit 1) completed by the watchdog's "rank(s) [1, 2, 3] exited normally while rank 0 was in ...".
    ("full_tensor_exit", ["exited", "1, 2, 3", "DTensor.full_tensor", "p.full_tensor()"], 0),
]


@pytest.mark.parametrize(("case", "expected", "others_rc"), MISUSES, ids=[m[0] for m in MISUSES])
def test_a_collective_on_rank_0_alone_ends_every_rank_naming_rank_0_and_its_stack(case: str, expected: list[str],
                                                                                 others_rc: int) -> None:
    procs, outputs, elapsed = _run(case)
    everything = "\n".join(outputs)
    assert "misbehaving" in outputs[0], outputs[0][-3000:]
    for text in expected:
        assert text in everything, (text, everything[-5000:])
    assert procs[0].returncode != 0, outputs[0][-3000:]
    for rank, p in enumerate(procs):
        assert "finished without noticing" not in outputs[rank] or (rank > 0 and others_rc == 0)
        if rank > 0:
            assert p.returncode == others_rc, (rank, outputs[rank][-3000:])
        if p.returncode != 0:  # every rank that was ended says why, naming rank 0
            assert re.search(r"rank(\(s\))? \[?0\b", outputs[rank]), (rank, outputs[rank][-3000:])
    # The bound: timeout, a few beats, the stack requests, the linger; a real hang waits 5 minutes here.
    assert elapsed < TIMEOUT + 20, elapsed


def test_every_rank_in_the_same_long_foreign_calls_or_waiting_for_rank_0_working_is_not_a_hang() -> None:
    # The first phase of the full_tensor_barrier job: gathers and all-reduces on every rank for longer than the
    # bound, then ranks 1-3 wait in a barrier for twice the bound while rank 0 "writes a checkpoint".
    _, outputs, _ = _run("full_tensor_barrier")
    for rank, out in enumerate(outputs):
        before, done, _ = out.partition(f"rank {rank}: legitimate waits done")
        assert done and "hang:" not in before and "aborting" not in before, (rank, out[-3000:])
    # Rank 0 "writing a checkpoint" is named once, with its stack (a rank the busy machine starves may be too).
    notices = [line for o in outputs for line in o.split("[hsdp rank") if "presumed to be working alone" in line]
    assert any(re.search(r"wait for rank\(s\) 0\b", n) and "time.sleep(2 * timeout)" in n for n in notices), notices
