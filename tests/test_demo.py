"""The demo's pieces: the GPT model, the byte corpus, the local multi-node launcher and ``hsdp demo``."""

from __future__ import annotations

import dataclasses
import math
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from hsdp.apps.demo import unsharded_state_bytes
from hsdp.data.text import ByteTokenizer, TokenStream, default_corpus_bytes, split_tokens
from hsdp.engine.wrap import select_unit_modules
from hsdp.models import GPT, PRESETS, GPTConfig, preset
from hsdp.tools.launch.local import launch_local, threads_per_rank, torchrun_command

REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------------------
# GPT
# ---------------------------------------------------------------------------------------------------------
def test_tied_embedding_is_one_parameter() -> None:
    model = GPT(preset("tiny"))
    assert model.lm_head.weight is model.tok_emb.weight
    ids = [id(p) for p in model.parameters()]
    assert len(ids) == len(set(ids))
    assert sum(p is model.tok_emb.weight for p in model.parameters()) == 1


def test_untied_embedding_has_its_own_head() -> None:
    cfg = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=8, tie_embeddings=False)
    model = GPT(cfg)
    assert model.lm_head.weight is not model.tok_emb.weight
    tied = GPT(dataclasses.replace(cfg, tie_embeddings=True))
    assert model.num_params() == tied.num_params() + 32 * 8


@pytest.mark.parametrize(("name", "low", "high"), [
    ("tiny", 0.15e6, 0.3e6), ("small", 2e6, 5e6), ("bench", 25e6, 30e6), ("gpt2-124m", 118e6, 130e6),
    ("gpt2-350m", 330e6, 370e6), ("gpt2-774m", 740e6, 800e6), ("gpt-1b", 0.95e9, 1.1e9),
])
def test_preset_sizes_match_their_names(name: str, low: float, high: float) -> None:
    with torch.device("meta"):  # shapes only: a 1B model costs no memory here
        model = GPT(PRESETS[name])
    assert low <= model.num_params() <= high
    assert model.lm_head.weight is model.tok_emb.weight


def test_unknown_preset_and_bad_heads_are_rejected() -> None:
    with pytest.raises(ValueError, match="unknown GPT preset"):
        preset("nope")
    with pytest.raises(ValueError, match="divisible"):
        GPTConfig(n_embd=10, n_head=4)


def test_forward_shapes_loss_and_generate() -> None:
    torch.manual_seed(0)
    model = GPT(preset("tiny"))
    x = torch.randint(0, 256, (2, 16))
    logits, loss = model(x, torch.roll(x, -1, dims=1))
    assert logits.shape == (2, 16, 256)
    assert loss is not None and math.isfinite(loss.item())
    assert abs(loss.item() - math.log(256)) < 0.5  # small init: close to uniform
    assert model(x)[1] is None
    out = model.generate(x[:, :4], 5, top_k=10, generator=torch.Generator().manual_seed(0))
    assert out.shape == (2, 9) and torch.equal(out[:, :4], x[:, :4])
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, preset("tiny").block_size + 1, dtype=torch.long))


def test_every_block_is_a_unit_and_returns_a_fresh_tensor() -> None:
    model = GPT(preset("tiny"))
    units = select_unit_modules(model, None)
    assert units[0] is model and units[1:] == list(model.blocks)
    x = torch.randn(1, 4, preset("tiny").n_embd, requires_grad=True)
    out = model.blocks[0](x)
    assert out._base is None and out is not x


def test_unsharded_state_bytes_counts_adamw() -> None:
    model = GPT(preset("tiny"))
    n, tensors = model.num_params(), len(list(model.parameters()))
    sb = unsharded_state_bytes(model)
    assert (sb.params, sb.grads, sb.optimizer) == (4 * n, 4 * n, 8 * n + 4 * tensors)


# ---------------------------------------------------------------------------------------------------------
# Byte corpus
# ---------------------------------------------------------------------------------------------------------
def test_byte_tokenizer_round_trip() -> None:
    tok = ByteTokenizer()
    text = "def f(x):\n    return x + 'é€'  # ünïcode"
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids) and len(ids) == len(text.encode())
    assert tok.decode(ids) == text
    assert tok.decode(torch.tensor(ids)) == text


def test_default_corpus_is_stdlib_python_and_deterministic() -> None:
    data = default_corpus_bytes(20_000)
    assert len(data) == 20_000
    assert data == default_corpus_bytes(20_000)
    assert b"def " in data and b"import " in data


def test_token_stream_gives_each_rank_its_own_part() -> None:
    tokens = torch.arange(4000)  # every token names its own position
    batches = [TokenStream(tokens, 16, 8, rank=r, world_size=4).batch(0) for r in range(4)]
    for r, (x, y) in enumerate(batches):
        assert x.shape == y.shape == (8, 16)
        assert torch.equal(x[:, 1:], y[:, :-1])
        assert x.min() >= r * 1000 and y.max() < (r + 1) * 1000


def test_token_stream_is_deterministic_per_step() -> None:
    tokens = torch.arange(10_000)
    a, b = TokenStream(tokens, 8, 4, seed=1, rank=1, world_size=2), TokenStream(tokens, 8, 4, seed=1, rank=1,
                                                                                 world_size=2)
    assert torch.equal(a.batch(3)[0], b.batch(3)[0])
    assert not torch.equal(a.batch(3)[0], a.batch(4)[0])
    assert not torch.equal(a.batch(3)[0], TokenStream(tokens, 8, 4, seed=2, rank=1, world_size=2).batch(3)[0])


def test_token_stream_rejects_too_few_tokens_and_split_holds_out_the_tail() -> None:
    with pytest.raises(ValueError, match="block_size"):
        TokenStream(torch.arange(100), 30, 2, rank=0, world_size=4)
    train, held = split_tokens(torch.arange(100), 0.1)
    assert torch.equal(train, torch.arange(90)) and torch.equal(held, torch.arange(90, 100))


# ---------------------------------------------------------------------------------------------------------
# Launcher and the demo end to end
# ---------------------------------------------------------------------------------------------------------
def test_torchrun_command_and_threads() -> None:
    cmd = torchrun_command(2, 1, 2, "127.0.0.1", 29500, ["-m", "hsdp.apps.demo", "--steps", "3"])
    assert cmd[1:3] == ["-m", "hsdp.tools.launch.agent"]  # torchrun's agent, with an orderly exit
    assert cmd[cmd.index("--node-rank") + 1] == "1" and cmd[-4:] == ["-m", "hsdp.apps.demo", "--steps", "3"]
    assert threads_per_rank(4, cpus=2) == 1 and threads_per_rank(4, cpus=16) == 4


def test_launcher_stops_every_node_when_one_fails(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    script = tmp_path / "fail_one.py"
    script.write_text(textwrap.dedent("""
        import os, sys, time
        # One write per line: two ranks of a node share the agent's pipe, and torchrun runs Python
        # unbuffered, so print()'s separate pieces could interleave with the other rank's.
        sys.stdout.write("hello from rank " + os.environ["RANK"] + "\\n")
        sys.stdout.flush()
        if os.environ["RANK"] == "3":
            sys.exit(7)
        time.sleep(120)  # the others would wait far longer than the test allows
    """))
    start = time.monotonic()
    code = launch_local(2, 2, [str(script)])
    elapsed = time.monotonic() - start
    out = capfd.readouterr().out
    assert code != 0
    assert elapsed < 60
    assert "[node 1] hello from rank 3" in out and "[node 0] hello from rank 0" in out


def test_hsdp_demo_end_to_end() -> None:
    proc = subprocess.run([sys.executable, "-m", "hsdp", "demo", "--steps", "8"], cwd=REPO,
                          capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "[node 0]" in out and "Model state per rank" in out and "2 replicas x 2 shards" in out
    for rank in range(4):
        assert re.search(rf"\[node 0\] │\s+{rank} │\s+{rank // 2} │\s+{rank % 2} │", out), out
    first, last = map(float, re.search(r"loss fell: ([\d.]+) -> ([\d.]+)", out).groups())
    assert last < first
