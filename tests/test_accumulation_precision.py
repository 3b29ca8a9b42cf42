"""Deferred replica sync, per-hop precision and the compressed inter-node hop, on a 2x2 mesh."""

from __future__ import annotations

import torch
from harness import run_distributed
from models import ParityNet, batch, loss_fn

import hsdp
from hsdp.data.text import TokenStream, as_tokens, default_corpus_bytes
from hsdp.engine.hops import AllReduceHop, Int8ErrorFeedbackHop
from hsdp.models.gpt import GPT, preset

MICRO, STEPS, LR, SEED = 4, 3, 1e-2, 7


def _micro(step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    return batch(step * MICRO + micro, rank, per_rank=2)


def _reference(world: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(SEED)
    model = ParityNet()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    for step in range(STEPS):
        xs, ys = zip(*(_micro(step, m, r) for r in range(world) for m in range(MICRO)))
        loss_fn(model(torch.cat(xs)), torch.cat(ys)).backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


def _train(rank: int, mode: str) -> tuple[dict[str, torch.Tensor], int]:
    torch.manual_seed(SEED)
    model = hsdp.ShardedModel(ParityNet(), mesh=hsdp.init_mesh(2))
    opt = hsdp.ShardedOptimizer(model, torch.optim.AdamW(model.parameters(), lr=LR))
    model.reset_comm_stats()
    for step in range(STEPS):
        for m in range(MICRO):
            last = m == MICRO - 1
            if mode == "deferred":
                model.set_requires_all_reduce(last)
            elif mode == "no_comm":
                model.set_requires_gradient_sync(last)
            x, y = _micro(step, m, rank)
            (loss_fn(model(x), y) / MICRO).backward()
        opt.step()
        opt.zero_grad()
    return hsdp.full_state_dict(model), model.comm_stats()["replicate"]["all_reduce"]["wire_bytes"] // STEPS


def _accumulation(rank: int, world: int) -> dict:
    ref = _reference(world) if rank == 0 else {}
    out = {}
    for mode in ("every_micro_batch", "deferred", "no_comm"):
        full, inter_bytes = _train(rank, mode)
        err = max((full[k] - ref[k]).abs().max().item() for k in ref) if rank == 0 else 0.0
        out[mode] = {"err": err, "inter_node_bytes_per_step": inter_bytes}
    return out


def test_accumulation_matches_the_full_batch_and_syncs_replicas_once() -> None:
    r = run_distributed(_accumulation, 4)[0]
    for mode, v in r.items():
        assert v["err"] < 1e-5, (mode, v)
    every = r["every_micro_batch"]["inter_node_bytes_per_step"]
    assert r["deferred"]["inter_node_bytes_per_step"] * MICRO == every
    assert r["no_comm"]["inter_node_bytes_per_step"] * MICRO == every


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _precision(rank: int, world: int) -> dict:
    torch.manual_seed(SEED)
    ref = ParityNet()
    xs, ys = zip(*(batch(0, r) for r in range(world)))
    loss_fn(ref(torch.cat(xs)), torch.cat(ys)).backward()
    ref_grads = _grads(ref)
    out = {}
    bf16_compute = hsdp.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                       buffer_dtype=torch.bfloat16)
    policies = {  # (mixed precision, inter-node hop)
        "bf16 compute, fp32 both hops": (bf16_compute, None),
        "bf16 compute, bf16 across nodes": (bf16_compute, AllReduceHop(torch.bfloat16)),
        "fp32, bf16 hop": (None, AllReduceHop(torch.bfloat16)),
    }
    for name, (policy, hop) in policies.items():
        torch.manual_seed(SEED)
        model = hsdp.ShardedModel(ParityNet(), mesh=hsdp.init_mesh(2), mixed_precision=policy, replica_hop=hop)
        model.reset_comm_stats()
        x, y = batch(0, rank)
        logits = model(x)
        loss_fn(logits.float(), y).backward()
        # The sharded fp32 gradients (DTensors) gathered into full tensors to compare with the reference.
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
        # Relative error of the whole gradient: per-tensor errors of tiny gradients are dominated by noise.
        diff = torch.cat([(grads[n] - g).flatten() for n, g in ref_grads.items()])
        rel = (diff.norm() / torch.cat([g.flatten() for g in ref_grads.values()]).norm()).item()
        stats = model.comm_stats()["replicate"]["all_reduce"]
        out[name] = {"rel": rel, "grad_dtype": str(next(model.parameters()).grad.dtype),
                     "inter_bytes": stats["wire_bytes"], "missing": sorted(set(ref_grads) - set(grads))}
    return out


def test_bf16_paths_stay_within_bf16_tolerance_and_halve_inter_node_bytes() -> None:
    r = run_distributed(_precision, 4)[0]
    fp32_hop_bytes = r["bf16 compute, fp32 both hops"]["inter_bytes"]
    for name, v in r.items():
        assert v["missing"] == [] and v["grad_dtype"] == "torch.float32", (name, v)
        # bf16 keeps 8 mantissa bits (0.4% per rounding); compute in bf16 compounds a few of them.
        assert v["rel"] < (2e-2 if "compute" in name else 1e-2), (name, v)
    assert r["fp32, bf16 hop"]["rel"] < 5e-3, "a bf16 inter-node hop alone rounds once"
    assert r["bf16 compute, bf16 across nodes"]["inter_bytes"] * 2 == fp32_hop_bytes
    assert r["fp32, bf16 hop"]["inter_bytes"] * 2 == fp32_hop_bytes


def _convergence(rank: int, world: int, steps: int, ckpt_dir: str) -> dict[str, float]:
    tokens = as_tokens(default_corpus_bytes(400_000))
    out = {}
    for name, hop in (("plain", AllReduceHop()), ("int8", Int8ErrorFeedbackHop())):
        torch.manual_seed(SEED)
        model = hsdp.ShardedModel(GPT(preset("tiny")), mesh=hsdp.init_mesh(2), replica_hop=hop)
        opt = hsdp.ShardedOptimizer(model, torch.optim.AdamW(model.parameters(), lr=3e-3))
        stream = TokenStream(tokens, block_size=64, batch_size=8, seed=1, mesh=model.mesh)
        losses = []
        for step in range(steps):
            x, y = stream.batch(step)
            _, loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        if name == "int8":  # the residuals are optimizer state: saved per parameter and restored exactly
            saved = {k: v.clone() for k, v in hop.residuals.items()}
            sd = opt.state_dict()
            assert len(sd["hop_residuals"]) == len(list(model.parameters()))
            hop.residuals.clear()
            opt.load_state_dict(sd)
            assert all(torch.equal(saved[k], hop.residuals[k]) for k in saved)
            # Through a checkpoint too: each replica gets back its own residuals, not one replica's.
            assert not all(torch.equal(v, torch.zeros_like(v)) for v in saved.values())
            hsdp.save_checkpoint(ckpt_dir, model, opt)
            hop.residuals.clear()
            hsdp.load_checkpoint(ckpt_dir, model, opt)
            assert all(torch.equal(saved[k], hop.residuals[k]) for k in saved)
        tail = torch.stack(losses[-10:]).mean()
        torch.distributed.all_reduce(tail)
        out[name] = tail.item() / world
    return out


def test_int8_error_feedback_hop_converges_like_the_uncompressed_hop(tmp_path) -> None:
    r = run_distributed(_convergence, 4, 30, str(tmp_path / "ckpt"))[0]
    assert r["int8"] <= 1.02 * r["plain"], r
