"""``hsdp train parallel.replica_sync=diloco``: DiLoCo in the training app, on 2 x 2 gloo ranks.

One 4-rank spawn runs the tiny GPT's in-process jobs:
- H = 3, fp32 wire, 7 steps, checkpoints every 2: the records say ``synced`` on steps 3 and 6 and on the last,
  7, which ends training with ``sync_replicas`` (``synced_all``); a step that did not sync sends nothing across
  nodes (``replicate_bytes`` 0) and a sync step sends one all-reduce of the rank's flat shards (2(R-1)/R x its
  parameter bytes); after each step the replicas' weights are compared (``check_replicas``): the same after a sync
  step, different after the others (each replica trained on its own batches); the loss falls;
  ``summary.json`` holds the synced steps, the amortized floor and the nodes' mean bytes per step;
- the same run stopped after step 5 and resumed from its step-4 checkpoint (mid-phase): bitwise the straight run;
- H = 2, bf16 wire, two micro-batches per step: the sync sends half the fp32 bytes, the first step nothing (the
  last step synced already: the end of training adds no collective);
- streaming, H = 4, two fragments, delay 1, 6 steps: fragment 0 starts its all-reduce after steps 2 and 6, fragment
  1 after step 4, each lands a step later (``sync_started`` / ``sync_landed``, ``synced`` on steps 3 and 5), and
  the last step, 6, then lands fragment 0 and syncs both (the end of training); the bytes cross on the start
  steps only, the two fragments together the whole model; stopped after step 5 and resumed from step 4 (fragment
  1 in flight, kept by the checkpoint): bitwise the straight run.

Without processes: the configuration's refusals (each naming the field and the fix), before any rank starts.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from harness import run_distributed

from hsdp.apps.train.command import main
from hsdp.apps.train.config_io import resolve_config
from hsdp.apps.train.metrics import read_metrics
from hsdp.apps.train.replica_sync import policy

# sharding_degree 2: R = 2 replicas of the 4 ranks (the harness's ranks all look like one node's).
QUIET = ["parallel.sharding_degree=2", "train.eval_every=0", "train.sample_tokens=0", "train.log_every=1",
         "data.max_bytes=200000", "optim.warmup_steps=1", "optim.lr=3e-3"]
DILOCO = ["parallel.replica_sync=diloco", "train.checkpoint_every=0"]
STREAM = ["train.steps=6", "parallel.diloco_every=4", "parallel.diloco_fragments=2", "parallel.diloco_delay=1",
          "train.checkpoint_every=4"]


def _job(out: Path, *extra: str) -> tuple[dict, list[bool]]:
    """Run one job; ``(its summary, whether the replicas held the same weights after each step)``."""
    from rich.console import Console

    from hsdp.apps.train import run_job
    from hsdp.apps.train.trainer import Trainer
    from hsdp.engine.replicas import ReplicaDivergence, check_replica_shards

    same: list[bool] = []
    original = Trainer.after_step

    def after_step(self: Trainer, record: dict) -> None:
        original(self, record)
        try:  # a collective in the replicate group, after the step's record: its bytes are not counted
            # The weights themselves (model.check_replicas compares DiLoCo's global copy, equal at every step).
            check_replica_shards(self.model.sharded_params(), self.model.comm)
            same.append(True)
        except ReplicaDivergence:
            same.append(False)

    Trainer.after_step = after_step  # type: ignore[method-assign]
    try:
        outcome = run_job(resolve_config(None, [*QUIET, f"train.out_dir={out}", *DILOCO, *extra]),
                          Console(quiet=True))
    finally:
        Trainer.after_step = original  # type: ignore[method-assign]
    return outcome.summary, same


def _worker(rank: int, world: int, tmp: str) -> dict:
    base = Path(tmp)
    fp32 = _job(base / "fp32", "train.steps=7", "parallel.diloco_every=3", "train.checkpoint_every=2")
    # The same run stopped after step 5 (newest checkpoint: step 4, mid-phase), then resumed to step 7.
    _job(base / "resumed", "train.steps=7", "parallel.diloco_every=3", "train.checkpoint_every=2",
         "train.stop_after=5")
    resumed = _job(base / "resumed", "train.steps=7", "parallel.diloco_every=3", "train.checkpoint_every=2",
                   "train.resume=true")
    bf16 = _job(base / "bf16", "train.steps=2", "train.grad_accum=2", "parallel.diloco_every=2",
                "parallel.diloco_wire_dtype=bf16")
    int8 = _job(base / "int8", "train.steps=2", "parallel.diloco_every=2", "parallel.diloco_wire_dtype=int8")
    stream = _job(base / "stream", *STREAM)
    # Stopped after step 5: the newest checkpoint (step 4) holds fragment 1's all-reduce in flight.
    _job(base / "stream_resumed", *STREAM, "train.stop_after=5")
    _job(base / "stream_resumed", *STREAM, "train.resume=true")
    return {"fp32": fp32, "resumed": resumed, "bf16": bf16, "int8": int8, "stream": stream}


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], Path]:
    base = tmp_path_factory.mktemp("diloco")
    return run_distributed(_worker, 4, str(base), timeout=280), base


def test_replicas_sync_every_h_steps_and_only_then_cross_nodes(jobs: tuple[list[dict], Path]) -> None:
    results, base = jobs
    records = read_metrics(str(base / "fp32"))
    summary = results[0]["fp32"][0]
    assert summary["mesh"] == {"replicas": 2, "shards": 2, "world": 4}
    assert [r["step"] for r in records] == list(range(1, 8))
    synced = [s % 3 == 0 or s == 7 for s in range(1, 8)]  # the last step ends training with a sync
    assert [r["synced"] for r in records] == synced
    assert [r.get("synced_all", False) for r in records] == [s == 7 for s in range(1, 8)]
    # R = 2: a sync all-reduces this rank's flat shards (its parameter bytes), 2(R-1)/R = 1 of them on the wire.
    params = summary["ranks"][0]["params"]
    assert [r["replicate_bytes"] for r in records] == [params if s else 0 for s in synced]
    assert all(r["shard_bytes"] > 0 for r in records)  # inside a replica every step is ordinary HSDP
    for r in results:  # every rank of both replicas saw the same: synced weights after steps 3, 6 and 7 only
        assert r["fp32"][1] == synced
    assert records[-1]["loss"] < records[0]["loss"] - 0.3
    assert "synced" in (base / "fp32" / "metrics.csv").read_text().splitlines()[0]


def test_a_resumed_run_continues_mid_phase_bitwise(jobs: tuple[list[dict], Path]) -> None:
    # Saved after step 4 (one step into the second phase: the replicas' weights differ), loaded by every replica
    # from its own keys; steps 5-7 (a sync at 6) equal the straight run's, bit for bit (CPU fp32).
    results, base = jobs
    straight, resumed = read_metrics(str(base / "fp32")), read_metrics(str(base / "resumed"))
    assert results[0]["resumed"][0]["steps"] == {"first": 5, "last": 7, "planned": 7}
    assert sorted(p.name for p in (base / "fp32" / "checkpoints").iterdir()) == \
        ["latest", "step_000004", "step_000006", "step_000007"]
    assert [r["step"] for r in resumed] == list(range(1, 8))
    for a, b in zip(straight, resumed, strict=True):
        for key in ("loss", "grad_norm", "synced", "replicate_bytes"):
            assert a[key] == b[key], (a["step"], key, a[key], b[key])
    for r in results:  # the resumed session's replicas: apart after 5, the same after the syncs at 6 and 7
        assert r["resumed"][1] == [False, True, True]


def test_summary_holds_the_syncs_and_the_amortized_floor(jobs: tuple[list[dict], Path]) -> None:
    _, base = jobs
    summary = json.loads((base / "fp32" / "summary.json").read_text())
    sync = summary["replica_sync"]
    assert (sync["mode"], sync["every"], sync["wire_dtype"], sync["synced_steps"]) == ("diloco", 3, "fp32", [3, 6, 7])
    per_sync = 2 * 1 / 2 * summary["model"]["params"] * 4
    assert sync["inter_node_floor_bytes_per_sync"] == pytest.approx(per_sync)
    assert summary["inter_node_floor_bytes_per_step"] == pytest.approx(per_sync / 3)
    for node in summary["nodes"]:  # the mean of 7 steps, 3 of them syncs (padding rides along)
        assert per_sync * 3 / 7 <= node["replicate_bytes_per_step"] < 1.01 * per_sync * 3 / 7


def test_a_bf16_wire_halves_the_sync(jobs: tuple[list[dict], Path]) -> None:
    results, base = jobs
    records = read_metrics(str(base / "bf16"))
    summary, same = results[0]["bf16"]
    params = summary["ranks"][0]["params"]
    assert [(r["synced"], r["replicate_bytes"]) for r in records] == [(False, 0), (True, params / 2)]
    assert same == [False, True]


def test_an_int8_wire_sends_about_a_quarter_of_fp32(jobs: tuple[list[dict], Path]) -> None:
    results, base = jobs
    records = read_metrics(str(base / "int8"))
    summary, same = results[0]["int8"]
    params = summary["ranks"][0]["params"]  # fp32 bytes: what an fp32 sync sends at R = 2
    assert [r["synced"] for r in records] == [False, True] and records[0]["replicate_bytes"] == 0
    # One byte per element, an fp32 scale per 256 and the last block's padding (measured in tests/test_diloco_int8.py).
    assert params / 4 < records[1]["replicate_bytes"] < 0.27 * params
    assert same == [False, True]
    floor = json.loads((base / "int8" / "summary.json").read_text())["replica_sync"]["inter_node_floor_bytes_per_sync"]
    assert floor == pytest.approx(summary["model"]["params"] * (1 + 4 / 256))  # x P x (1 + 4/256)


@pytest.mark.parametrize(("overrides", "message"), [
    (["parallel.replica_hop=bf16", *DILOCO], "parallel.replica_hop = 'bf16': does not combine with "
                                             "parallel.replica_sync = 'diloco'"),
    (["parallel.replica_hop=int8", *DILOCO], "set parallel.replica_hop = 'fp32'"),
    (["parallel.shard_optimizer_across_replicas=true", *DILOCO], "set parallel.shard_optimizer_across_replicas = "
                                                                 "false"),
    (["parallel.elastic=true", "parallel.diloco_every=4", "parallel.diloco_fragments=2", "parallel.diloco_delay=3",
      *DILOCO], "parallel.diloco_delay = 3: Streaming DiLoCo with parallel.elastic = true keeps one fragment's sync "
                "in flight at a time"),
    (["parallel.diloco_every=0", *DILOCO], "parallel.diloco_every = 0: the inner steps between syncs"),
    (["parallel.diloco_outer_lr=0", *DILOCO], "parallel.diloco_outer_lr = 0.0: must be positive"),
    (["parallel.diloco_outer_momentum=1", *DILOCO], "parallel.diloco_outer_momentum = 1.0: must lie in [0, 1)"),
    (["parallel.diloco_wire_dtype=fp16", *DILOCO], "choose one of ['fp32', 'bf16', 'int8']"),
    (["parallel.diloco_every=4", "parallel.diloco_fragments=5", *DILOCO], "parallel.diloco_fragments = 5: each "
                                                                          "fragment syncs at its own step"),
    (["parallel.diloco_every=4", "parallel.diloco_delay=4", *DILOCO], "parallel.diloco_delay = 4: a fragment's "
                                                                      "update must land before its next sync"),
    (["parallel.diloco_mix=1", *DILOCO], "parallel.diloco_mix = 1.0: must lie in [0, 1)"),
    (["parallel.diloco_fragments=2"], "parallel.diloco_fragments = 2: is read only with"),
    (["parallel.replica_sync=every_h"], "parallel.replica_sync = 'every_h': choose one of"),
    (["parallel.diloco_every=10"], "parallel.diloco_every = 10: is read only with parallel.replica_sync = 'diloco'"),
])
def test_what_diloco_does_not_combine_with_is_refused(overrides: list[str], message: str) -> None:
    with pytest.raises(ValueError) as e:
        resolve_config(None, overrides)
    assert message in str(e.value)


def test_the_defaults_and_the_options_are_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture) -> None:
    assert resolve_config(None, []).parallel.replica_sync == "every_step"
    assert resolve_config(None, ["parallel.replica_sync=diloco", "train.resume=true"]).train.checkpoint_every == 100
    par = resolve_config(None, [*DILOCO, "parallel.diloco_every=5", "parallel.diloco_outer_lr=0.5",
                                "parallel.diloco_outer_momentum=0", "parallel.diloco_wire_dtype=bf16"]).parallel
    assert (par.replica_sync, par.diloco_every, par.diloco_outer_lr, par.diloco_outer_momentum,
            par.diloco_wire_dtype) == ("diloco", 5, 0.5, 0.0, "bf16")
    int8 = resolve_config(None, [*DILOCO, "parallel.diloco_wire_dtype=int8"]).parallel
    assert policy(int8).wire_dtype == torch.int8  # DiLoCo(wire_dtype=torch.int8): tests/test_diloco_int8.py
    par = resolve_config(None, ["parallel.elastic=true", "parallel.replica_sync=diloco", "parallel.diloco_every=4"]
                         ).parallel  # an elastic DiLoCo job (tests/test_elastic_diloco.py)
    assert (par.elastic, par.replica_sync, par.diloco_every) == (True, "diloco", 4)
    hetero = resolve_config(None, ["parallel.elastic=true", "parallel.sharding_degree=[2,1]", *DILOCO,
                                   "parallel.diloco_wire_dtype=int8"]).parallel
    assert hetero.degree_list == (2, 1)  # and of replicas of different degrees (tests/test_elastic_diloco.py)
    par = resolve_config(None, ["parallel.elastic=true", "parallel.replica_sync=diloco", "parallel.diloco_every=4",
                                "parallel.diloco_fragments=2", "parallel.diloco_delay=2"]).parallel  # Streaming
    assert (par.elastic, par.diloco_fragments, par.diloco_delay) == (True, 2, 2)
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)

    def spawn(*args: object) -> int:
        raise AssertionError("ranks were started")

    monkeypatch.setattr("hsdp.tools.launch.launch_local", spawn)
    assert main([*DILOCO, "parallel.replica_hop=bf16", f"train.out_dir={tmp_path / 'run'}"]) == 2
    assert "parallel.diloco_wire_dtype = 'bf16' halves" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_streaming_fragments_start_staggered_and_land_after_the_delay(jobs: tuple[list[dict], Path]) -> None:
    results, base = jobs
    records = read_metrics(str(base / "stream"))
    summary = results[0]["stream"][0]
    # Step 6 starts fragment 0's sync, then ends training: lands it, syncs both fragments at once.
    assert [r["sync_started"] for r in records] == [[], [0], [], [1], [], [0, 0, 1]]
    assert [r["sync_landed"] for r in records] == [[], [], [0], [], [1], [0, 0, 1]]
    assert [r["synced"] for r in records] == [False, False, True, False, True, True]
    sent = [r["replicate_bytes"] for r in records]
    assert [s > 0 for s in sent] == [False, True, False, True, False, True]
    params = summary["ranks"][0]["params"]
    assert sent[1] + sent[3] == params and sent[5] == sent[1] + params  # R = 2, fp32
    assert summary["replica_sync"]["synced_steps"] == [3, 5, 6]
    assert (summary["replica_sync"]["fragments"], summary["replica_sync"]["delay"]) == (2, 1)
    # Resumed from step 4 with fragment 1 in flight: it lands after step 5 as in the straight run, bit for bit.
    resumed = read_metrics(str(base / "stream_resumed"))
    assert [r["step"] for r in resumed] == list(range(1, 7))
    for a, b in zip(records, resumed, strict=True):
        for key in ("loss", "grad_norm", "synced", "sync_started", "sync_landed", "replicate_bytes"):
            assert a[key] == b[key], (a["step"], key, a[key], b[key])
