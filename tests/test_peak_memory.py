"""Peak tensor memory: the benchmark's measure counts live bytes exactly, and hsdp's step peaks no higher
than FSDP2's on the same model, mesh and batch (the measure is deterministic, so this is a real bound)."""

from __future__ import annotations

import torch
from harness import run_distributed
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from hsdp.models import GPT, GPTConfig
from hsdp.tools.bench.peak_memory import measure_step_peak
from hsdp.tools.bench.systems import SYSTEMS, Wrapped

MIB = 2**20


def test_peak_counts_live_tensors_and_their_frees() -> None:
    model = nn.Linear(256, 256, bias=False)  # 256 KiB of parameters
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def step() -> int:
        a = torch.empty(MIB // 4)  # 1 MiB
        b = torch.empty(MIB // 8)  # 0.5 MiB
        del a
        c = torch.empty(MIB // 2)  # 2 MiB: the peak is b + c, not a + b + c
        return b.numel() + c.numel()

    out, peak = measure_step_peak([step], model, optimizer, torch.device("cpu"))
    assert out == [MIB // 8 + MIB // 2]
    assert peak == 256 * 256 * 4 + int(2.5 * MIB)


def _peaks(rank: int, world: int, cfg: GPTConfig, n_seq: int) -> dict[str, tuple[float, int]]:
    dm = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("replicate", "shard"))
    g = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, cfg.vocab_size, (n_seq, cfg.block_size + 1), generator=g)
    x, y = tokens[:, :-1], tokens[:, 1:]
    out = {}
    for system in ("fsdp2-hsdp", "hsdp"):
        torch.manual_seed(0)
        w = SYSTEMS[system](GPT(cfg), dm, 1e-3)

        def step(w: Wrapped = w) -> float:
            _, loss = w.model(x, y)
            loss.backward()
            w.optimizer.step()
            w.optimizer.zero_grad(set_to_none=True)
            return loss.item()

        step()  # optimizer state exists from here on, as in a long run
        losses, peak = measure_step_peak([step], w.model, w.optimizer, torch.device("cpu"))
        out[system] = (losses[0], peak)
    return out


def test_hsdp_step_peak_is_at_most_fsdp2s() -> None:
    # Wide blocks, short sequences: the step's peak is a block's reduction (unsharded parameters and
    # gradients, reduce-scatter buffers), which is where the order of frees matters. Resharding after the
    # reduce-scatter instead of before it puts hsdp 4% above FSDP2 here; it is 10% below.
    cfg = GPTConfig(vocab_size=64, block_size=32, n_layer=3, n_head=4, n_embd=256)
    for rank_out in run_distributed(_peaks, 4, cfg, 2):
        (fsdp_loss, fsdp_peak), (hsdp_loss, hsdp_peak) = rank_out["fsdp2-hsdp"], rank_out["hsdp"]
        assert abs(fsdp_loss - hsdp_loss) < 1e-5  # the same work
        assert hsdp_peak <= fsdp_peak, (hsdp_peak / MIB, fsdp_peak / MIB)
