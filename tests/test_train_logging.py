"""``hsdp train``'s Weights & Biases logging (``log.wandb``): the records rank 0 writes to ``metrics.jsonl``
reach an offline W&B run (read back with wandb's own reader), and a missing wandb is refused before any rank
starts. In-process, on synthetic records: no training run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hsdp.apps.train.command import main
from hsdp.apps.train.config_io import resolve_config
from hsdp.apps.train.metrics import FIELDS, MetricsWriter, read_metrics
from hsdp.apps.train.wandb_sink import ID_NAME, _run_id, record_sinks


def _offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """wandb offline, silent, and writing nothing outside ``tmp_path``; the W&B directory."""
    wandb_dir = tmp_path / "wandb_dir"
    wandb_dir.mkdir()
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(wandb_dir))
    monkeypatch.setenv("WANDB_SILENT", "true")
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / name.lower()))
    return wandb_dir


def _records(steps: int) -> list[dict]:
    """Per-step records as the trainer writes them: every field, eval_loss only on the last step."""
    out = []
    for step in range(1, steps + 1):
        record = {name: float(step) * (i + 1) for i, name in enumerate(FIELDS)}
        record.update(step=step, loss=5.0 - step / 2, eval_loss=4.5 if step == steps else None)
        out.append(record)
    return out


def _inspect(wandb_dir: Path) -> list[dict]:
    """The records of the one offline run under ``wandb_dir``, as wandb's own reader prints them."""
    (run,) = (wandb_dir / "wandb").glob("offline-run-*")
    proc = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(run)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]


def test_wandb_logs_the_metrics_records_and_the_config_offline(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wandb_dir = _offline(monkeypatch, tmp_path)
    run_dir = tmp_path / "my-run"
    run_dir.mkdir()
    cfg = resolve_config(None, [f"train.out_dir={run_dir}", "log.wandb=true", "log.wandb_mode=offline",
                                "log.wandb_project=hsdp-test", "train.steps=3"])
    with MetricsWriter(str(run_dir), None, sinks=record_sinks(cfg, str(run_dir))) as writer:
        for record in _records(3):
            writer.write(record)
    logged = _inspect(wandb_dir)
    (run,) = [r["run"] for r in logged if r["type"] == "run"]
    assert (run["display_name"], run["project"]) == ("my-run", "hsdp-test")  # named after the run directory
    assert run["run_id"] == (run_dir / ID_NAME).read_text().strip()
    config = run["config"]["update"]
    assert config["train"]["steps"] == 3 and config["log"]["wandb_mode"] == "offline"
    history = [r["history"] for r in logged if r["type"] == "history"]
    assert [h["step"]["num"] for h in history] == [1, 2, 3]
    for h, record in zip(history, read_metrics(str(run_dir)), strict=True):  # the same values as metrics.jsonl
        expected = {f"train/{k}": v for k, v in record.items() if k != "step" and v is not None}
        assert {k: v for k, v in h["item"].items() if k.startswith("train/")} == expected
    assert "train/eval_loss" in history[-1]["item"] and "train/eval_loss" not in history[0]["item"]


def test_a_resumed_run_continues_the_same_wandb_run(tmp_path: Path) -> None:
    first = _run_id(str(tmp_path), resume=False)
    assert _run_id(str(tmp_path), resume=True) == first  # --resume: the saved id
    assert _run_id(str(tmp_path), resume=False) != first  # a fresh run in a cleared directory: a new one


def test_log_config_is_checked() -> None:
    with pytest.raises(ValueError, match=r"log\.wandb_mode = 'cloud': choose one of \['online', 'offline'\]"):
        resolve_config(None, ["log.wandb_mode=cloud"])
    assert resolve_config(None, []).log.wandb is False  # off unless asked for


def test_wandb_enabled_but_missing_is_refused_before_spawning(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    def spawn(*args: object) -> int:
        raise AssertionError("ranks were started")

    monkeypatch.setattr("hsdp.tools.launch.launch_local", spawn)
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed: find_spec answers None
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    out = tmp_path / "run"
    assert main(["log.wandb=true", f"train.out_dir={out}"]) == 2
    err = capsys.readouterr().err
    assert "hsdp train: error: log.wandb = true needs the wandb package: pip install 'hsdp[wandb]'" in err, err
    assert not out.exists()
    # Under torchrun every rank stops the same way before the process group; rank 0 alone says why.
    monkeypatch.setenv("WORLD_SIZE", "2")
    for rank, says in (("1", False), ("0", True)):
        monkeypatch.setenv("RANK", rank)
        assert main(["log.wandb=true", f"train.out_dir={out}"]) == 2
        assert ("pip install 'hsdp[wandb]'" in capsys.readouterr().err) is says
