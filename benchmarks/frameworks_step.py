"""Step time of hsdp under the training frameworks against the same model in a hand-written hsdp loop.

Each system trains the same Hugging Face ``LlamaForCausalLM`` (built from a config, seeded, nothing downloaded)
on the same batches (2 sequences of 128 tokens per rank per step), AdamW, gradient clipping at 1.0, on 2
emulated nodes x 2 ranks (``hsdp launch``: network namespaces, 1 Gbit/s links), ``sharding_degree=2``:

* ``hand``: ``hsdp.ShardedModel`` + ``hsdp.ShardedOptimizer`` in a plain loop;
* ``trainer``: ``hsdp.integrations.transformers.HSDPTrainer`` (Hugging Face Trainer);
* ``lightning``: ``lightning.pytorch.Trainer(strategy=hsdp.integrations.lightning.HSDPStrategy(...))``.

A step's time is the wall time between the ends of consecutive optimizer steps on rank 0 (the same clock for
every system, whatever the framework does around the step); the figure is the median over the measured steps,
after warm-up. Jobs run interleaved (hand, trainer, lightning, hand, ...) ``--repeat`` times and each system's
median over its repeats is reported, with the ratio to ``hand``: the framework must not cost the overlap.
Writes JSON and a dated Markdown table with the exact command under ``benchmarks/results/``.

    python benchmarks/frameworks_step.py --repeat 3
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
SYSTEMS = ("hand", "trainer", "lightning")
PER_RANK, SEQ, VOCAB = 2, 128, 4096


# -- the worker: one system, one job ---------------------------------------------------------------------
def _llama() -> object:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=4, vocab_size=VOCAB, max_position_embeddings=SEQ)
    import torch

    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def _dataset(steps: int, world: int) -> list[dict]:
    """``steps`` global batches of ``world x PER_RANK`` sequences, the same on every rank and for every system."""
    import torch

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (steps * world * PER_RANK, SEQ), generator=g)
    return [{"input_ids": row, "labels": row} for row in ids]


class _Clock:
    """Wall times of the ends of optimizer steps (rank 0 reads them)."""

    def __init__(self) -> None:
        self.ends: list[float] = []

    def tick(self) -> None:
        self.ends.append(time.perf_counter())


def _run_hand(steps: int, clock: _Clock) -> None:
    import torch

    import hsdp

    mesh = hsdp.init_mesh(2)
    model = hsdp.ShardedModel(_llama(), mesh=mesh)
    opt = hsdp.ShardedOptimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    data = _dataset(steps, mesh.world_size)
    rows = hsdp.distributed_sampler(data, mesh)
    batch = [data[i] for i in rows]
    for step in range(steps):
        part = batch[step * PER_RANK:(step + 1) * PER_RANK]
        ids = torch.stack([b["input_ids"] for b in part])
        model(input_ids=ids, labels=ids).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        clock.tick()


def _run_trainer(steps: int, clock: _Clock) -> None:
    import torch
    from transformers import TrainerCallback, TrainingArguments

    from hsdp.integrations.transformers import HSDPTrainer

    class Tick(TrainerCallback):
        def on_step_end(self, *args: object, **kwargs: object) -> None:
            clock.tick()

    world = int(os.environ["WORLD_SIZE"])
    # Trainer's defaults, but for logging, saving and evaluation (a benchmark measures steps) and the plain AdamW
    # of the hand loop (Trainer's default may be the fused one).
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), max_steps=steps, per_device_train_batch_size=PER_RANK,
                             learning_rate=1e-4, max_grad_norm=1.0, optim="adamw_torch", logging_steps=10**6,
                             save_strategy="no", eval_strategy="no", report_to="none", disable_tqdm=True,
                             use_cpu=not torch.cuda.is_available(), dataloader_num_workers=0)
    HSDPTrainer(model=_llama(), args=args, train_dataset=_dataset(steps, world), sharding_degree=2,
                callbacks=[Tick()]).train()


def _run_lightning(steps: int, clock: _Clock) -> None:
    import lightning as L
    import torch

    from hsdp.integrations.lightning import HSDPStrategy

    class Lit(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = _llama()

        def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
            return self.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss

        def on_train_batch_end(self, *args: object) -> None:  # after this batch's optimizer step
            clock.tick()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    loader = torch.utils.data.DataLoader(_dataset(steps, int(os.environ["WORLD_SIZE"])), batch_size=PER_RANK)
    L.Trainer(accelerator="cuda" if torch.cuda.is_available() else "cpu", strategy=HSDPStrategy(sharding_degree=2),
              max_steps=steps, gradient_clip_val=1.0, logger=False, enable_progress_bar=False,
              enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0).fit(Lit(), loader)


RUNNERS: dict[str, Callable[[int, _Clock], None]] = {"hand": _run_hand, "trainer": _run_trainer,
                                                      "lightning": _run_lightning}


def worker(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(1)
    clock = _Clock()
    RUNNERS[args.system](args.warmup + args.steps, clock)
    if int(os.environ.get("RANK", "0")) == 0:
        gaps = [b - a for a, b in zip(clock.ends, clock.ends[1:])][args.warmup - 1:]
        Path(args.out).write_text(json.dumps({"system": args.system, "step_s": gaps}))


# -- the driver: interleaved jobs on the emulated cluster ------------------------------------------------
def run_job(args: argparse.Namespace, system: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/result.json"
        cmd = [sys.executable, "-m", "hsdp", "launch", "--nodes", "2", "--nproc-per-node", "2",
               "--inter-node-bandwidth", args.bandwidth, "--require-emulation", "--", __file__, "--worker",
               "--system", system, "--steps", str(args.steps), "--warmup", str(args.warmup), "--out", out]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0 or not Path(out).exists():
            tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-30:])
            raise SystemExit(f"{system} failed (exit {proc.returncode}):\n{tail}")
        return json.loads(Path(out).read_text())


def summarise(runs: list[dict]) -> dict[str, dict]:
    by_system: dict[str, list[float]] = {}
    for r in runs:
        by_system.setdefault(r["system"], []).append(statistics.median(r["step_s"]))
    out = {s: {"median_step_s": statistics.median(v), "repeats_median_step_s": v} for s, v in by_system.items()}
    hand = out.get("hand", {}).get("median_step_s")
    for v in out.values():
        v["ratio_to_hand"] = v["median_step_s"] / hand if hand else None
    return out


def markdown(command: str, args: argparse.Namespace, summary: dict[str, dict]) -> str:
    lines = [f"# Framework step time vs a hand-written hsdp loop ({time.strftime('%Y-%m-%d')})", "",
             f"Command: `{command}`", "",
             f"2 emulated nodes x 2 ranks, {args.bandwidth} inter-node links, sharding_degree=2, LlamaForCausalLM "
             f"(hidden 256, 4 layers, vocab {VOCAB}), {PER_RANK} x {SEQ} tokens per rank per step, AdamW, clipping "
             f"at 1.0; {args.steps} measured steps after {args.warmup} warm-up, {args.repeat} interleaved repeats "
             "(median of the per-job medians).", "",
             "| system | median step s | per-repeat medians s | ratio to hand |", "|---|---|---|---|"]
    for s, v in summary.items():
        reps = ", ".join(f"{x:.3f}" for x in v["repeats_median_step_s"])
        ratio = "" if v["ratio_to_hand"] is None else f"{v['ratio_to_hand']:.3f}"
        lines.append(f"| {s} | {v['median_step_s']:.3f} | {reps} | {ratio} |")
    return "\n".join(lines) + "\n"


def driver(args: argparse.Namespace, argv: list[str]) -> None:
    systems = args.systems.split(",")
    runs = []
    for rep in range(args.repeat):
        for system in systems:
            print(f"repeat {rep + 1}/{args.repeat}: {system} ...", flush=True)
            runs.append(run_job(args, system))
    summary = summarise(runs)
    command = "python benchmarks/frameworks_step.py " + shlex.join(argv)
    RESULTS.mkdir(exist_ok=True)
    name = f"frameworks_step_{time.strftime('%Y-%m-%d')}" + (f"_{args.tag}" if args.tag else "")
    (RESULTS / f"{name}.json").write_text(json.dumps({"command": command, "args": vars(args), "runs": runs,
                                                      "summary": summary}, indent=1))
    text = markdown(command, args, summary)
    (RESULTS / f"{name}.md").write_text(text)
    print(text)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--bandwidth", default="1gbit")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--tag", default="")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--system", choices=SYSTEMS, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
    else:
        driver(args, argv)


if __name__ == "__main__":
    main()
