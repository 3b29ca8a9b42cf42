"""``hsdp train model.kind=hf model.path=DIR``: any local Hugging Face causal-LM folder, its tokenizer, its
weights or its own initialisation, exported back to a folder ``from_pretrained`` loads.

The folders are made here: a tiny ``LlamaConfig`` (hidden 32, 2 layers) and a BPE tokenizer trained with the
``tokenizers`` library on a few KB of text, saved as a ``PreTrainedTokenizerFast``; nothing is downloaded.
One 4-rank spawn (2 x 2) runs the job on a parquet source from the folder's weights (tied embedding), builds
the random-init folder's model the way the job does, and loads the weights folder's model the same way; the
checks against one plain process run in the test process. The validation errors (before any rank starts) and
the corpus readers with the folder's tokenizer run in this process.
"""

from __future__ import annotations

import io
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="the hf extra (pip install 'hsdp[hf]'); `make test` installs it")
pytest.importorskip("pyarrow", reason="the data extra (pip install 'hsdp[data]'); `make test` installs it")

import pyarrow as pa
import pyarrow.parquet as pq
from harness import run_distributed

from hsdp.apps.train.command import main
from hsdp.apps.train.config import DataConfig
from hsdp.apps.train.corpus import load_corpus, read_corpus_bytes
from hsdp.apps.train.hf_folder import load_tokenizer
from hsdp.apps.train.metrics import read_metrics
from hsdp.data.text import TokenStream

VOCAB, CONTEXT, BATCH, STEPS = 128, 16, 2, 6
WORLD, EVAL_FRACTION = 4, 0.2
TEXT_FILE = Path(os.__file__).with_name("textwrap.py")  # a few KB of real text on every machine


def _paragraphs() -> list[str]:
    text = TEXT_FILE.read_text(encoding="utf-8")[:24_000]
    return [p for p in text.split("\n\n") if p.strip()]


def _save_tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(_paragraphs(), trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<unk>", "</s>"]))
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>").save_pretrained(folder)


def _llama_config(tie: bool, vocab: int = VOCAB, ffn: int = 64) -> object:
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=ffn,
                       vocab_size=vocab, max_position_embeddings=64, tie_word_embeddings=tie, bos_token_id=0,
                       eos_token_id=1)


def _make_folders(root: Path) -> dict[str, str]:
    """``weights``: a tied Llama with weights; ``random``: an untied Llama's config only; both with the
    tokenizer; ``parquet``: the paragraphs as a parquet file."""
    from transformers import LlamaForCausalLM

    weights, random = root / "weights", root / "random"
    for folder in (weights, random):
        folder.mkdir()
        _save_tokenizer(folder)
    torch.manual_seed(0)
    LlamaForCausalLM(_llama_config(tie=True)).save_pretrained(weights)
    _llama_config(tie=False).save_pretrained(random)
    parquet = root / "data.parquet"
    pq.write_table(pa.table({"text": _paragraphs(), "n": list(range(len(_paragraphs())))}), parquet)
    return {"weights": str(weights), "random": str(random), "parquet": str(parquet), "root": str(root)}


def _job_overrides(paths: dict[str, str], out: str) -> list[str]:
    return ["model.kind=hf", f"model.path={paths['weights']}", f"data.source={paths['parquet']}",
            f"model.block_size={CONTEXT}", f"train.batch_size={BATCH}", f"train.steps={STEPS}", "train.eval_every=3",
            f"train.checkpoint_every={STEPS}", "train.log_every=1", "train.sample_tokens=8", "optim.warmup_steps=1",
            "optim.lr=1e-2", f"data.eval_fraction={EVAL_FRACTION}", "parallel.sharding_degree=2",
            f"train.out_dir={out}"]


def _initial_state(rank: int, folder: str) -> dict | None:
    """The folder's model built, wrapped and initialised as the job does (seed 0), gathered on rank 0."""
    import hsdp
    from hsdp.apps.train import resolve_config
    from hsdp.apps.train.lm import LANGUAGE_MODELS

    cfg = resolve_config(None, ["model.kind=hf", f"model.path={folder}", f"model.block_size={CONTEXT}"])
    lm = LANGUAGE_MODELS["hf"]
    shape = lm.shape(cfg.model, lm.tokenizer(cfg.model).vocab_size)
    torch.manual_seed(0)
    model = hsdp.ShardedModel(lm.build(shape), mesh=hsdp.init_mesh(2))
    lm.initialize(model, shape)
    model.check_replicas()
    full = hsdp.full_state_dict(model)
    return {k: v.clone() for k, v in full.items()} if rank == 0 else None


def _worker(rank: int, world: int, paths: dict[str, str]) -> dict:
    from rich.console import Console

    from hsdp.apps.train import resolve_config, run_job

    text = io.StringIO()
    cfg = resolve_config(None, _job_overrides(paths, os.path.join(paths["root"], "run")))
    summary = run_job(cfg, Console(file=text, width=200, force_terminal=False)).summary
    # The folder without weights, as a job too: two steps from the model's own initialisation.
    fresh = resolve_config(None, [*_job_overrides(paths, os.path.join(paths["root"], "fresh")), "train.steps=2",
                                  f"model.path={paths['random']}", "train.sample_tokens=0", "train.eval_every=0",
                                  "train.checkpoint_every=0"])
    return {"summary": summary, "console": text.getvalue(), "random": _initial_state(rank, paths["random"]),
            "loaded": _initial_state(rank, paths["weights"]), "fresh": run_job(fresh, Console(quiet=True)).summary}


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], dict[str, str]]:
    paths = _make_folders(tmp_path_factory.mktemp("hf_folder"))
    return run_distributed(_worker, WORLD, paths, timeout=280), paths


def _reference_first_loss(paths: dict[str, str]) -> float:
    """Step 1's loss in one plain process: the folder's model on the four readers' first batches."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(paths["weights"])
    corpus = load_corpus(DataConfig(source=paths["parquet"], eval_fraction=EVAL_FRACTION),
                         load_tokenizer(paths["weights"]))
    losses = []
    with torch.no_grad():
        for r in range(WORLD):
            x, y = TokenStream(corpus.train, CONTEXT, BATCH, seed=0, rank=r, world_size=WORLD).batch(0)
            logits = model(input_ids=x).logits
            losses.append(torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1)).item())
    return sum(losses) / WORLD


def test_hf_folder_trains_from_its_weights_on_2x2(trained: tuple[list[dict], dict[str, str]]) -> None:
    results, paths = trained
    run = Path(paths["root"]) / "run"
    summary = results[0]["summary"]
    assert summary["mesh"] == {"replicas": 2, "shards": 2, "world": 4}
    assert summary["model"]["kind"] == "hf" and summary["model"]["path"] == paths["weights"]
    records = read_metrics(str(run))
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert records[0]["loss"] == pytest.approx(_reference_first_loss(paths), abs=1e-5)  # the folder's weights
    assert records[-1]["loss"] < records[0]["loss"] - 0.3  # and it learns
    assert records[2]["eval_loss"] is not None and records[0]["tokens"] == BATCH * CONTEXT * WORLD
    console = results[0]["console"]
    assert "LlamaForCausalLM" in console and "context 16" in console
    assert "tokens (the model folder's tokenizer, vocabulary 128)" in console
    assert f"step {STEPS}" in console and (run / "sample.txt").read_text()
    from hsdp.apps.train.report import write_report

    assert all(Path(p).stat().st_size > 10_000 for p in write_report(str(run)))


def test_export_writes_a_folder_from_pretrained_loads(trained: tuple[list[dict], dict[str, str]],
                                                      tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hsdp.apps.cli import main as cli_main
    from hsdp.checkpoint.export import read_weights

    _, paths = trained
    run, out = Path(paths["root"]) / "run", tmp_path / "exported"
    assert cli_main(["export", str(run), "--to", "hf", str(out)]) == 0
    assert "1 weight shard(s), config.json, index, 3 file(s) of the model folder" in capsys.readouterr().out
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert "lm_head.weight" not in index["weight_map"] and "model.embed_tokens.weight" in index["weight_map"]
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert config["tie_word_embeddings"] is True and config["dtype"] == "float32"
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= set(os.listdir(out))
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight  # tied once, re-tied on load
    ckpt = read_weights(str(run)).tensors
    state = loaded.state_dict()
    assert set(state) == set(ckpt) and all(torch.equal(state[k], ckpt[k]) for k in ckpt)
    original = AutoModelForCausalLM.from_pretrained(paths["weights"]).state_dict()
    assert max((state[k] - original[k]).abs().max().item() for k in state) > 1e-3  # trained, not the input
    sample = "def wrap(text, width=70):"
    assert AutoTokenizer.from_pretrained(out)(sample)["input_ids"] == \
        AutoTokenizer.from_pretrained(paths["weights"])(sample)["input_ids"]
    (tmp_path / "stale").mkdir()
    (tmp_path / "stale" / "model.safetensors").write_bytes(b"")
    assert cli_main(["export", str(run), "--to", "hf", str(tmp_path / "stale")]) == 2  # it would shadow the export


def test_random_init_from_config_vs_weights_from_the_folder(trained: tuple[list[dict], dict[str, str]]) -> None:
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    results, paths = trained
    loaded, random = results[0]["loaded"], results[0]["random"]
    stored = load_file(os.path.join(paths["weights"], "model.safetensors"))
    assert set(loaded) == set(stored) | {"lm_head.weight"}
    assert all(torch.equal(loaded[k], stored[k]) for k in stored)  # the folder's weights, bitwise
    assert torch.equal(loaded["lm_head.weight"], stored["model.embed_tokens.weight"])  # tied
    # No weights: the model's own initialiser (_init_weights), module by module with seed 0, as on one process.
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(paths["random"]))
    torch.manual_seed(0)
    for module in ref.modules():
        if next(module.parameters(recurse=False), None) is not None:
            ref._init_weights(module)
    expected = ref.state_dict()
    assert set(random) == set(expected) and all(torch.equal(random[k], expected[k]) for k in expected)
    q = random["model.layers.0.self_attn.q_proj.weight"]
    assert 0.015 < q.std().item() < 0.025  # initializer_range 0.02, not torch's Linear init (~0.1 here)
    assert torch.equal(random["model.norm.weight"], torch.ones(32))
    assert not torch.equal(random["model.embed_tokens.weight"], random["lm_head.weight"])  # untied config
    # hsdp train on that folder starts there: near-uniform predictions (std 0.02), loss about ln(vocabulary).
    fresh = results[0]["fresh"]
    assert fresh["model"]["path"] == paths["random"] and fresh["steps"]["last"] == 2
    assert fresh["loss_first"] == pytest.approx(math.log(VOCAB), abs=0.05)


# ---------------------------------------------------------------------------------------------------------
# Before any rank starts: one line, exit status 2, nothing spawned.
# ---------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    from transformers import ViTConfig

    root = tmp_path_factory.mktemp("hf_bad")
    paths = {"good": root / "good", "empty": root / "empty", "no_tokenizer": root / "no_tokenizer",
             "vit": root / "vit", "small_vocab": root / "small_vocab", "bin_only": root / "bin_only",
             "misfit": root / "misfit"}
    for p in paths.values():
        p.mkdir()
    for name in ("good", "vit", "small_vocab", "bin_only", "misfit"):
        _save_tokenizer(paths[name])
    from transformers import LlamaForCausalLM

    LlamaForCausalLM(_llama_config(tie=False)).save_pretrained(paths["misfit"])  # then a config of another shape
    _llama_config(tie=False, ffn=48).save_pretrained(paths["misfit"])
    _llama_config(tie=False).save_pretrained(paths["good"])
    _llama_config(tie=False).save_pretrained(paths["no_tokenizer"])
    _llama_config(tie=False).save_pretrained(paths["bin_only"])
    (paths["bin_only"] / "pytorch_model.bin").write_bytes(b"not read")
    _llama_config(tie=False, vocab=64).save_pretrained(paths["small_vocab"])
    ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64).save_pretrained(
        paths["vit"])
    (root / "text.txt").write_text("hello\n")
    (root / "records.parquet").write_bytes(b"")
    return {k: str(v) for k, v in paths.items()} | {"root": str(root)}


def _no_spawn(monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    started: list[tuple] = []
    monkeypatch.setattr("hsdp.tools.launch.launch_local", lambda *args: started.append(args) or 0)
    return started


def test_bad_model_folders_and_data_are_refused_before_any_rank_starts(
        folders: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture) -> None:
    started = _no_spawn(monkeypatch)
    text = os.path.join(folders["root"], "text.txt")
    hf = ["model.kind=hf", f"data.source={text}"]
    cases = {
        "missing folder": ([*hf, "model.path=/nonexistent/model"], "is not a folder"),
        "no config.json": ([*hf, f"model.path={folders['empty']}"], "holds no config.json: save the model's config"),
        "no tokenizer": ([*hf, f"model.path={folders['no_tokenizer']}"], "holds no tokenizer"),
        "not a causal LM": ([*hf, f"model.path={folders['vit']}"], "model type 'vit' (ViTConfig) is not a causal"),
        "vocabulary": ([*hf, f"model.path={folders['small_vocab']}"], "set vocab_size to at least 128"),
        "bin weights": ([*hf, f"model.path={folders['bin_only']}"], "holds pytorch_model.bin but no model.safetensors"),
        "weights misfit": ([*hf, f"model.path={folders['misfit']}"],
                           "its weights do not fit its config.json (shape mismatches (6): model.layers.0.mlp"),
        "context": ([*hf, f"model.path={folders['good']}", "model.block_size=65"], "set at most 64"),
        "no path": (hf, "model.path = '': model.kind = 'hf' trains a local Hugging Face model folder"),
        "byte tokens": ([*hf, f"model.path={folders['good']}", "data.tokenizer=byte"], "set data.tokenizer = 'auto'"),
        "path without hf": ([f"model.path={folders['good']}"], "is read only with model.kind = 'hf'"),
        "tensor parallel": ([*hf, f"model.path={folders['good']}", "parallel.tensor_parallel=2"],
                            "no tensor-parallel plan"),
        "missing data": (["--data", "/nonexistent"], "data.source = '/nonexistent' does not exist"),
        "missing data, hf": ([f"model.path={folders['good']}", "model.kind=hf", "data.source=/nonexistent"],
                             "does not exist"),
        "empty folder": ([f"data.source={folders['empty']}"], "holds no file ending in"),
        "bad parquet": ([f"data.source={os.path.join(folders['root'], 'records.parquet')}"],
                        "is not a readable parquet file"),
        "jsonl field": ([f"data.source={_jsonl(tmp_path)}"], "has no field 'text': set data.text_field"),
    }
    for name, (args, needle) in cases.items():
        out = tmp_path / name.replace(" ", "_").replace(",", "")
        assert main([*args, f"train.out_dir={out}"]) == 2, name
        err = capsys.readouterr().err
        assert err.startswith("hsdp train: error: ") and needle in err, (name, err)
        assert len(err.strip().splitlines()) == 1 and not out.exists(), (name, err)
    assert not started
    # A good folder passes the same checks and reaches the launcher.
    assert main([*hf, f"model.path={folders['good']}", f"train.out_dir={tmp_path / 'good'}"]) == 0
    assert len(started) == 1
    # Under torchrun each rank checks its inputs itself, before it joins the process group.
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setattr("hsdp.apps.train.command.run_rank", lambda *a: pytest.fail("the rank started"))
    assert main(["--data", "/nonexistent", f"train.out_dir={tmp_path / 'ranked'}"]) == 2
    assert "does not exist" in capsys.readouterr().err and not (tmp_path / "ranked").exists()


def _jsonl(tmp_path: Path) -> Path:
    path = tmp_path / "records.jsonl"
    path.write_text(json.dumps({"body": "no text field"}) + "\n")
    return path


def test_missing_data_source_exits_before_spawning(tmp_path: Path) -> None:
    # The real command: one line, exit status 2, no rank (a rank would print torchrun's tracebacks).
    proc = subprocess.run([sys.executable, "-m", "hsdp", "train", "--data", "/nonexistent"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip() == ("hsdp train: error: data.source = '/nonexistent' does not exist: name a text "
                                   "file or folder, a .jsonl or .parquet file, a datasets directory, or 'stdlib'")
    assert "Traceback" not in proc.stdout + proc.stderr and not (tmp_path / "runs").exists()


# ---------------------------------------------------------------------------------------------------------
# The folder's tokenizer on every kind of source (one process).
# ---------------------------------------------------------------------------------------------------------
def test_every_source_is_tokenized_document_by_document(folders: dict[str, str], tmp_path: Path) -> None:
    import datasets

    tokenizer = load_tokenizer(folders["good"])
    docs = ["first record é", "second\n\nrecord", "third"]
    expected = [i for d in docs for i in [*tokenizer.encode(d), tokenizer.eos_id]]
    (tmp_path / "folder").mkdir()
    for i, d in enumerate(docs):
        (tmp_path / "folder" / f"{i}.txt").write_text(d)
    (tmp_path / "records.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    (tmp_path / "parquet").mkdir()
    pq.write_table(pa.table({"text": docs[:2]}), tmp_path / "parquet" / "a.parquet")
    pq.write_table(pa.table({"text": docs[2:]}), tmp_path / "parquet" / "b.parquet")
    datasets.Dataset.from_dict({"text": docs}).save_to_disk(str(tmp_path / "ds"))
    for source in ("folder", "records.jsonl", "parquet", "parquet/a.parquet", "ds"):
        corpus = load_corpus(DataConfig(source=str(tmp_path / source), eval_fraction=0.2), tokenizer)
        ids = torch.cat([corpus.train, corpus.held_out]).tolist()
        want = expected if source != "parquet/a.parquet" else expected[: -len(tokenizer.encode(docs[2])) - 1]
        assert ids == want, source
        assert corpus.tokenizer is tokenizer and "tokens (the model folder's tokenizer" in corpus.description
    assert tokenizer.decode(tokenizer.encode(docs[1])) == docs[1]  # (é is outside this vocabulary: <unk>)
    # Byte tokens of parquet records: joined by a blank line, as for .jsonl; max_bytes cuts the last one.
    assert read_corpus_bytes(DataConfig(source=str(tmp_path / "parquet"))) == "".join(
        d + "\n\n" for d in docs).encode()
    cut = DataConfig(source=str(tmp_path / "parquet"), max_bytes=20)
    assert read_corpus_bytes(cut) == "".join(d + "\n\n" for d in docs).encode()[:20]
