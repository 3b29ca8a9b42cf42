"""Lightning's Trainer on hsdp: a tiny GPT LightningModule, two epochs, a checkpoint per epoch, a resume.

    torchrun --nproc-per-node 4 examples/lightning_trainer.py             # CPU/gloo, 2 replicas x 2 shards
    torchrun --nproc-per-node 4 examples/lightning_trainer.py --precision bf16-mixed

The Trainer launches nothing (torchrun did). After ``configure_model`` the LightningModule is an
``hsdp.ShardedModel``; ``accumulate_grad_batches`` reduces inside the node until the last micro-batch, and
``gradient_clip_val`` clips by the whole gradient's norm. ``ModelCheckpoint`` writes hsdp checkpoints (one
directory per file name, Lightning's loop state inside), so the second ``fit`` resumes epoch 1 exactly; the
last checkpoint is then consolidated for a plain ``load_state_dict``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

import hsdp
from hsdp.integrations.lightning import HSDPStrategy
from hsdp.models.gpt import GPT, GPTConfig

VOCAB, SEQ = 64, 16


def counting(n: int) -> torch.Tensor:
    """Sequences that count up modulo the vocabulary from a random start: learnable, so the loss falls."""
    starts = torch.randint(0, VOCAB, (n, 1), generator=torch.Generator().manual_seed(0))
    return (starts + torch.arange(SEQ + 1)) % VOCAB


class LitGPT(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = GPT(GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=2, n_embd=32))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.model(x, y)[1]

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self(*batch)
        self.log("loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def on_train_epoch_end(self) -> None:
        # comm_stats: hsdp's own count (shard = in the node, replicate = across nodes) since the epoch began.
        crossed = self.comm_stats().get("replicate", {}).get("all_reduce", {}).get("calls", 0)
        self.print(f"epoch {self.current_epoch}: loss {self.trainer.callback_metrics['loss']:.4f}, "
                   f"{self.trainer.global_step} optimizer steps, inter-node collectives this epoch {crossed}")
        self.reset_comm_stats()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def trainer(args: argparse.Namespace, out: str, **kwargs: Any) -> L.Trainer:
    accelerator = "cuda" if torch.cuda.is_available() else "cpu"
    return L.Trainer(accelerator=accelerator, strategy=HSDPStrategy(sharding_degree=args.shard),
                     precision=args.precision, accumulate_grad_batches=2, gradient_clip_val=1.0,
                     default_root_dir=out, logger=False, enable_progress_bar=False, enable_model_summary=False,
                     **kwargs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shard", type=int, default=2, help="sharding degree (default 2: 2 replicas of 2 on 4 ranks)")
    parser.add_argument("--precision", default="32-true", choices=["32-true", "bf16-mixed"])
    parser.add_argument("--out", default=None, help="directory for the checkpoints (default: a temporary one)")
    args = parser.parse_args()
    out = args.out or os.path.join(tempfile.gettempdir(), f"hsdp-lightning-{os.environ.get('TORCHELASTIC_RUN_ID')}")

    ids = counting(32 * int(os.environ.get("WORLD_SIZE", "1")))
    loader = DataLoader(TensorDataset(ids[:, :-1], ids[:, 1:]), batch_size=2)  # the Trainer adds the sampler
    ckpt_dir = os.path.join(out, "checkpoints")
    saver = ModelCheckpoint(dirpath=ckpt_dir, filename="{epoch}", save_top_k=-1)

    first = trainer(args, out, max_epochs=1, callbacks=[saver])
    first.fit(LitGPT(), loader)
    resumed = trainer(args, out, max_epochs=2, enable_checkpointing=False)
    model = LitGPT()
    resumed.fit(model, loader, ckpt_path=os.path.join(ckpt_dir, "epoch=0.ckpt"))

    x, y = ids[:8, :-1], ids[:8, 1:]
    with torch.no_grad():  # every rank: the sharded model's forward gathers its units
        trained = model(x.to(model.device), y.to(model.device)).item()
    weights = hsdp.full_state_dict(model)  # a collective: every rank; the tensors land on rank 0
    if resumed.is_global_zero:
        plain = LitGPT()
        plain.load_state_dict(weights)
        with torch.no_grad():
            again = plain(x, y).item()
        print(f"consolidated {len(weights)} tensors into a plain LitGPT: loss on 8 sequences {again:.4f}, the "
              f"trained model's {trained:.4f}; for files: "
              f"hsdp export {os.path.join(ckpt_dir, 'epoch=0.ckpt')} --to model.safetensors")
        if args.out is None:
            shutil.rmtree(out)


if __name__ == "__main__":
    main()
