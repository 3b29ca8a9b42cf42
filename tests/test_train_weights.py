"""``hsdp train``'s heterogeneous keys: ``parallel.batch_weights`` (a list, or "auto" from a calibration at the even
split) cut every global batch with ``hsdp.distributed_sampler`` and train exactly as one process on that global
batch; ``parallel.sharding_degree`` as an int list parses from TOML and the command line and reaches
``hsdp.init_mesh`` as a list. One 2-rank spawn runs both training checks."""

from __future__ import annotations

import io
import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from harness import run_distributed

import hsdp
from hsdp.apps.train import trainer as trainer_module
from hsdp.apps.train.command import layout_problem
from hsdp.apps.train.config import RunConfig
from hsdp.apps.train.config_io import apply_overrides, build_config, resolve_config, to_toml

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

# A tiny run: 4 blocks of 64 (the "tiny" preset) over a character vocabulary, 16-token context, no evaluation; a
# small learning rate: AdamW turns float rounding of a near-zero gradient into up to lr of difference.
BASE = ["model.block_size=16", "data.tokenizer=char", "data.max_bytes=60000", "train.eval_every=0",
        "train.checkpoint_every=0", "train.sample_tokens=0", "train.log_every=100", "optim.warmup_steps=2",
        "train.batch_size=3", "optim.lr=5e-4", "optim.min_lr=5e-5"]
EXPLICIT = [*BASE, "train.steps=4", "train.grad_accum=2", "parallel.sharding_degree=2", "parallel.batch_weights=[1,2]"]
AUTO = [*BASE, "train.steps=6", "parallel.sharding_degree=1", "parallel.batch_weights=auto"]


def _config(out: Path, items: list[str]) -> RunConfig:
    return resolve_config(None, [*items, f"train.out_dir={out}"])


# -- parsing ----------------------------------------------------------------------------------------------
def test_list_keys_parse_from_toml_and_the_command_line_alike() -> None:
    toml = tomllib.loads("[parallel]\nsharding_degree = [2, 1]\nbatch_weights = [1, 2.5]\nnodes = 1\n"
                        "nproc_per_node = 3\n")
    from_file = build_config(toml)
    from_cli = resolve_config(None, ["parallel.sharding_degree=[2,1]", "parallel.batch_weights=[1, 2.5]",
                                     "parallel.nodes=1", "parallel.nproc_per_node=3"])
    assert from_file == from_cli
    assert from_cli.parallel.sharding_degree == (2, 1) and from_cli.parallel.batch_weights == (1.0, 2.5)
    assert build_config(tomllib.loads(to_toml(from_cli))) == from_cli  # the run directory's config.toml
    assert resolve_config(None, ["parallel.batch_weights=auto"]).parallel.batch_weights == "auto"
    assert resolve_config(None, []).parallel.batch_weights == "even"
    assert resolve_config(None, ["parallel.sharding_degree=4"]).parallel.sharding_degree == 4


@pytest.mark.parametrize(("items", "needle"), [
    (["parallel.sharding_degree=[2,\"a\"]"], "parallel.sharding_degree = [2, 'a']: expected an integer or a list of "
                                             "integers such as [4, 2]"),
    (["parallel.sharding_degree=[2.5]"], "expected an integer or a list of integers"),
    (["parallel.sharding_degree=[0,2]"], "give one degree >= 1 per replica in rank order"),
    (["parallel.sharding_degree=[]"], "give one degree >= 1 per replica"),
    (["parallel.batch_weights=[1,true]"], "expected a string or a list of numbers such as [1, 2.5]"),
    (["parallel.batch_weights=[1,0]"], "one finite positive weight per data-parallel rank or per replica"),
    (["parallel.batch_weights=[1,nan]"], "one finite positive weight"),
    (["parallel.batch_weights=fast"], "choose 'even', 'auto' or a list of positive weights"),
    (["parallel.batch_weights=2"], "expected a string or a list of numbers"),
])
def test_bad_list_values_name_the_fix(items: list[str], needle: str) -> None:
    with pytest.raises(ValueError) as e:
        resolve_config(None, items)
    assert needle in str(e.value)


def test_layout_checks_the_degree_sum_and_the_weight_count() -> None:
    def problem(*items: str) -> str | None:
        return layout_problem(resolve_config(None, ["parallel.nodes=2", "parallel.nproc_per_node=2", *items]))

    assert problem("parallel.sharding_degree=[2,1,1]") is None
    assert "covers 3 ranks" in str(problem("parallel.sharding_degree=[2,1]"))
    assert "make the degrees sum to 4" in str(problem("parallel.sharding_degree=[2,1]"))
    assert problem("parallel.sharding_degree=[2,1,1]", "parallel.batch_weights=[2,1,1]") is None  # per replica
    assert problem("parallel.batch_weights=[1,2,3,4]") is None  # per rank
    assert problem("parallel.sharding_degree=2", "parallel.batch_weights=[1,2]") is None  # per replica (R = 2)
    assert "one per data-parallel rank (4) or one per replica (2)" in str(problem("parallel.batch_weights=[1,2,3]"))
    # 8 sequences per micro-batch cannot give rank 0 a share of 1 : 200; 51 per rank can.
    assert "raise train.batch_size to 51 or more" in str(problem("parallel.batch_weights=[1,200]",
                                                                 "train.batch_size=2"))
    assert problem("parallel.batch_weights=[1,200]", "train.batch_size=51") is None


def test_list_degrees_reach_init_mesh_as_a_list_and_replica_weights_spread_over_ranks(
        monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[Any] = []
    monkeypatch.setattr(hsdp, "init_mesh", lambda degree, **kw: seen.append((degree, kw)))
    trainer_module._init_mesh(resolve_config(None, ["parallel.sharding_degree=[2,1]"]))
    trainer_module._init_mesh(resolve_config(None, ["parallel.sharding_degree=0"]))
    assert seen == [([2, 1], {"tensor_parallel_degree": None}), (None, {"tensor_parallel_degree": None})]
    # What the list gives.
    mesh = SimpleNamespace(data_parallel_size=3, replicas=SimpleNamespace(data_parallel_degrees=(2, 1)))
    cfg = resolve_config(None, ["parallel.sharding_degree=[2,1]", "parallel.batch_weights=[3,1]"])
    assert trainer_module.initial_weights(cfg, mesh) == [1.5, 1.5, 1.0]  # per replica, over its ranks
    per_rank = resolve_config(None, ["parallel.sharding_degree=[2,1]", "parallel.batch_weights=[1,2,3]"])
    assert trainer_module.initial_weights(per_rank, mesh) == [1.0, 2.0, 3.0]
    grid = SimpleNamespace(data_parallel_size=4, replicas=SimpleNamespace(data_parallel_degrees=(2, 2)))
    assert trainer_module.initial_weights(resolve_config(None, ["parallel.batch_weights=[1,3]"]), grid) == [
        0.5, 0.5, 1.5, 1.5]
    assert trainer_module.initial_weights(resolve_config(None, ["parallel.batch_weights=auto"]), grid) == [1.0] * 4
    assert apply_overrides({}, ["parallel.batch_weights=[1,2]"]) == {"parallel": {"batch_weights": [1, 2]}}


# -- training: parity with one process on the same global batch --------------------------------------------
def _train(rank: int, world: int, out: str, items: list[str]) -> dict[str, Any]:
    from rich.console import Console

    from hsdp.apps.train.rank_warnings import RankWarnings
    from hsdp.apps.train.trainer import Trainer

    text = io.StringIO()
    with RankWarnings(lambda line: None) as warns:
        trainer = Trainer(_config(Path(out), items), Console(file=text, width=300), warns)
        result = trainer.train()
        summary = trainer.summarize()
        params = hsdp.full_state_dict(trainer.model)
    return {"losses": [r["loss"] for r in result.records], "summary": summary, "params": params,
            "log": text.getvalue(), "batch_size": trainer.train_stream.batch_size}


def _both(rank: int, world: int, base: str) -> dict[str, Any]:
    return {"explicit": _train(rank, world, f"{base}/explicit", EXPLICIT),
            "auto": _train(rank, world, f"{base}/auto", AUTO)}


def _reference(cfg: RunConfig) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One plain process: every step's whole global batch (the sampler's order), AdamW as hsdp train sets it."""
    from hsdp.apps.train.corpus import load_corpus
    from hsdp.apps.train.lm import LANGUAGE_MODELS
    from hsdp.apps.train.optimizer import lr_at, set_lr
    from hsdp.apps.train.weighted_stream import Windows
    from hsdp.models import GPT

    corpus = load_corpus(cfg.data, None)
    shape = LANGUAGE_MODELS["gpt"].shape(cfg.model, corpus.tokenizer.vocab_size)
    torch.manual_seed(cfg.train.seed)
    model = GPT(shape)
    params = list(model.parameters())
    o = cfg.optim
    opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": o.weight_decay},
                             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                            lr=o.lr, betas=(o.beta1, o.beta2))
    windows = Windows(corpus.train, shape.block_size)
    sampler = hsdp.WeightedBatchSampler(len(windows), [cfg.train.batch_size * 2], 0, seed=cfg.train.seed)
    batches, losses = list(sampler), []
    accum = cfg.train.grad_accum
    for step in range(1, cfg.train.steps + 1):
        set_lr(opt, lr_at(step, o, cfg.train.steps))
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for micro in range(accum):
            seqs = torch.stack([windows[i] for i in batches[(step - 1) * accum + micro]]).long()
            loss = model(seqs[:, :-1], seqs[:, 1:])[1]
            (loss / accum).backward()
            total += loss.item() / accum
        torch.nn.utils.clip_grad_norm_(params, o.grad_clip)
        opt.step()
        losses.append(total)
    return losses, model.state_dict()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], Path]:
    base = tmp_path_factory.mktemp("weights")
    return run_distributed(_both, 2, str(base), timeout=240), base


def _assert_same_training(run: dict[str, Any], cfg: RunConfig) -> None:
    losses, params = _reference(cfg)
    assert run["losses"] == pytest.approx(losses, abs=1e-5)
    assert run["params"].keys() == params.keys()
    for name, value in params.items():
        torch.testing.assert_close(run["params"][name], value, atol=1e-5, rtol=0, msg=name)


def test_explicit_weights_train_as_one_process_on_the_global_batch(runs: tuple[list[dict], Path]) -> None:
    results, base = runs
    assert [r["explicit"]["batch_size"] for r in results] == [2, 4]  # 6 sequences split 1 : 2
    _assert_same_training(results[0]["explicit"], _config(base / "explicit", EXPLICIT))
    batch = json.loads((base / "explicit" / "summary.json").read_text())["batch_weights"]
    assert batch == {"mode": "list", "weights": [1.0, 2.0], "batch_sizes": [2, 4], "global_batch": 6,
                     "calibration": None}


def test_auto_weights_are_measured_logged_and_train_the_same(runs: tuple[list[dict], Path]) -> None:
    results, base = runs
    batch = results[0]["auto"]["summary"]["batch_weights"]
    calibration = batch["calibration"]
    assert batch["mode"] == "auto" and calibration["after_step"] == 4 and len(calibration["busy_s_per_rank"]) == 2
    assert all(math.isfinite(t) and t > 0 for t in calibration["busy_s_per_rank"])
    weights = batch["weights"]
    assert weights == calibration["weights"] and min(weights) == 1.0
    assert all(math.isfinite(w) and w >= 1.0 for w in weights) and sum(batch["batch_sizes"]) == 6
    assert [r["auto"]["batch_size"] for r in results] == batch["batch_sizes"]
    assert f"step 4: batch weights {weights}" in results[0]["auto"]["log"]
    saved = json.loads((base / "auto" / "summary.json").read_text())["batch_weights"]
    assert saved == batch
    _assert_same_training(results[0]["auto"], _config(base / "auto", AUTO))  # weights change speed, not training
