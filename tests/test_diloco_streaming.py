"""Streaming DiLoCo (``hsdp.DiLoCo(fragments=F, delay=tau, mix=alpha)``) on a 2 x 2 gloo mesh, ParityNet's four units.

One 4-rank spawn, inner AdamW, outer Nesterov SGD (lr 0.7, momentum 0.9):
- F = 2, H = 4, tau = 1 (8 steps) and F = 3, H = 6, tau = 3, alpha = 0.25 (9 steps: two fragments in flight at
  once): each replica's weights after every run equal a hand-written one-process simulation of two streaming
  workers to 1e-5 (the simulation keeps each worker's weights, so the drift between syncs is checked too);
- F = 1, tau = 0 (the defaults) still equals the same simulation reduced to DiLoCo;
- the fragments are ParityNet's units split by size ([root, blocks.0], [blocks.1, blocks.2] for F = 2);
- inter-node bytes per step: exactly the started fragment's flat shards in fp32 on its step, nothing otherwise;
- the all-reduce is asynchronous: after the step that starts it, its handles are not waited and its stats row has
  no seconds booked (with tau = 0 they are), and it lands tau steps later;
- refused with a ValueError before any collective: more fragments than units (naming the unit count), fragments
  > every, tau < 0, tau >= every, tau not an int, alpha outside [0, 1);
- a checkpoint taken while two fragments' syncs are in flight (F = 3, tau = 3, after step 10) resumes bitwise: the
  syncs in flight, global copy, outer momentum, phase and weights as saved, then the same losses and state 4 steps
  on as the run that went on.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from harness import run_distributed
from models import ParityNet, batch, loss_fn, train_steps

import hsdp

WORLD = 4
RUNS = {"f2": (dict(every=4, fragments=2, delay=1), 8),
        "f3": (dict(every=6, fragments=3, delay=3, mix=0.25), 9),
        "f1": (dict(every=4), 4)}
CKPT_SAVE, CKPT_END = 10, 14  # the "f3" policy: after step 10 fragment 0 (1 step left) and 1 (3 left) in flight


def _build(policy: dict, seed: int = 0) -> tuple[hsdp.ShardedModel, hsdp.ShardedOptimizer]:
    torch.manual_seed(seed)
    sync = hsdp.DiLoCo(outer_lr=0.7, outer_momentum=0.9, **policy)
    model = hsdp.ShardedModel(ParityNet(), mesh=hsdp.init_mesh(2), replica_sync=sync)
    return model, hsdp.ShardedOptimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-2))


def _train(rank: int, policy: dict, steps: int) -> dict:
    model, opt = _build(policy)
    outer = opt._hsdp_outer
    sent, seconds, in_flight = [], [], []
    for step in range(steps):
        model.reset_comm_stats()
        x, y = batch(step, rank)
        loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        row = model.comm_stats().get("replicate", {})
        sent.append(sum(op["bytes"] for op in row.values()))
        seconds.append(row["all_reduce"]["seconds"] if "all_reduce" in row else None)
        in_flight.append([(s.fragment, s.left, sum(not h.done for h in s.handles)) for s in outer.pending])
    params = {n: p.detach().full_tensor() for n, p in model.named_parameters()}
    opt.sync_replicas()
    synced = {n: p.detach().full_tensor() for n, p in model.named_parameters()}
    return {"params": params, "synced": synced, "sent": sent,
            "seconds": seconds, "in_flight": in_flight,
            "fragments": [[u.name for u in outer.fragment_units(f)] for f in range(len(outer.fragments))],
            "flat": {u.name: u.sharded_flat.numel() for u in model.units}}


def _refusals() -> dict[str, str]:
    out = {}
    cases = {"more_than_every": lambda: hsdp.DiLoCo(every=4, fragments=5),
             "negative_delay": lambda: hsdp.DiLoCo(delay=-1), "delay_every": lambda: hsdp.DiLoCo(every=4, delay=4),
             "float_delay": lambda: hsdp.DiLoCo(delay=1.5), "mix_one": lambda: hsdp.DiLoCo(mix=1.0),
             "mix_negative": lambda: hsdp.DiLoCo(mix=-0.1)}
    for name, make in cases.items():
        try:
            make()
            out[name] = "accepted"
        except ValueError as e:
            out[name] = str(e)
    model = hsdp.ShardedModel(ParityNet(), mesh=hsdp.init_mesh(2), replica_sync=hsdp.DiLoCo(every=8, fragments=5))
    model.reset_comm_stats()
    try:
        hsdp.ShardedOptimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        out["more_than_units"] = "accepted"
    except ValueError as e:
        out["more_than_units"] = str(e)
    out["collectives_before"] = str(model.comm_stats())
    return out


def _snapshot(opt: hsdp.ShardedOptimizer) -> dict[str, Any]:
    """This rank's weights, global copy, outer momentum, phase and syncs in flight (their means: waits)."""
    outer = opt._hsdp_outer
    return {"local": [u.sharded_flat.clone() for u in outer.units], "global": [g.clone() for g in outer.global_copy],
            "momentum": [outer.outer.state[g]["momentum_buffer"].clone() for g in outer.global_copy],
            "phase": outer.inner_steps,
            "pending": [(s.fragment, s.left, [m.clone() for m in s.settle()]) for s in outer.pending]}


def _checkpoint_round_trip(rank: int, tmp: str) -> dict[str, Any]:
    policy, out = RUNS["f3"][0], {}
    model, opt = _build(policy)
    out["losses"] = train_steps(model, opt, rank, range(CKPT_SAVE))
    hsdp.save_checkpoint(os.path.join(tmp, "stream"), model, opt, step=CKPT_SAVE)
    out["saved"] = _snapshot(opt)
    out["losses"] += train_steps(model, opt, rank, range(CKPT_SAVE, CKPT_END))
    out["end"] = _snapshot(opt)
    model, opt = _build(policy, seed=1)
    hsdp.load_checkpoint(os.path.join(tmp, "stream"), model, opt)
    out["resumed"] = _snapshot(opt)
    out["resumed_losses"] = train_steps(model, opt, rank, range(CKPT_SAVE, CKPT_END))
    out["resumed_end"] = _snapshot(opt)
    return out


def _worker(rank: int, world: int, tmp: str) -> dict:
    return {**{name: _train(rank, policy, steps) for name, (policy, steps) in RUNS.items()},
            "refusals": _refusals(), "checkpoint": _checkpoint_round_trip(rank, tmp)}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return run_distributed(_worker, WORLD, str(tmp_path_factory.mktemp("streaming")), timeout=240)


def _fragment_of(name: str, fragments: int) -> int:
    """ParityNet's units by fragment, written out: root (embed/head, frozen, twice, unused, norm), blocks.0-2."""
    block = int(name.split(".")[1]) if name.startswith("blocks.") else -1
    return {1: 0, 2: int(block >= 1), 3: 0 if block < 0 else (1 if block < 2 else 2)}[fragments]


def _simulate(every: int, fragments: int = 1, delay: int = 0, mix: float = 0.0, steps: int = 8,
              final: bool = False) -> list[dict[str, torch.Tensor]]:
    """Two streaming DiLoCo workers in one process (replica q trains on its ranks' batches 2q, 2q + 1): fragment f
    computes the mean pseudo-gradient after step s with s % every == (f + 1) * every // fragments % every, and
    after step s + delay the outer optimizer steps its global weights with it and each worker's weights of the
    fragment become mix * local + (1 - mix) * global. ``final``: then ``sync_replicas`` (the syncs in flight land
    so, then every fragment in order syncs at once and each worker's weights become the global copy; right after
    the one fragment's own sync, only the latter: no outer step on a zero pseudo-gradient). Returns each worker's
    weights."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: more threads only contend on the shared cores (20x slower under load)
    try:
        return _simulate_workers(every, fragments, delay, mix, steps, final)
    finally:
        torch.set_num_threads(threads)


def _simulate_workers(every: int, fragments: int, delay: int, mix: float, steps: int,
                      final: bool) -> list[dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    global_model = ParityNet()
    workers = [ParityNet() for _ in range(2)]
    for w in workers:
        w.load_state_dict(global_model.state_dict())
    inner = [torch.optim.AdamW(w.parameters(), lr=1e-2) for w in workers]
    outer = torch.optim.SGD(global_model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    pending: list[tuple[int, dict[str, torch.Tensor]]] = []  # (land after step, mean pseudo-gradient by name)

    def land(means: dict[str, torch.Tensor], share: float = mix) -> None:
        params = dict(global_model.named_parameters())
        for name, mean in means.items():
            params[name].grad = mean
        outer.step()
        outer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for w in workers:
                local = dict(w.named_parameters())
                for name in means:
                    local[name].copy_(share * local[name] + (1 - share) * params[name])

    def pseudo_gradient(f: int) -> dict[str, torch.Tensor]:
        with torch.no_grad():
            return {name: torch.stack([g - dict(w.named_parameters())[name] for w in workers]).mean(0)
                    for name, g in global_model.named_parameters() if _fragment_of(name, fragments) == f}

    for step in range(1, steps + 1):
        for q, (w, opt) in enumerate(zip(workers, inner, strict=True)):
            parts = [batch(step - 1, 2 * q + s) for s in range(2)]
            loss_fn(w(torch.cat([p[0] for p in parts])), torch.cat([p[1] for p in parts])).backward()
            opt.step()
            opt.zero_grad()
        for f in range(fragments):
            if step % every == (f + 1) * every // fragments % every:
                pending.append((step + delay, pseudo_gradient(f)))
        for due in [p for p in pending if p[0] == step]:
            land(due[1])
        pending = [p for p in pending if p[0] > step]
    if final and fragments == 1 and steps % every == 0 and not pending:  # just synced: no outer step again
        with torch.no_grad():
            for w in workers:
                w.load_state_dict(global_model.state_dict())
    elif final:
        for _, means in pending:
            land(means)
        for f in range(fragments):
            land(pseudo_gradient(f), share=0.0)
    return [{n: p.detach().clone() for n, p in w.named_parameters()} for w in workers]


@pytest.mark.parametrize("run", ["f2", "f3", "f1"])
def test_each_replica_equals_simulated_streaming_workers(results: list[dict], run: str) -> None:
    policy, steps = RUNS[run]
    ref = _simulate(**policy, steps=steps)
    for rank, r in enumerate(results):
        for name, value in ref[rank // 2].items():
            torch.testing.assert_close(r[run]["params"][name], value, rtol=1e-5, atol=1e-5, msg=f"{rank} {name}")
    if run != "f1":  # the replicas differ (a fragment is mid-phase): the check above could tell them apart
        assert not torch.equal(results[0][run]["params"]["blocks.0.up.weight"],
                               results[2][run]["params"]["blocks.0.up.weight"])


@pytest.mark.parametrize("run", ["f2", "f3", "f1"])
def test_sync_replicas_leaves_every_replica_the_global_copy_whatever_mix(results: list[dict], run: str) -> None:
    """After ``sync_replicas`` (syncs in flight landed, then every fragment synced) the replicas are equal, the
    global copy, with mix > 0 too ("f3", two syncs in flight: their landings mix, the final syncs replace)."""
    policy, steps = RUNS[run]
    ref = _simulate(**policy, steps=steps, final=True)
    for name, value in ref[0].items():
        torch.testing.assert_close(ref[1][name], value, rtol=0, atol=0)
        for rank, r in enumerate(results):
            torch.testing.assert_close(r[run]["synced"][name], value, rtol=1e-5, atol=1e-5, msg=f"{rank} {name}")
            assert torch.equal(r[run]["synced"][name], results[0][run]["synced"][name]), (rank, name)


def test_fragments_split_the_units_by_size(results: list[dict]) -> None:
    for r in results:
        assert r["f2"]["fragments"] == [["ParityNet(root)", "Block(blocks.0)"], ["Block(blocks.1)", "Block(blocks.2)"]]
        assert r["f3"]["fragments"] == [["ParityNet(root)"], ["Block(blocks.0)", "Block(blocks.1)"],
                                        ["Block(blocks.2)"]]
        assert r["f1"]["fragments"] == [["ParityNet(root)", "Block(blocks.0)", "Block(blocks.1)", "Block(blocks.2)"]]


def test_each_sync_carries_only_its_fragment(results: list[dict]) -> None:
    for r in results:
        flat = r["f2"]["flat"]
        f0 = 4 * (flat["ParityNet(root)"] + flat["Block(blocks.0)"])  # fp32 pseudo-gradients of this rank's shards
        f1 = 4 * (flat["Block(blocks.1)"] + flat["Block(blocks.2)"])
        assert r["f2"]["sent"] == [0, f0, 0, f1, 0, f0, 0, f1]  # fragment 0 after steps 2 and 6, 1 after 4 and 8
        assert r["f1"]["sent"] == [0, 0, 0, f0 + f1]


def test_the_all_reduce_is_not_waited_by_the_step_that_starts_it(results: list[dict]) -> None:
    for r in results:
        # (fragment, steps left, handles not waited) after each step: the one started lands one step later.
        assert r["f2"]["in_flight"] == [[], [(0, 1, 2)], [], [(1, 1, 2)]] * 2
        assert r["f2"]["seconds"] == [None, 0] * 4  # no wait booked at the start
        # tau = 3: fragments 0 and 1 in flight together after step 4 (and 1 and 2 after step 6, ...); fragment 0's
        # all-reduce, one step old, may have been settled already by the poll after a step (never waited for).
        (old, left, handles), young = r["f3"]["in_flight"][3]
        assert (old, left, young) == (0, 1, (1, 3, 2)) and handles in (0, 1)
        [(fragment, left, handles)] = r["f3"]["in_flight"][4]
        assert (fragment, left) == (1, 2) and handles in (0, 2)
        assert r["f1"]["in_flight"] == [[]] * 4
        assert r["f1"]["seconds"][3] > 0  # tau = 0: the step itself waits


def test_refusals_name_the_fix(results: list[dict]) -> None:
    got = results[0]["refusals"]
    assert "fragments must be <= every" in got["more_than_every"]
    for case in ("negative_delay", "delay_every", "float_delay"):
        assert "use an int with 0 <= delay < every" in got[case], case
    for case in ("mix_one", "mix_negative"):
        assert "must be a float with 0 <= mix < 1" in got[case], case
    assert "the model has 4 units with parameters" in got["more_than_units"]
    assert "use fragments <= 4" in got["more_than_units"]
    assert got["collectives_before"] == "{}"


def _same(a: Any, b: Any) -> bool:
    """Bitwise equality of nested lists, tuples and dicts of tensors and numbers."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def test_a_checkpoint_with_syncs_in_flight_resumes_bitwise(results: list[dict]) -> None:
    for r in results:
        got = r["checkpoint"]
        assert [(f, left) for f, left, _ in got["saved"]["pending"]] == [(0, 1), (1, 3)]  # what must survive
        assert got["saved"]["phase"] == CKPT_SAVE % 6
        assert _same(got["resumed"], got["saved"])
        assert got["resumed_losses"] == got["losses"][CKPT_SAVE:]
        assert _same(got["resumed_end"], got["end"])
        assert not _same(got["end"]["global"], got["saved"]["global"])  # the in-flight syncs landed after the resume
