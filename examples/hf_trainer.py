"""``transformers.Trainer`` on an hsdp model: ``HSDPTrainer`` takes Trainer's arguments plus the hsdp options.

Trains a tiny LlamaForCausalLM built from a config (no download; seconds on CPUs), checkpoints every 10 steps
(hsdp sharded checkpoints inside Trainer's ``checkpoint-N``), evaluates and writes a Hugging Face folder.
``--resume`` continues from the newest checkpoint in ``--out`` exactly where it stopped::

    torchrun --nproc-per-node 4 examples/hf_trainer.py                   # 2 x 2 mesh on gloo, 20 steps
    torchrun --nproc-per-node 4 examples/hf_trainer.py --steps 30 --resume
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
from torch.utils.data import Dataset
from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

from hsdp.integrations.transformers import HSDPTrainer

VOCAB, SEQ = 64, 32


class Counting(Dataset):
    """Sequences that count up modulo the vocabulary from a random start: learnable, so the loss falls."""

    def __init__(self, n: int, seed: int) -> None:
        starts = torch.randint(0, VOCAB, (n, 1), generator=torch.Generator().manual_seed(seed))
        self.tokens = (starts + torch.arange(SEQ)) % VOCAB

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


def main() -> None:
    parser = argparse.ArgumentParser(description="transformers.Trainer on hsdp (HSDPTrainer)")
    parser.add_argument("--sharding-degree", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "hsdp_hf_trainer"),
                        help="output directory, the same path on every rank (shared storage across nodes)")
    parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --out")
    args = parser.parse_args()

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                      tie_word_embeddings=True, use_cache=False)
    torch.manual_seed(0)
    training = TrainingArguments(output_dir=args.out, max_steps=args.steps, per_device_train_batch_size=4,
                                 gradient_accumulation_steps=2, learning_rate=3e-3, max_grad_norm=1.0,
                                 logging_steps=5, save_strategy="steps", save_steps=10, eval_strategy="steps",
                                 eval_steps=10, report_to="none", disable_tqdm=True,
                                 use_cpu=not torch.cuda.is_available())
    trainer = HSDPTrainer(model=LlamaForCausalLM(cfg), args=training, train_dataset=Counting(1024, seed=0),
                          eval_dataset=Counting(64, seed=1), sharding_degree=args.sharding_degree)
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    metrics = trainer.evaluate()  # every rank: each evaluates its part of the eval set
    final = os.path.join(args.out, "final")
    trainer.save_model(final)  # every rank: a Hugging Face folder, rank 0 writes
    batch = Counting(8, seed=1).tokens
    with torch.no_grad():  # every rank: the sharded model's forward gathers its units
        on_device = batch.to(training.device)
        trained = trainer.model(input_ids=on_device, labels=on_device).loss.item()
    if trainer.is_world_process_zero():
        reloaded = LlamaForCausalLM.from_pretrained(final)  # a plain model from the folder: the same weights
        with torch.no_grad():
            again = reloaded(input_ids=batch, labels=batch).loss.item()
        print(f"eval loss {metrics['eval_loss']:.4f}; 8 held-out sequences: trained model loss {trained:.4f}, "
              f"reloaded from {final} {again:.4f}")

if __name__ == "__main__":
    main()
