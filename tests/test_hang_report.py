"""Naming a hang from the ranks' ledgers (pure functions: no processes) and the ledger's bookkeeping.

The end-to-end cases (a rank asleep, gone, in another collective, calling a helper alone) are in
test_faults.py; these pin down each classification and what the report says about it.
"""

from __future__ import annotations

from hsdp.engine.faults.hang import judge, likely_cause, report
from hsdp.engine.faults.ledger import CollectiveLedger

GATHER = "hsdp::all_gather[shard] blocks.1"
WAITED = [7, GATHER, "", 50.0]  # [seq, region, phase, seconds]


def snap(seq: int, recent: list[list], waiting: list | None = None, busy: list | None = None) -> dict:
    return {"seq": seq, "recent": recent, "waiting": waiting, "busy": busy, "t": 100.0}


def test_each_rank_is_classified_against_the_earliest_waited_collective() -> None:
    snapshots = {
        0: snap(7, [[7, GATHER, "", 50.0]], waiting=[7, GATHER, "", 50.0]),
        1: snap(6, [[6, "hsdp::reduce_scatter[shard] root", "", 55.0]]),  # late
        2: snap(7, [[7, "hsdp::all_reduce[world] grad norm", "hsdp.clip_grad_norm_", 50.0]]),  # mismatched
        3: snap(9, [[7, GATHER, "", 52.0], [9, "hsdp::all_reduce[replicate] root", "", 40.0]],
                waiting=[9, "hsdp::all_reduce[replicate] root", "", 40.0]),  # ran ahead
        4: snap(3, [], busy=["writing the manifest", 49.0]),  # rank 0's part of a step: not a hang
        5: snap(2, []),  # exited normally
    }
    v = judge(0, WAITED, snapshots, gone={5})
    assert v.waiting == [0] and v.late == [1] and list(v.mismatched) == [2]
    assert v.downstream == [3] and list(v.busy) == [4] and v.gone == [5] and v.offenders


def test_the_report_names_ranks_collectives_stacks_and_the_cause() -> None:
    snapshots = {0: snap(7, [], waiting=WAITED), 1: snap(6, [[6, "hsdp::reduce_scatter[shard] root", "", 55.0]]),
                 2: snap(7, [[7, GATHER, "", 50.0]], waiting=WAITED)}
    v = judge(0, WAITED, snapshots, gone=set())
    text = report(0, WAITED, v, snapshots, {1: '  File "train.py", line 9, in <module>\n    time.sleep(60)'}, 103.0)
    first = text.splitlines()[0]
    assert first == "hang: rank(s) 0, 2 waited 50 s in collective #7 all_gather[shard] blocks.1; late: rank(s) 1"
    assert "rank(s) 1 never entered it; its last was collective #6 reduce_scatter[shard] root, 58 s ago" in text
    assert "rank(s) 1 now at:" in text and "time.sleep(60)" in text
    assert "likely cause: the late rank(s) are busy outside hsdp's collectives" in text


def test_likely_causes() -> None:
    snapshots = {1: snap(6, [])}
    late = judge(0, [7, GATHER, "hsdp.full_state_dict", 50.0], snapshots, gone=set())
    assert likely_cause("hsdp.full_state_dict", late, snapshots) == (
        "hsdp.full_state_dict is a collective: every rank must call it (rank(s) 0 did, rank(s) 1 did not)")
    gone = judge(0, WAITED, snapshots, gone={1})
    assert likely_cause("", gone, snapshots).startswith("rank(s) 1 finished early")
    other = judge(0, WAITED, {1: snap(7, [[7, GATHER, "ShardedModel.check_replicas", 1.0]])}, gone=set())
    assert "ranks issued different collectives (ShardedModel.check_replicas)" in likely_cause("", other, snapshots)


def test_nobody_late_is_not_a_hang_yet() -> None:
    snapshots = {1: snap(7, [[7, GATHER, "", 49.0]], waiting=[7, GATHER, "", 49.0]),
                 2: snap(5, [], busy=["hashing the checkpoint", 60.0])}
    v = judge(0, WAITED, snapshots, gone=set())
    assert not v.offenders and v.waiting == [0, 1] and list(v.busy) == [2]


class _Work:
    def __init__(self) -> None:
        self.finished = False

    def is_completed(self) -> bool:
        return self.finished

    def wait(self) -> bool:
        return True


def test_the_ledger_tracks_pending_collectives_phases_and_busy_regions() -> None:
    ledger = CollectiveLedger()
    a, b = _Work(), _Work()
    first = ledger.enter("hsdp::all_gather[shard] root", a)
    with ledger.phase("hsdp.full_state_dict"):
        second = ledger.enter("hsdp::all_gather[shard] blocks.0", b)
    assert (first.seq, second.seq, second.phase) == (1, 2, "hsdp.full_state_dict")
    assert ledger.oldest_pending() is first
    a.finished = True  # completed without being waited (the watchdog thread retires it)
    assert ledger.oldest_pending() is second and first.work is None
    ledger.done(second)
    assert ledger.oldest_pending() is None and second.work is None
    with ledger.busy("writing the manifest"):
        snapshot = ledger.snapshot()
    assert snapshot["seq"] == 2 and snapshot["waiting"] is None and snapshot["busy"][0] == "writing the manifest"
    assert [r[:3] for r in snapshot["recent"]] == [[1, "hsdp::all_gather[shard] root", ""],
                                                   [2, "hsdp::all_gather[shard] blocks.0", "hsdp.full_state_dict"]]
    assert ledger.snapshot()["busy"] is None


class _Event:
    """A CUDA event's polling face (``query``)."""

    def __init__(self) -> None:
        self.completed = False

    def query(self) -> bool:
        return self.completed


def test_a_collective_waited_on_a_stream_stays_pending_until_its_completion_event_fires() -> None:
    """On CUDA ``Handle.wait()`` only makes a stream wait: the host moves on while NCCL may still be stuck, so
    the ledger keeps the entry, with the event recorded after the wait in place of the work (and its buffers),
    and the watchdog retires it once the event completes. Where the wait blocks until completion (gloo, no
    ``completion``), waiting retires it at once."""
    from hsdp.engine.collectives import Handle

    ledger = CollectiveLedger()
    event = _Event()
    cuda_work, gloo_work = _Work(), _Work()
    on_cuda = ledger.enter("hsdp::all_reduce[replicate] blocks.0", cuda_work)
    Handle(cuda_work, retire=lambda marker: ledger.done_when(on_cuda, marker), completion=lambda: event).wait()
    assert ledger.oldest_pending() is on_cuda and on_cuda.work is event, "retired when the wait was enqueued"
    event.completed = True
    assert ledger.oldest_pending() is None and on_cuda.work is None
    on_gloo = ledger.enter("hsdp::all_reduce[replicate] blocks.1", gloo_work)
    Handle(gloo_work, retire=lambda marker: ledger.done_when(on_gloo, marker)).wait()
    assert on_gloo.seq not in ledger.pending
