"""Peak tensor memory of one hsdp training step under Hugging Face activation checkpointing.

A GPT-2 built from a config (random weights, nothing downloaded) is wrapped with hsdp (each block a unit)
and trained five ways in the same processes: without checkpointing; with
``gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})`` and ``True``
(recent transformers checkpoint each block's ``forward``: hsdp's hooks stay outside the checkpoint); and
with ``torch.utils.checkpoint`` around each block's *call*, non-reentrant and reentrant (what older
transformers and hand-written loops do: hsdp's hooks run inside the checkpoint, and the reentrant original
forward runs without grad). After two warm-up steps (optimizer state allocated, prefetch order recorded),
one step (forward, backward, AdamW step) is measured with ``hsdp.tools.bench.peak_memory.measure_step_peak``:
the peak bytes of live tensors (CUDA allocator on GPUs, ``MemTracker`` on CPUs), the largest over ranks.
Reentrant checkpointing must stay within 1.1x of non-reentrant in both styles: every unit reshards after
its own backward either way. Writes JSON and a dated Markdown table under ``benchmarks/results/``.

    torchrun --nproc-per-node 2 benchmarks/checkpointing_memory.py
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

import hsdp
from hsdp.tools.bench.peak_memory import measure_step_peak

# name -> (style, use_reentrant); style "hf": gradient_checkpointing_enable, "call": checkpoint(block, ...).
VARIANTS = {"none": (None, False), "hf_non_reentrant": ("hf", False), "hf_reentrant": ("hf", True),
            "call_non_reentrant": ("call", False), "call_reentrant": ("call", True)}


class CheckpointedCall(nn.Module):
    """Checkpoints the whole call of ``block`` (its hooks included), as older transformers did."""

    def __init__(self, block: nn.Module, reentrant: bool) -> None:
        super().__init__()
        self.block = block
        self.reentrant = reentrant

    def forward(self, hidden_states: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        if not (self.training and torch.is_grad_enabled()):
            return self.block(hidden_states, *args, **kwargs)
        call = functools.partial(self.block, **kwargs)
        return checkpoint(call, hidden_states, *args, use_reentrant=self.reentrant)


def gpt2(args: argparse.Namespace) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=args.vocab, n_positions=args.context, n_embd=args.dim, n_layer=args.layers,
                     n_head=args.heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                     eos_token_id=0, use_cache=False)
    return GPT2LMHeadModel(cfg)


def checkpointed_gpt2(args: argparse.Namespace, style: str | None, reentrant: bool) -> tuple[nn.Module, type]:
    """A GPT-2 whose blocks are checkpointed the given way, and the block class (the unit to wrap)."""
    model = gpt2(args)
    block_type = type(model.transformer.h[0])
    if style == "hf":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    elif style == "call":
        for i, block in enumerate(model.transformer.h):
            model.transformer.h[i] = CheckpointedCall(block, reentrant)
    return model, block_type


def measure(args: argparse.Namespace, style: str | None, reentrant: bool, device: torch.device) -> dict[str, float]:
    """Peak bytes (largest over ranks) and the measured step's loss for one checkpointing variant."""
    model, block_type = checkpointed_gpt2(args, style, reentrant)
    model = hsdp.ShardedModel(model.to(device), mesh=hsdp.init_mesh(args.sharding_degree), wrap=block_type)
    opt = hsdp.ShardedOptimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    g = torch.Generator().manual_seed(dist.get_rank())
    ids = torch.randint(0, args.vocab, (args.batch, args.context), generator=g).to(device)

    def forward_backward() -> float:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.item()

    def step() -> None:
        opt.step()
        opt.zero_grad()

    for _ in range(2):
        forward_backward()
        step()
    (loss, _), peak = measure_step_peak([forward_backward, step], model, opt, device)
    peak_t = torch.tensor([peak], dtype=torch.int64, device=device)
    dist.all_reduce(peak_t, op=dist.ReduceOp.MAX)
    return {"peak_bytes": int(peak_t.item()), "loss": loss}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank")
    parser.add_argument("--sharding-degree", type=int, default=None, help="default: every rank (1 node)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo")
    if args.sharding_degree is None:
        args.sharding_degree = dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    results = {name: measure(args, style, reentrant, device) for name, (style, reentrant) in VARIANTS.items()}
    if dist.get_rank() == 0:
        _write(results, args, " ".join(["torchrun", f"--nproc-per-node {dist.get_world_size()}", *sys.argv]),
               device)
    dist.destroy_process_group()
    return 0


def _write(results: dict[str, dict[str, float]], args: argparse.Namespace, command: str,
           device: torch.device) -> None:
    day = datetime.date.today().isoformat()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ratios = {style: results[f"{style}_reentrant"]["peak_bytes"] / results[f"{style}_non_reentrant"]["peak_bytes"]
              for style in ("hf", "call")}
    base = results["hf_non_reentrant"]["peak_bytes"]
    record = {"date": day, "command": command, "device": device.type, "config": vars(args) | {"out": None},
              "variants": results, "reentrant_over_non_reentrant": ratios}
    (out / f"checkpointing_memory_{day}.json").write_text(json.dumps(record, indent=2) + "\n")
    rows = "".join(
        f"| {name} | {r['peak_bytes'] / 2**20:.2f} | {r['peak_bytes'] / base:.3f} | {r['loss']:.6f} |\n"
        for name, r in results.items())
    table = (f"# Peak tensor memory under activation checkpointing ({day})\n\n`{command}`\n\n"
             f"Hugging Face GPT-2 ({args.layers} layers, width {args.dim}, context {args.context}, "
             f"{args.batch} sequences per rank, fp32) on hsdp, sharding degree {args.sharding_degree}, "
             f"{device.type}; one step (forward, backward, AdamW), largest peak over ranks "
             f"(`hsdp/tools/bench/peak_memory.py`).\n\n"
             f"| checkpointing | peak MiB | / hf_non_reentrant | loss |\n|---|---|---|---|\n{rows}\n"
             f"Reentrant / non-reentrant: **{ratios['hf']:.3f}x** with `gradient_checkpointing_enable`, "
             f"**{ratios['call']:.3f}x** with `checkpoint(block, ...)` around each unit's call.\n")
    (out / f"checkpointing_memory_{day}.md").write_text(table)
    print(table)


if __name__ == "__main__":
    sys.exit(main())
