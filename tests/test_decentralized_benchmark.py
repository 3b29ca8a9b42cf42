"""``benchmarks/decentralized.py``'s arguments and accounting on made-up logs (its launches take ten minutes): the
tokens a killed incarnation trained after its last landed sync are not kept, nor those a heal overwrote; the
alone rate, the bytes per step, the stop step between syncs, the recovery after a kill; torchft's refusals."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import decentralized as bench  # noqa: E402
import decentralized_report as report  # noqa: E402

TOKENS = 10


def _step(t: float, step: int, landed: bool = False, sent: int = 0, **extra: object) -> dict:
    return {"t": t, "step": step, "tokens": TOKENS, "sent": sent, "committed": True, "replicas": [0, 1],
            "landed": [0] if landed else [], **extra}


def _run() -> dict:
    """Two 1-rank replicas, 0.1 s a step, a sync landing after every 10th step. Replica 1's first incarnation
    dies after step 34 (its last landed sync after step 29: steps 30-34 are lost); its second trains 40-99."""
    lands = {s for s in range(100) if s % 10 == 9}
    steady = [_step(0.1 * s, s, s in lands, sent=1000 if s in lands else 0) for s in range(100)]
    first = [{"joined": 0}, *[_step(0.1 * s, s, s in lands) for s in range(35)]]
    second = [{"joined": 40}, *[_step(0.1 * s, s, s in lands) for s in range(40, 100)]]
    return {"logs": {(0, 0): [steady], (1, 0): [first, second]}, "t0": 0.0, "window": 9.95, "kills": [],
            "links": None}


def test_kept_tokens_drop_a_dead_incarnations_unsynced_steps():
    run = _run()
    assert report.kept_tokens(run, window_only=False) == TOKENS * (100 + 30 + 60)
    run["t0"], run["window"] = 2.0, 5.0  # steps 20..70 of the window (inclusive bounds, float times)
    kept = report.kept_tokens(run)
    assert kept == TOKENS * (len(range(20, 71)) + len(range(20, 30)) + len(range(40, 71)))


def test_kept_steps_drop_what_a_heal_overwrote():
    """torchft's restarted node: 8 steps from its fresh start, healed during the 8th (its landing then carries
    the peer's weights), then steps 50.. of the others, landing after 59."""
    fresh = [_step(0.1 * s, s, landed=False) for s in range(7)]
    healed = _step(0.7, 7, landed=True, healed=0.7)
    after = [_step(1.0 + 0.1 * s, s, landed=s == 59) for s in range(50, 65)]
    kept = report.kept_steps([{"joined": 0}, *fresh, healed, *after], died=False)
    assert [r["step"] for r in kept] == list(range(50, 65))
    assert [r["step"] for r in report.kept_steps([*fresh, healed, *after], died=True)] == list(range(50, 60))


def test_alone_rate_and_bytes_per_step():
    run = _run()
    assert report.alone_rate(run) == TOKENS * (100 + 35 + 60) / run["window"]
    assert report.node_bytes_per_step(run, [1, 1], in_window=True) == 100.0  # 10 syncs of 1000 B over 100 steps
    assert report.median_step_s(run) == pytest.approx(0.1)


def _sync(t: float, step: int, members: list[int], committed: bool = True, **extra: object) -> dict:
    return {"t": t, "step": step, "tokens": TOKENS, "sync": 0, "committed": committed, "replicas": members,
            "landed": [0] if committed else [], **extra}


def test_recoveries_and_committed_fraction_on_torchft_style_logs():
    """Three replicas syncing every second; replica 2 killed at 10.5 s: the survivors' sync at 11 s fails, at
    12 s they commit alone; its restart joins at 15 s, heals at 18 s, ends its first counted step at 18.4 s."""
    def leader(q: int) -> list[dict]:
        out = []
        for s in range(20):
            t = float(s)
            if t < 10.5:
                out.append(_sync(t, s, [0, 1, 2]))
            elif q != 2:
                out.append(_sync(t, s, [0, 1, 2] if t >= 18 else [0, 1], committed=t != 11))
        return out

    restarted = [{"joined": 0, "t": 15.0}, {"t": 16.0, "step": 0, "tokens": TOKENS},
                 _sync(18.0, 7, [0, 1, 2], healed=18.0), {"t": 18.4, "step": 18, "tokens": TOKENS}]
    run = {"logs": {(0, 0): [leader(0)], (1, 0): [leader(1)], (2, 0): [[{"joined": 0, "t": 0.0}, *leader(2)],
                                                                       restarted]},
           "kills": [{"t": 10.5, "victim": 2, "ranks_killed": 2}], "t0": 0.0, "window": 19.5, "links": None}
    assert report.recoveries(run) == ([1.5], [7.9])
    assert report.committed_fraction(run) == pytest.approx(19 / 20)
    for q in (0, 1):  # a kill in an all-reduce: no commit without it; the first after its restart joined counts
        run["logs"][(q, 0)] = [[r if r["t"] < 10.5 or r["t"] >= 18 else {**r, "committed": False}
                                for r in run["logs"][(q, 0)][0]]]
    assert report.recoveries(run) == ([7.5], [7.9])


def test_stop_step_falls_between_a_landing_and_the_next_start():
    args = argparse.Namespace(every=40, fragments=4, delay=2)
    for newest in range(0, 30):
        stop = bench._stop_step(newest, args, "decentralized")
        assert stop >= newest + 20 and (stop + 1) % 10 == 3  # a sync started after step 9 landed after 11
    assert bench._stop_step(5, args, "alone") == 25
    assert bench._stop_step(5, args, "torchft") == 25  # its ranks go past a sync in flight themselves


def test_the_shown_command_leaves_out_this_machines_folders():
    assert report.shown_argv(["--minutes", "5", "--keep", "/x", "--tag", "t", "--keep=/y", "--results", "/r",
                              "--results=/s"]) == ["--minutes", "5", "--tag", "t"]


def test_torchft_refuses_unequal_layouts_naming_the_fix():
    with pytest.raises(SystemExit, match=r"--ranks-per-node 2,2,2 with --batches of 6 counts"):
        bench.check(bench.parse(["--systems", "hsdp,torchft"]))  # the default layout: 2,1,1
    with pytest.raises(SystemExit, match="baselines are hsdp's"):
        bench.check(bench.parse(["--systems", "torchft", "--ranks-per-node", "1,1,1", "--batches", "4,4,4"]))
    with pytest.raises(SystemExit, match="--plain-every must be at least 1"):
        bench.check(bench.parse(["--plain-every", "0"]))
    with pytest.raises(SystemExit, match="choose from"):
        bench.check(bench.parse(["--systems", "hsdp,ddp"]))
    with pytest.raises(SystemExit, match="--delay below"):
        bench.check(bench.parse(["--systems", "hsdp,torchft", "--ranks-per-node", "1,1,1", "--batches", "4,4,4",
                                 "--delay", "20"]))


def test_arguments_reach_every_launch(tmp_path: Path):
    args = bench.parse(["--ranks-per-node", "2,2,2", "--batches", "4,4,4,4,4,4", "--node-cpus", "0.6,0.6,0.6",
                        "--results", str(tmp_path)])
    assert (args.systems, bench.check(args), args.results) == ("hsdp", ["hsdp"], tmp_path)
    assert bench.parse([]).results == bench.RESULTS
    job = bench.parse([*bench._job_args(args, "torchft", eval_at="", port="1234"), "--out", "o"])
    assert (job.mode, job.lighthouse_port, job.nproc, job.batches, job.every, job.fragments, job.delay) == \
        ("torchft", 1234, "2,2,2", "4,4,4,4,4,4", 60, 4, 2)
    plain = bench.parse([*bench._job_args(args, "plain", steps=90, eval_at="50,90"), "--out", "o"])
    assert (plain.steps, plain.eval_at, plain.lighthouse_port, plain.pace) == (90, "50,90", None, True)
    args.pace = False
    assert not bench.parse([*bench._job_args(args, "decentralized"), "--out", "o"]).pace
    flags = bench._launch_flags(args, "torchft", Path("links.json"))
    assert flags[:1] == ["--elastic"] and flags == bench._launch_flags(args, "decentralized", Path("links.json"))
    assert "--no-emulation" in bench._launch_flags(args, "plain", Path("links.json"))


def test_measure_and_the_side_by_side_table():
    """Both systems measured on the same made-up run; plain evaluated where each one's kept tokens are reached."""
    def with_eval(run: dict) -> dict:
        for incs in run["logs"].values():
            incs[-1].append({"eval": 2.0, "after": 99, "t": 10.0})
        run["links"] = {"nodes": [{"sent_bytes": 5000}, {"sent_bytes": 8000}]}
        return run

    plain = {"logs": {(0, 0): [[_step(0.1 * s, s, sent=400) for s in range(20)]
                               + [{"eval": 1.9, "after": 18, "t": 2.0}, {"eval": 1.8, "after": 19, "t": 2.0}]]},
             "t0": None, "window": 0.0, "kills": [], "links": None}
    runs = {"hsdp": with_eval(_run()), "torchft": with_eval(_run())}
    m = report.measure([_run(), _run()], runs, plain, [1, 1], {"hsdp": 19, "torchft": 20})
    hsdp, torchft = m["systems"]["hsdp"], m["systems"]["torchft"]
    assert (hsdp["held_out_plain"], torchft["held_out_plain"]) == (1.9, 1.8)
    assert torchft["held_out_gap"] == pytest.approx(2.0 / 1.8 - 1, abs=1e-4)
    assert hsdp["link_bytes_per_step_node"] == 80 and torchft["hsdp_bytes_per_step_node"] is None
    assert m["compute_utilization"] == hsdp["utilization"] and m["held_out_plain"] == 1.9
    # Every frame the nodes sent (5000 + 8000 over 100 steps), against plain HSDP's count (400 per step).
    assert (m["decentralized_link_bytes_per_step_all"], m["link_bytes_ratio_all"]) == (130, 3.1)
    assert "| plain / decentralized bytes, all nodes summed (hsdp's count; link counters) | " in "\n".join(
        report.table(m)) and report.table(m)[-1].endswith("3.1x | >= 100x: no |")
    timeouts = {"heartbeat_interval": 0.25, "heartbeat_timeout": 3.0, "hop_timeout": 60.0, "connect_timeout": 10.0,
                "join_timeout": 300.0, "start_grace": 60.0}
    lines = report.side_by_side(m, timeouts, "int8", [1, 1])
    assert "| | hsdp | torchft |" in lines and any("the plain module" in line for line in lines)
    assert any(line.startswith("| ... hsdp's own count") and line.endswith("| n/a |") for line in lines)


def test_plain_reference_is_the_mean_of_its_evaluations_around_equal_tokens():
    """Plain's held-out loss at a system's tokens: the evaluations within the span averaged (a jittering last
    iterate), the one at the step and the window's range reported beside it; span 0: that one evaluation."""
    assert report.plain_grid([200], 100, 25) == [100, 125, 150, 175, 200, 225, 250, 275, 300]
    assert report.plain_grid([30], 100, 25) == [1, 26, 30, 51, 76, 101, 126]
    assert report.plain_grid([50, 20], 0, 25) == [20, 50] and report.plain_grid([50, 60], 10, 10) == [40, 50, 60, 70]
    evals = {99: 2.0, 124: 1.7, 149: 1.9, 174: 1.5, 199: 1.8, 399: 1.0}  # after = steps done - 1
    plain = {"logs": {(0, 0): [[_step(0.1 * s, s) for s in range(5)]
                               + [{"eval": v, "after": a, "t": 1.0} for a, v in evals.items()]
                               + [{"eval": 1.0, "after": 399, "t": 2.0}]]}}  # the closing one repeats the last
    assert report.evals_near(plain, 350, 50) == [1.0]
    ref = report.plain_reference(plain, 150, 50)
    assert ref["held_out_plain"] == pytest.approx((2.0 + 1.7 + 1.9 + 1.5 + 1.8) / 5)
    assert (ref["held_out_plain_at_step"], ref["held_out_plain_range"], ref["plain_evals"]) == (1.9, [1.5, 2.0], 5)
    assert report.plain_reference(plain, 150, 0)["held_out_plain"] == 1.9
    m = {"plain_steps": 150, **ref}
    assert report._plain_steps(m) == "the mean of 5 evaluations within 150 +- 50 steps: 1.5000 to 2.0000; at 150 " \
        "steps 1.9000"


def test_held_out_split_windows_predict_every_token_once():
    import decentralized_data as bench_data
    import torch

    tokens = torch.arange(23, dtype=torch.uint8)
    windows = bench_data.split_windows(tokens, 5)  # 4 windows of 6 tokens: targets 1..20, each once
    assert windows.shape == (4, 6) and windows.dtype == torch.long
    assert torch.cat([w[1:] for w in windows]).tolist() == list(range(1, 21))

    class Mean(torch.nn.Module):  # "loss": the batch's mean first input token, so chunks must weigh by size
        def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[None, torch.Tensor]:
            return None, x[:, 0].float().mean()

    held = torch.arange(600).reshape(600, 1).repeat(1, 3)
    model = Mean().train()
    assert bench_data.held_out_loss(model, held) == pytest.approx(299.5) and model.training  # chunks 256, 256, 88


def test_balance_paces_fractional_batches_and_scales_the_faster_replicas():
    import decentralized_balance as balance

    assert [balance.count_at(k, 4.0) for k in range(5)] == [4] * 5
    counts = [balance.count_at(k, 9.3) for k in range(10)]
    assert set(counts) == {9, 10} and sum(counts) == 93  # a tenth carried every step: exact over ten steps
    # Replica 0 (2 ranks) is the slowest at 0.14 s: it keeps its batches; 0.10 s and 0.12 s scale by 1.4, 1.167.
    assert balance.rebalance([4, 4, 30, 8], [2, 1, 1], [0.14, 0.10, 0.12]) == [4, 4, 42.0, 9.3]
    run = {"logs": {(0, 0): [[{"t": 0.2 * s, "step": s} for s in range(20)]],
                    (1, 0): [[{"joined": 0}, *[{"t": 0.1 * s, "step": s} for s in range(40)]]]},
           "t0": 0.0, "window": 3.0}
    assert balance.step_seconds(run) == pytest.approx([0.2, 0.1])
    with pytest.raises(ValueError, match="at least 1 sequence"):
        balance.parse_batches("4,0.5")
    with pytest.raises(SystemExit, match="same whole batch, --balance-rounds 0 and --no-pace"):
        bench.check(bench.parse(["--systems", "hsdp,torchft", "--ranks-per-node", "1,1,1", "--batches", "4,4,4"]))


def test_balance_rounds_rescale_the_batches_and_damp_the_second_round():
    import decentralized_balance as balance

    def alone(seconds: list[float]) -> dict:
        logs = {(r, 0): [[{"t": t * k, "step": k} for k in range(40)]] for r, t in enumerate(seconds)}
        return {"logs": logs, "t0": 0.0, "window": 3.0}

    runs, names = iter([alone([0.2, 0.1, 0.1]), alone([0.2, 0.2, 0.15])]), []
    args = bench.parse(["--balance-seconds", "30"])

    def launch(name: str) -> dict:
        names.append((name, args.alone_seconds))
        return next(runs)

    rounds = balance.balance_batches(args, [2, 1, 1], launch)
    assert names == [("balance-0", 30.0), ("balance-1", 30.0)] and args.alone_seconds == 90.0
    # Round 0: replicas 1 and 2 twice as fast, their batches doubled; round 1: replica 2 still 0.2 / 0.15 as fast,
    # half the correction in ratio (sqrt(4 / 3)); replica 0, the slowest, keeps its own throughout.
    assert [r["next"] for r in rounds] == ["4,4,60,16", "4,4,60,18.5"] and args.batches == "4,4,60,18.5"


def test_pacer_grows_an_idle_replicas_batch_and_the_references_take_the_paced_batches():
    import decentralized_balance as balance

    def phases(pacer: balance.Pacer, idle: float, count: int = 4) -> list[float | None]:
        """``count`` phases of 10 steps of 0.1 s (a start at each phase's first step, waiting ``idle`` s there)."""
        out, now = [], 0.0
        for k in range(10 * count + 1):
            started = k % 10 == 0
            now += 0.1 + (idle if started else 0.0)
            out.append(pacer.after_step(now, started, idle if started else 0.001))
        return out

    # 0.259 s waited per 1.25 s phase (0.25 s at the start), less the 2 % deadband: half of that share over the
    # busy share more, once per 4 phases.
    fast, share = balance.Pacer(10.0), 0.259 / 1.25
    changes = [m for m in phases(fast, 0.25) if m is not None]
    assert changes == [pytest.approx(10.0 * (1 + 0.5 * (share - 0.02) / (1 - share)), abs=0.01)]
    assert fast.mean == changes[0] > 11
    slowest = balance.Pacer(10.0)  # the last to arrive waits only for the coordinator's answer: keeps its batch
    assert all(m is None for m in phases(slowest, 0.01)) and slowest.mean == 10.0
    capped = balance.Pacer(10.0)
    assert [m for m in phases(capped, 5.0) if m is not None] == [12.5]  # at most 1.25x per adjustment
    # The references (alone after, plain) run the window's mean batches per rank; args.batches is restored after.
    logs = {(0, 0): [[{**_step(0.1 * s, s), "tokens": 64 * 4} for s in range(10)]],
            (1, 0): [[{**_step(0.1 * s, s), "tokens": 64 * (3 if s < 5 else 4)} for s in range(10)]]}
    run = {"logs": logs, "t0": 0.0, "window": 1.0}
    args = bench.parse(["--ranks-per-node", "1,1", "--batches", "4,3", "--preset", "tiny"])
    with balance.at_paced_batches(args, [1, 1], run) as paced:
        assert paced == [4.0, 3.5] and args.batches == "4,3.5"
    assert args.batches == "4,3"
    args.pace = False
    with balance.at_paced_batches(args, [1, 1], run) as paced:
        assert paced is None and args.batches == "4,3"
    with pytest.raises(SystemExit, match="--no-pace"):
        bench.check(bench.parse(["--systems", "hsdp,torchft", "--ranks-per-node", "1,1,1", "--batches", "4,4,4",
                                 "--balance-rounds", "0"]))
