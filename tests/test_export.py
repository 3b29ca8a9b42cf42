"""``hsdp export`` on an ``hsdp train`` run of ``model.kind = "hf-gpt2"``, through the real command line.

One spawn saves a tiny run (its ``config.toml`` and ``checkpoints/step_000001`` of a GPT2LMHeadModel sharded
1x2); every test reads that run. The run directory resolves to its checkpoints like ``--resume`` does; the
``.safetensors`` file loads with a strict, plain ``load_state_dict(load_file(...))`` (tied ``lm_head.weight``
included); ``--to hf DIR`` writes a sharded folder that ``from_pretrained`` loads; mistakes end in one line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="the hf extra (pip install 'hsdp[hf]'); `make test` installs it")

from harness import run_distributed

from hsdp.apps.cli import main as cli_main
from hsdp.apps.train.config_io import CONFIG_NAME, resolve_config, to_toml
from hsdp.checkpoint.resolve import candidates

VOCAB = 64
OVERRIDES = ["model.kind=hf-gpt2", "model.preset=tiny"]


def _save_run(rank: int, world: int, run: str) -> dict:
    import hsdp
    from hsdp.apps.train.lm import LANGUAGE_MODELS

    cfg = resolve_config(None, [*OVERRIDES, f"train.out_dir={run}"])
    if rank == 0:
        os.makedirs(run, exist_ok=True)
        Path(run, CONFIG_NAME).write_text(to_toml(cfg))
    torch.manual_seed(0)
    model = hsdp.ShardedModel(LANGUAGE_MODELS["hf-gpt2"].build(cfg.model.shape(VOCAB)), mesh=hsdp.init_mesh(world))
    hsdp.save_checkpoint(os.path.join(run, "checkpoints"), model, step=1)
    return {"state": hsdp.full_state_dict(model), "config": model.config.to_dict() if rank == 0 else None}


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    path = str(tmp_path_factory.mktemp("export") / "train")
    result = run_distributed(_save_run, 2, path)[0]
    return {"path": path, "ref": result["state"], "config": result["config"]}


def _export(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hsdp", "export", *args], capture_output=True, text=True,
                          timeout=120)


def _gpt2(config: dict) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config.from_dict(config))


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_run_directory_resolves_like_its_checkpoints_directory(run: dict) -> None:
    step = os.path.join(run["path"], "checkpoints", "step_000001")
    assert [c.path for c in candidates(run["path"])] == [step]  # what --resume and hsdp report take
    assert [c.path for c in candidates(os.path.join(run["path"], "checkpoints"))] == [step]


def test_safetensors_from_the_run_directory_loads_with_plain_load_state_dict(run: dict, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    out = tmp_path / "not" / "yet" / "model.safetensors"  # missing parents: created, as save_pretrained does
    done = _export(run["path"], "--to", str(out))
    assert done.returncode == 0, done.stderr
    assert "lm_head.weight = transformer.wte.weight" in done.stdout
    stored = load_file(out)
    assert _same(stored, run["ref"])  # every name, the tied lm_head.weight included
    model = _gpt2(run["config"])
    model.load_state_dict(stored)  # strict, plain: the issue's one-liner
    assert model.lm_head.weight is model.transformer.wte.weight  # the tie survives the load
    assert _same({k: v.detach() for k, v in model.state_dict().items()}, run["ref"])


def test_hf_folder_loads_with_from_pretrained(run: dict, tmp_path: Path) -> None:
    from transformers import GPT2LMHeadModel

    out = tmp_path / "hf" / "tiny-gpt2"
    stale = out / "model-00009-of-00009.safetensors"  # a previous export's shard: replaced, not left behind
    out.mkdir(parents=True)
    stale.write_bytes(b"old")
    done = _export(os.path.join(run["path"], "checkpoints"), "--to", "hf", str(out), "--max-shard-size", "100kB")
    assert done.returncode == 0, done.stderr
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and shards == sorted(p.name for p in out.glob("model-*.safetensors"))
    assert "lm_head.weight" not in index["weight_map"]  # Hugging Face's convention: tied weights once
    assert set(index["weight_map"]) == set(run["ref"]) - {"lm_head.weight"}
    assert not stale.exists()
    loaded = GPT2LMHeadModel.from_pretrained(out)
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    assert _same({k: v.detach() for k, v in loaded.state_dict().items()}, run["ref"])
    assert json.loads((out / "config.json").read_text())["architectures"] == ["GPT2LMHeadModel"]


def test_export_mistakes_end_in_one_line(run: dict, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    done = _export(run["path"], "--to", str(blocker / "sub" / "m.safetensors"))  # the real command: no traceback
    assert done.returncode == 2 and "cannot create output directory" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    gpt_run = tmp_path / "gpt-run"
    gpt_run.mkdir()
    (gpt_run / CONFIG_NAME).write_text(to_toml(resolve_config(None, [f"train.out_dir={gpt_run}"])))
    hf_dir = str(tmp_path / "h")
    cases = {  # the same front end in this process (each command start costs seconds)
        "no suffix": ([run["path"], "--to", str(tmp_path / "m.bin")], "ending in .safetensors"),
        "hf without DIR": ([run["path"], "--to", "hf"], "--to hf DIR"),
        "two files": ([run["path"], "--to", "a.safetensors", "b.safetensors"], "hf DIR"),
        "bad shard size": ([run["path"], "--to", "hf", hf_dir, "--max-shard-size", "5"], "has no unit"),
        "another kind": ([str(gpt_run), "--to", "hf", hf_dir], "model.kind = 'gpt'"),
        "not a run": ([str(tmp_path), "--to", "hf", hf_dir], "not inside an hsdp train run"),
    }
    for name, (args, needle) in cases.items():
        assert cli_main(["export", *args]) == 2, name
        err = capsys.readouterr().err
        assert needle in err and len(err.strip().splitlines()) == 1, (name, err)
