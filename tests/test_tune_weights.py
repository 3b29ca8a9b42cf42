"""``hsdp tune``'s batch weights: per-rank times at the same batch give weights ``slowest / t_r`` that equalize the
step (the math on synthetic timings), the metrics file records each rank's wall and busy seconds and peak memory
(one 2-rank spawn, rank 1 made slow), and ``hsdp tune --from-metrics`` prints and saves the proposal."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest
import torch
from harness import run_distributed

import hsdp
from hsdp.apps.cli import main
from hsdp.data.weighted_sampler import split_sizes
from hsdp.models import GPT, GPTConfig
from hsdp.tools.planner.balance import balanced_weights, expected_speedup, propose_weights

SLEEP_S = 0.3  # rank 1's extra seconds per step in the spawn: far above a tiny model's step


def test_weights_are_inverse_times_with_the_slowest_at_one() -> None:
    assert balanced_weights([0.1, 0.2, 0.4]) == [4.0, 2.0, 1.0]
    assert balanced_weights([0.3, 0.3]) == [1.0, 1.0]
    assert balanced_weights([1.0, 3.0]) == [3.0, 1.0] and balanced_weights([3.0, 7.0]) == [2.33, 1.0]
    # A uniform machine: noise of a few percent gives weights of about 1.
    uniform = balanced_weights([1.00, 1.02, 0.99, 1.01])
    assert all(1.0 <= w <= 1.04 for w in uniform) and min(uniform) == 1.0
    for bad in ([], [0.1, 0.0], [0.1, -1.0], [0.1, math.nan], [0.1, math.inf]):
        with pytest.raises(ValueError, match="per-rank"):
            balanced_weights(bad)


@pytest.mark.parametrize("seconds", [[0.1, 0.2, 0.4, 0.4], [1.0, 1.5], [0.05, 0.05, 0.2], [1.0, 1.0, 1.0]])
def test_weighted_split_equalizes_times_that_scale_with_the_batch(seconds: list[float]) -> None:
    per_sample = seconds  # each rank's seconds per sequence: its step at the even batch of 1
    batch = 1200 * len(seconds)
    sizes = split_sizes(balanced_weights(seconds), batch)
    times = [t * b for t, b in zip(per_sample, sizes)]
    assert max(times) / min(times) < 1.01  # every rank now takes the same time
    even = max(t * batch / len(seconds) for t in per_sample)
    assert even / max(times) == pytest.approx(expected_speedup(seconds), rel=0.01)
    assert expected_speedup(seconds) >= 1.0


def test_proposal_prefers_busy_then_compute_then_wall_seconds() -> None:
    run = {"busy_s_per_rank": [0.1, 0.2], "compute_s_per_rank": [0.4, 0.4], "step_s_per_rank": [0.5, 0.5],
           "peak_memory_bytes_per_rank": [10.0, 20.0]}
    other = {**run, "busy_s_per_rank": [0.3, 0.2], "peak_memory_bytes_per_rank": [30.0, 5.0]}
    p = propose_weights([run, other, {"error": "exit 1"}])
    assert p is not None and p.source == "busy_s_per_rank" and p.runs == 2
    assert p.seconds == (0.2, 0.2) and p.weights == (1.0, 1.0) and p.peak_memory_bytes == (30.0, 20.0)
    gpu = propose_weights([{**run, "busy_s_per_rank": None}])  # GPUs: a wait does not block the host
    assert gpu is not None and gpu.source == "compute_s_per_rank" and gpu.weights == (1.0, 1.0)
    assert propose_weights([{"step_s": [0.1]}]) is None  # a metrics file from before per-rank times


def _tiny() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32))


def _recorded_runs(rank: int, world: int, out: str) -> dict:
    from hsdp.tools.planner.metrics import StepRecorder, profile_ranks

    x = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(rank))
    probe = _tiny()
    _, rank_compute = profile_ranks(hsdp.init_mesh(1), lambda: probe(x[:, :-1], x[:, 1:])[1],
                                    list(probe.parameters()), iters=1)
    results = {}
    for degree in (1, 2):
        model = hsdp.ShardedModel(_tiny(), mesh=hsdp.init_mesh(degree))
        opt = hsdp.ShardedOptimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
        recorder = StepRecorder(model, opt, warmup=1, seq_len=16, micro_batch=2)
        for _ in range(3):
            with recorder.step():
                if rank == 1:
                    time.sleep(SLEEP_S)  # a slower rank: the other waits for it in the first all-gather
                opt.zero_grad(set_to_none=True)
                model(x[:, :-1], x[:, 1:])[1].backward()
                opt.step()
        results[degree] = recorder.write(f"{out}/s{degree}.json", extra={"compute_s_per_rank": rank_compute})
    return results


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("tune_runs")
    return run_distributed(_recorded_runs, 2, str(out), timeout=180)[0], out


def test_metrics_record_each_ranks_busy_and_wall_seconds_and_peak_memory(recorded: tuple[dict, Path]) -> None:
    for r in recorded[0].values():
        wall, busy = r["step_s_per_rank"], r["busy_s_per_rank"]
        assert len(wall) == len(busy) == len(r["peak_memory_bytes_per_rank"]) == len(r["compute_s_per_rank"]) == 2
        assert all(0 < b <= w for b, w in zip(busy, wall)) and min(r["peak_memory_bytes_per_rank"]) > 0
        assert busy[1] >= SLEEP_S > busy[0]  # rank 0's sleep-long wait for rank 1 is not busy time
        assert abs(wall[0] - wall[1]) < SLEEP_S  # both wall clocks are paced by rank 1
        assert balanced_weights(busy)[0] > balanced_weights(busy)[1] == 1.0


def test_tune_from_metrics_prints_and_saves_the_weights(recorded: tuple[dict, Path], tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    report = tmp_path / "tune.json"
    assert main(["tune", "--from-metrics", str(recorded[1]), "--json", str(report)]) == 0
    out = capsys.readouterr().out
    assert "batch weights per rank, 1 / busy seconds" in out and "parallel.batch_weights = [" in out
    proposal = json.loads(report.read_text())["batch_weights"]
    assert proposal["source"] == "busy_s_per_rank" and proposal["runs"] == 1
    assert proposal["weights"][1] == 1.0 < proposal["weights"][0] and proposal["expected_speedup"] > 1
    assert len(proposal["peak_memory_bytes_per_rank"]) == 2
