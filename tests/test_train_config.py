"""``hsdp train``'s single-process pieces: typed config and overrides, corpus sources and tokenizers, the
LR schedule, metric files, the run-directory guard and progress helpers (``hsdp report``'s plots are in
test_report_plots.py)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

from hsdp.apps.train.command import layout_problem, main, overrides_from, split_items
from hsdp.apps.train.config import DataConfig, OptimConfig, RunConfig
from hsdp.apps.train.config_io import apply_overrides, build_config, read_toml, resolve_config, to_toml
from hsdp.apps.train.corpus import char_tokens, detect_format, load_corpus, read_corpus_bytes
from hsdp.apps.train.lm import LANGUAGE_MODELS, describe, pad_sequence_to, sample
from hsdp.apps.train.metrics import CSV_NAME, MetricsWriter, comm_totals, read_metrics
from hsdp.apps.train.optimizer import lr_at
from hsdp.apps.train.progress import format_eta
from hsdp.apps.train.rank_warnings import rank_ranges
from hsdp.apps.train.rundir import start_problem
from hsdp.engine.collectives import profiler_region
from hsdp.models import GPTConfig

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib


# ---------------------------------------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------------------------------------
def test_defaults_round_trip_through_toml() -> None:
    cfg = resolve_config(None, [])
    assert cfg == RunConfig()
    assert (cfg.model.preset, cfg.parallel.nodes, cfg.parallel.nproc_per_node) == ("tiny", 2, 2)
    assert build_config(tomllib.loads(to_toml(cfg))) == cfg


def test_example_config_lists_every_field_with_its_default() -> None:
    example = Path(__file__).resolve().parents[1] / "examples" / "hsdp_train.toml"
    table = read_toml(example)
    assert {k: set(v) for k, v in table.items()} == {k: set(v) for k, v in tomllib.loads(to_toml(RunConfig())).items()}
    assert resolve_config(str(example), []) == RunConfig()


def test_overrides_are_typed_and_applied_in_order() -> None:
    cfg = resolve_config(None, ["train.steps=50", "model.preset=small", 'data.extensions=[".txt"]',
                                "optim.lr=1e-3", "optim.min_lr=0", "train.resume=true", "train.steps=60",
                                "train.sample_prompt=import os"])
    assert cfg.train.steps == 60 and cfg.model.preset == "small" and cfg.data.extensions == (".txt",)
    assert cfg.optim.lr == 1e-3 and cfg.optim.min_lr == 0.0 and isinstance(cfg.optim.min_lr, float)
    assert cfg.train.resume is True and cfg.train.sample_prompt == "import os"


@pytest.mark.parametrize(("overrides", "message"), [
    (["train.steps=0"], r"train\.steps = 0: must be at least 1"),
    (["train.steps=abc"], r"train\.steps = 'abc': expected an integer"),
    (["train.resume=yes"], r"train\.resume = 'yes': expected true or false"),
    (["train.nope=1"], r"unknown field train\.nope"),
    (["foo.x=1"], r"unknown section 'foo'"),
    (["steps=3"], r"write section\.field=value"),
    (["model.preset=huge"], r"model\.preset = 'huge': choose one of .*'tiny'"),
    (["data.tokenizer=bpe"], r"data\.tokenizer = 'bpe': choose one of \['auto', 'byte', 'char'\]"),
    (["optim.min_lr=1.0"], r"optim\.min_lr = 1\.0: must not exceed optim\.lr"),
    (["train.stop_after=500"], r"train\.stop_after = 500: exceeds train\.steps"),
    (["parallel.replica_hop=fp8"], r"parallel\.replica_hop = 'fp8'"),
    (["parallel.shard_optimizer_across_replicas=true", "parallel.replica_sync=diloco"],
     r"parallel\.shard_optimizer_across_replicas = True: does not combine with parallel\.replica_sync = 'diloco': "
     r"DiLoCo's inner optimizer state is per replica.*parallel\.replica_sync = 'every_step'"),
    (["parallel.tensor_parallel=0"], r"parallel\.tensor_parallel = 0: must be at least 1"),
    (["parallel.tensor_parallel=2", "model.kind=hf-gpt2"],
     r"parallel\.tensor_parallel = 2: Hugging Face GPT-2 has no tensor-parallel plan.*set model\.kind = 'gpt'"),
    (["parallel.tensor_parallel=3"], r"parallel\.tensor_parallel = 3: .*must divide n_head=4.*model\.preset = 'tiny'"),
    (["parallel.tensor_parallel=2", "model.block_size=63"],
     r"parallel\.tensor_parallel = 2: sequence parallel .* context is 63 tokens.*multiple of 2"),
])
def test_bad_values_name_the_field(overrides: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        resolve_config(None, overrides)


def test_shard_optimizer_across_replicas_is_read_and_refused_with_diloco_before_spawning(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    cfg = resolve_config(None, ["parallel.shard_optimizer_across_replicas=true", "parallel.replica_hop=int8"])
    assert cfg.parallel.shard_optimizer_across_replicas is True and cfg.parallel.replica_hop == "int8"
    assert RunConfig().parallel.shard_optimizer_across_replicas is False
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)

    def spawn(*args: object) -> int:
        raise AssertionError("ranks were started")

    monkeypatch.setattr("hsdp.tools.launch.launch_local", spawn)
    bad = ["parallel.shard_optimizer_across_replicas=true", "parallel.replica_sync=diloco"]
    assert main([*bad, f"train.out_dir={tmp_path / 'run'}"]) == 2
    assert "parallel.replica_sync = 'every_step'" in capsys.readouterr().err and not (tmp_path / "run").exists()


def test_toml_file_then_overrides_and_file_errors(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text('[train]\nsteps = 40\nbatch_size = 4\n[model]\npreset = "small"\n')
    cfg = resolve_config(str(path), ["train.steps=41"])
    assert (cfg.train.steps, cfg.train.batch_size, cfg.model.preset) == (41, 4, "small")
    path.write_text("[train]\nsteps = 1\nbogus = 2\n")
    with pytest.raises(ValueError, match=r"unknown field train\.bogus in .*run\.toml"):
        resolve_config(str(path), [])
    path.write_text("[train\n")
    with pytest.raises(ValueError, match="is not valid TOML"):
        read_toml(path)
    with pytest.raises(ValueError, match="does not exist"):
        read_toml(tmp_path / "missing.toml")
    with pytest.raises(ValueError, match=r"train in .* must be a table"):
        build_config({"train": 3})


def test_resume_reads_the_saved_config_but_not_its_stop(tmp_path: Path) -> None:
    out = tmp_path / "run"
    out.mkdir()
    saved = resolve_config(None, [f"train.out_dir={out}", "model.preset=small", "train.stop_after=5"])
    (out / "config.toml").write_text(to_toml(saved))
    cfg = resolve_config(None, [f"train.out_dir={out}", "train.resume=true", "train.steps=400"])
    assert cfg.model.preset == "small" and cfg.train.steps == 400 and cfg.train.stop_after == 0


def test_command_line_items_and_flags() -> None:
    assert split_items(["run.toml", "train.steps=3"]) == ("run.toml", ["train.steps=3"])
    assert split_items(["train.steps=3"]) == (None, ["train.steps=3"])
    with pytest.raises(ValueError, match="not an override"):
        split_items(["run.toml", "other.toml"])

    class Args:
        resume, profile, out, steps, preset, data, nodes, nproc_per_node = True, False, "r", 5, None, None, 1, None

    assert overrides_from(Args()) == ["train.resume=true", "train.out_dir=r", "train.steps=5", "parallel.nodes=1"]
    assert apply_overrides({}, ["data.source=a=b"]) == {"data": {"source": "a=b"}}


def test_flags_and_overrides_mix_in_any_order() -> None:
    from hsdp.apps.cli import build_parser

    argv = ["train", "run.toml", "--resume", "train.steps=9", "--out", "x", "data.max_bytes=5"]
    args = build_parser().parse_args(argv)
    assert args.items == ["run.toml", "train.steps=9", "data.max_bytes=5"] and args.resume and args.out == "x"
    args = build_parser().parse_args(["train"])
    assert args.items == [] and not args.resume and args.steps is None


def test_fresh_run_refuses_a_directory_holding_a_run(tmp_path: Path) -> None:
    cfg = resolve_config(None, [f"train.out_dir={tmp_path}"])
    assert start_problem(cfg) is None
    (tmp_path / "metrics.jsonl").write_text("")
    assert "pass --resume" in start_problem(cfg)
    assert start_problem(resolve_config(None, [f"train.out_dir={tmp_path}", "train.resume=true"])) is None


# ---------------------------------------------------------------------------------------------------------
# Corpus and models
# ---------------------------------------------------------------------------------------------------------
def test_text_folder_jsonl_and_char_tokenizer(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "b.txt").write_text("world ")
    (tmp_path / "docs" / "a.txt").write_text("hello ")
    (tmp_path / "docs" / "skip.bin").write_bytes(b"\x00\x01")
    assert read_corpus_bytes(DataConfig(source=str(tmp_path / "docs"))) == b"hello world "
    lines = [json.dumps({"text": f"record {i} é"}) for i in range(50)]
    (tmp_path / "data.jsonl").write_text("\n".join(lines))
    cfg = DataConfig(source=str(tmp_path / "data.jsonl"), tokenizer="char")
    assert detect_format(cfg) == "jsonl"
    corpus = load_corpus(cfg)
    assert corpus.tokenizer.decode(corpus.train[:10]) == "record 0 é"
    assert corpus.tokenizer.vocab_size == len(set("".join(json.loads(x)["text"] for x in lines) + "\n"))
    with pytest.raises(ValueError, match=r"no field 'body': set data\.text_field"):
        read_corpus_bytes(DataConfig(source=str(tmp_path / "data.jsonl"), text_field="body"))
    with pytest.raises(ValueError, match=r"data\.source = .* does not exist"):
        load_corpus(DataConfig(source=str(tmp_path / "missing")))
    with pytest.raises(ValueError, match=r"set data\.extensions"):
        load_corpus(DataConfig(source=str(tmp_path / "docs"), extensions=(".md",)))


def test_without_datasets_the_error_names_the_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "datasets", None)  # what an environment without the package sees
    (tmp_path / "state.json").write_text("{}")
    assert detect_format(DataConfig(source=str(tmp_path))) == "dataset"
    with pytest.raises(ValueError, match="pip install datasets"):
        read_corpus_bytes(DataConfig(source=str(tmp_path)))


def test_datasets_directory_is_read(tmp_path: Path) -> None:
    import datasets  # in the test extra: `make test` installs it

    splits = {"train": datasets.Dataset.from_dict({"text": [f"doc {i}" for i in range(3)], "n": [1, 2, 3]}),
              "test": datasets.Dataset.from_dict({"text": ["held"], "n": [0]})}
    datasets.DatasetDict(splits).save_to_disk(str(tmp_path / "dd"))
    assert read_corpus_bytes(DataConfig(source=str(tmp_path / "dd"))) == b"doc 0\n\ndoc 1\n\ndoc 2\n\n"
    splits["train"].save_to_disk(str(tmp_path / "one"))
    cfg = DataConfig(source=str(tmp_path / "one"), text_field="body")
    assert detect_format(cfg) == "dataset"
    with pytest.raises(ValueError, match=r"columns \['text', 'n'\], not 'body': set data\.text_field"):
        read_corpus_bytes(cfg)


def test_char_tokens_and_stdlib_default() -> None:
    tok, ids = char_tokens("abca€")
    assert tok.chars == "abc€" and ids.tolist() == [0, 1, 2, 0, 3] and tok.encode("zab") == [0, 1]
    corpus = load_corpus(DataConfig(max_bytes=50_000))
    assert corpus.tokenizer.vocab_size == 256 and len(corpus.train) + len(corpus.held_out) == 50_000
    assert "standard library" in corpus.description


def test_gpt_builds_with_the_tokenizer_vocabulary_and_samples() -> None:
    torch.manual_seed(0)
    cfg = resolve_config(None, ["model.block_size=16"]).model
    shape, lm = cfg.shape(vocab_size=40), LANGUAGE_MODELS[cfg.kind]
    module = lm.build(shape)
    assert shape.block_size == 16 and describe(module, shape.block_size).startswith("GPT, ")
    x, y = torch.randint(0, 40, (2, 16)), torch.randint(0, 40, (2, 16))
    assert abs(lm.loss(module, x, y).item() - math.log(40)) < 0.5  # small init: near uniform
    ids = sample(lambda idx: module(idx)[0], [1, 2], 5, shape.block_size)
    assert len(ids) == 7 and ids[:2] == [1, 2] and all(0 <= i < 40 for i in ids)


def test_lr_schedule_warms_up_then_decays_to_min() -> None:
    cfg = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=10)
    assert lr_at(1, cfg, 100) == pytest.approx(0.1) and lr_at(10, cfg, 100) == pytest.approx(1.0)
    assert lr_at(100, cfg, 100) == pytest.approx(0.1) and lr_at(55, cfg, 100) == pytest.approx(0.55)
    assert lr_at(3, cfg, 3) == pytest.approx(1.0)  # a warm-up longer than the run is cut to the run


# ---------------------------------------------------------------------------------------------------------
# Metrics, progress, report
# ---------------------------------------------------------------------------------------------------------
def _records(steps: int) -> list[dict]:
    return [{"step": s, "loss": 5.0 / s ** 0.3, "eval_loss": 5.2 / s ** 0.3 if s % 10 == 0 else None,
             "lr": 1e-3, "grad_norm": 1.0, "tokens": 2048 * s, "step_s": 0.1, "tokens_per_s": 20_000 + 50 * (s % 7),
             "shard_bytes": 1.2e6, "replicate_bytes": 4.4e5, "shard_s": 0.05, "replicate_s": 0.02 + 0.001 * (s % 5),
             "mem_bytes": 3e8} for s in range(1, steps + 1)]


def test_metrics_writer_keeps_records_up_to_the_resumed_step(tmp_path: Path) -> None:
    with MetricsWriter(str(tmp_path)) as w:
        for r in _records(6):
            w.write(r)
    with MetricsWriter(str(tmp_path), resume_step=3) as w:
        w.write({**_records(4)[-1], "loss": 9.0})
    records = read_metrics(str(tmp_path))
    assert [r["step"] for r in records] == [1, 2, 3, 4] and records[-1]["loss"] == 9.0
    rows = (tmp_path / CSV_NAME).read_text().splitlines()
    assert rows[0].startswith("step,loss,eval_loss") and len(rows) == 5
    # TensorBoard (in the test extra) drops the steps after the resumed one too, as the files do.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    loss = events.Scalars("train/loss")
    assert [e.step for e in loss] == [1, 2, 3, 4] and loss[-1].value == 9.0


def test_metrics_without_tensorboard(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with MetricsWriter(str(tmp_path)) as w:
        for r in _records(2):
            w.write(r)
    assert [r["step"] for r in read_metrics(str(tmp_path))] == [1, 2] and not (tmp_path / "tb").exists()


def test_comm_totals_rank_ranges_eta_and_region_names() -> None:
    stats = {"shard": {"all_gather": {"calls": 2, "bytes": 10, "wire_bytes": 5, "seconds": 0.5, "waited": 0.125},
                       "reduce_scatter": {"calls": 1, "bytes": 10, "wire_bytes": 5, "seconds": 0.25, "waited": 0.0}},
             "world": {"broadcast": {"calls": 1, "bytes": 10, "wire_bytes": 10, "seconds": 1.0, "waited": 0.5}}}
    # Exposed: every wait the host blocked in (the world broadcast too); not measured where waits do not block.
    assert comm_totals(stats) == {"shard_bytes": 10.0, "shard_s": 0.75, "replicate_bytes": 0.0, "replicate_s": 0.0,
                                  "exposed_comm_s": 0.625}
    assert comm_totals(stats, waits_block=False)["exposed_comm_s"] is None
    assert rank_ranges([3, 0, 1, 2, 5]) == "0-3,5" and rank_ranges([4]) == "4"
    assert format_eta(7.4) == "0:07" and format_eta(3723) == "1:02:03" and format_eta(float("nan")) == "?"
    assert profiler_region("all_gather", "shard", "Block(blocks.0)") == "hsdp::all_gather[shard] Block(blocks.0)"
    assert profiler_region("all_reduce", "world") == "hsdp::all_reduce[world]"


def test_a_mesh_the_started_ranks_cannot_form_is_one_error_before_spawning(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    assert layout_problem(resolve_config(None, [])) is None  # 0: the ranks per node
    assert layout_problem(resolve_config(None, ["parallel.sharding_degree=4"])) is None
    problem = layout_problem(resolve_config(None, ["parallel.sharding_degree=4", "parallel.nodes=3"]))
    assert "not divisible" in problem and "3 x 2" in problem, problem

    def spawn(*args: object) -> int:
        raise AssertionError("ranks were started")

    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)  # hsdp train starts the ranks itself
    monkeypatch.setattr("hsdp.tools.launch.launch_local", spawn)
    assert main(["parallel.sharding_degree=3", f"train.out_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "hsdp train: error: world size 4 is not divisible by sharding_degree=3" in err
    assert not (tmp_path / "run").exists()


def test_tensor_parallel_is_read_and_its_layout_checked_before_spawning() -> None:
    cfg = resolve_config(None, ["parallel.tensor_parallel=2", "parallel.nproc_per_node=4"])
    assert cfg.parallel.tensor_parallel == 2 and RunConfig().parallel.tensor_parallel == 1
    assert layout_problem(cfg) is None  # sharding_degree 0: 4 / 2 = 2 shards of 2 TP ranks per node
    for degree in (1, 2):
        assert layout_problem(resolve_config(None, ["parallel.tensor_parallel=2", "parallel.nproc_per_node=4",
                                                    f"parallel.sharding_degree={degree}"])) is None
    problems = {
        ("parallel.tensor_parallel=4",): "parallel.tensor_parallel = 4 does not divide parallel.nproc_per_node = 2",
        ("parallel.tensor_parallel=2", "parallel.sharding_degree=2"):
            "parallel.sharding_degree = 2 x parallel.tensor_parallel = 2 is more than the 2 ranks per node",
        ("parallel.tensor_parallel=2", "parallel.nproc_per_node=6", "parallel.sharding_degree=2"):
            "does not divide the 3 tensor-parallel groups of a node",
    }
    for overrides, message in problems.items():
        problem = layout_problem(resolve_config(None, list(overrides)))
        assert problem is not None and message in problem, problem
    # Replicas of different shard degrees with tensor parallelism: the degrees count tp groups (6 ranks, T = 2).
    hetero = ["parallel.nodes=1", "parallel.tensor_parallel=2", "parallel.nproc_per_node=6"]
    assert layout_problem(resolve_config(None, [*hetero, "parallel.sharding_degree=[2,1]"])) is None
    problem = layout_problem(resolve_config(None, [*hetero, "parallel.sharding_degree=[2,2]"]))
    assert problem is not None and "[2, 2] covers 8 ranks" in problem and "sum to 3" in problem, problem
    # The replica-sharded optimizer combines with tensor parallelism (tests/test_tensor_parallel.py).
    assert resolve_config(None, ["parallel.tensor_parallel=2", "parallel.shard_optimizer_across_replicas=true"])


def test_padded_sequences_give_the_unpadded_logits() -> None:
    # Sequence parallel needs lengths divisible by T; the end-of-run sample pads them (causal: exact).
    torch.manual_seed(0)
    lm = LANGUAGE_MODELS["gpt"]
    model = lm.build(GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=8))
    lengths: list[int] = []

    def logits(idx: torch.Tensor) -> torch.Tensor:
        lengths.append(idx.size(1))
        return lm.logits(model, idx)

    padded = pad_sequence_to(logits, 4)
    assert pad_sequence_to(logits, 1) is logits
    for t in (1, 3, 4, 5):
        idx = torch.randint(0, 32, (2, t))
        assert torch.allclose(padded(idx), lm.logits(model, idx), atol=1e-6)
    assert lengths == [4, 4, 4, 8]


def test_the_int8_hop_has_an_inter_node_floor_only_when_it_reduce_scatters() -> None:
    from hsdp.apps.train.summary import inter_node_floor

    def floor(*overrides: str) -> float | None:
        return inter_node_floor(resolve_config(None, list(overrides)), 1000, 2)

    assert floor("parallel.replica_hop=int8") is None  # an all-gather: its bytes grow with R
    # (R-1)/R x P x (int8 blocks with a scale per 256, then the fp32 all-gather of the stepped slices).
    assert floor("parallel.replica_hop=int8", "parallel.shard_optimizer_across_replicas=true") == \
        pytest.approx(1 / 2 * 1000 * (1 + 4 / 256 + 4))
