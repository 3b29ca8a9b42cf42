"""An hsdp model in a Hugging Face ``accelerate`` training loop: no DDP wrap, accumulation crossing nodes once per
step, ``save_state``/``load_state`` through hsdp's sharded checkpoints, a Hugging Face folder at the end.

The model is a tiny LlamaForCausalLM built from a config (no download) so the example runs in seconds on CPUs;
the same lines train a real one on GPUs (``--sharding-degree`` = GPUs per node)::

    torchrun --nproc-per-node 4 examples/accelerate_loop.py                 # 2 x 2 mesh on gloo
    torchrun --nproc-per-node 4 examples/accelerate_loop.py --out /tmp/acc  # where the state and HF folder go
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader
from transformers import LlamaConfig, LlamaForCausalLM

import hsdp
from hsdp.integrations import accelerate as hsdp_accelerate

VOCAB, SEQ = 64, 32


def counting_tokens(n: int = 512) -> torch.Tensor:
    """Sequences that count up modulo the vocabulary from a random start: learnable, so the loss falls."""
    starts = torch.randint(0, VOCAB, (n, 1), generator=torch.Generator().manual_seed(0))
    return (starts + torch.arange(SEQ)) % VOCAB


def tiny_llama() -> LlamaForCausalLM:
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                      tie_word_embeddings=True, use_cache=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


def train(accelerator: Accelerator, model, optimizer, loader, scheduler, max_norm: float) -> float:
    """One epoch of the usual accelerate loop; returns the last step's loss (mean over ranks)."""
    loss = torch.zeros(())
    for batch in loader:
        with accelerator.accumulate(model):  # micro-batches: model.no_sync(), one inter-node hop per step
            loss = model(input_ids=batch, labels=batch).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), max_norm)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
    return float(accelerator.reduce(loss.detach(), "mean"))


def main() -> None:
    parser = argparse.ArgumentParser(description="hsdp under accelerate.Accelerator")
    parser.add_argument("--sharding-degree", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "hsdp_accelerate_loop"),
                        help="directory for the saved state and the Hugging Face folder, the same path on every rank "
                             "(shared storage across nodes)")
    args = parser.parse_args()

    accelerator = Accelerator(gradient_accumulation_steps=2, cpu=not torch.cuda.is_available())
    mesh = hsdp.init_mesh(args.sharding_degree)  # on the process group accelerate started
    model = hsdp.ShardedModel(tiny_llama(), mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.9 ** (s / accelerator.num_processes))
    loader = DataLoader(counting_tokens(), batch_size=4, shuffle=True)
    model, optimizer, loader, scheduler = hsdp_accelerate.prepare(accelerator, model, optimizer, loader, scheduler)

    for epoch in range(args.epochs):
        loss = train(accelerator, model, optimizer, loader, scheduler, max_norm=1.0)
        accelerator.print(f"epoch {epoch}: loss {loss:.4f}")
        accelerator.save_state(os.path.join(args.out, "state"))  # hsdp checkpoint in state/hsdp_model
    accelerator.load_state(os.path.join(args.out, "state"))      # any mesh shape could read it back
    folder = hsdp_accelerate.save_pretrained(model, os.path.join(args.out, "hf"))  # every rank calls it
    batch = counting_tokens(8)
    with torch.no_grad():  # every rank: the sharded model's forward gathers its units
        on_device = batch.to(accelerator.device)
        trained = model(input_ids=on_device, labels=on_device).loss.item()
    if accelerator.is_main_process:
        reloaded = LlamaForCausalLM.from_pretrained(folder)  # a plain model from the folder: the same weights
        with torch.no_grad():
            again = reloaded(input_ids=batch, labels=batch).loss.item()
        accelerator.print(f"8 sequences: trained model loss {trained:.4f}, reloaded from {folder} {again:.4f}")
    accelerator.wait_for_everyone()

if __name__ == "__main__":
    main()
