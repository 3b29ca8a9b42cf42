"""The CUDA runtime's buffer and stream discipline, on CPU, with the stream model of ``stream_model.py``.

On a 2 x 2 gloo mesh, the runtime takes its CUDA branches against a model of the device that keeps
allocation streams, ``record_stream`` pins and stream order, and assumes the slowest device: nothing
completes until waited. Each scenario reports what a GPU could silently get wrong:

* a buffer allocated on one stream and still used by another when the host drops it, without that stream
  having waited or ``record_stream`` (e.g. the int8 hop's residual loaded from a checkpoint, read by the hop
  stream and replaced; a micro-batch's partial sum moved by ``.to()`` between micro-batches);
* a read or write not ordered after another stream's access of the same buffer (e.g. the compute stream
  reading a partial sum the hop stream is still writing, after a micro-batch that skips the replica sync);
* how many units' reduce-scatter inputs the allocator cannot hand out at once: one more than the unit being
  reduced, as in FSDP2, whatever the device's progress (not one per unit until the end of backward).

All scenarios run in one spawn; each trains the same tiny model for a few steps.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from harness import run_distributed
from models import ParityNet, batch, loss_fn
from stream_model import StreamModel

import hsdp


def _train(model: hsdp.ShardedModel, opt: torch.optim.Optimizer, rank: int, steps: int, stream: StreamModel,
           micro_batches: int = 1, between: Callable[[], None] | None = None) -> None:
    for step in range(steps):
        for micro in range(micro_batches):
            x, y = batch(step * micro_batches + micro, rank)
            last = micro == micro_batches - 1
            model.set_requires_all_reduce(last)
            loss_fn(model(x), y).backward()
            if not last and between is not None:
                between()
        opt.step()
        opt.zero_grad()
        stream.synchronize()  # a step's end: nothing here depends on it, it keeps scenarios apart


def _model(**kwargs: object) -> tuple[hsdp.ShardedModel, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = hsdp.ShardedModel(ParityNet(), mesh=hsdp.init_mesh(2), **kwargs)
    return model, hsdp.ShardedOptimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-2))


def _scenario(name: str, rank: int) -> dict:
    with StreamModel() as stream:
        if name == "plain":
            model, opt = _model()
            _train(model, opt, rank, 2, stream)
        elif name == "bf16_reduce":
            model, opt = _model(mixed_precision=hsdp.MixedPrecision(reduce_dtype=torch.bfloat16))
            _train(model, opt, rank, 2, stream, micro_batches=2)
        elif name == "sliced":
            model, opt = _model(shard_optimizer_across_replicas=True)
            _train(model, opt, rank, 2, stream)
        elif name == "int8_resumed":
            model, opt = _model(replica_hop=hsdp.Int8ErrorFeedbackHop())
            _train(model, opt, rank, 1, stream)
            saved = opt.state_dict()
            model, opt = _model(replica_hop=hsdp.Int8ErrorFeedbackHop())
            opt.load_state_dict(saved)
            _train(model, opt, rank, 1, stream)
        elif name == "weighted":
            # Batch weights (a tensor, as a token count would be): scaled, summed and divided on the side streams.
            model, opt = _model(mixed_precision=hsdp.MixedPrecision(reduce_dtype=torch.bfloat16))
            model.set_batch_weight(torch.tensor(float(rank + 1)))
            _train(model, opt, rank, 2, stream, micro_batches=2)
        elif name == "moved_between_micro_batches":
            # Reductions in bf16, shards converted to fp64 and back: the partial sum is a new tensor, cast by the hop.
            policy = hsdp.MixedPrecision(param_dtype=torch.float32, reduce_dtype=torch.bfloat16)
            model, opt = _model(mixed_precision=policy)
            _train(model, opt, rank, 1, stream, micro_batches=2, between=lambda: model.double().float())
        else:
            raise AssertionError(name)
        stream.collect()
        return {"problems": sorted(set(stream.problems)), "rs_inputs": stream.peak_tagged.get("rs_input", 0),
                "units": len(model._hsdp_state.units), "params": _params(model)}


def _params(model: hsdp.ShardedModel) -> dict[str, torch.Tensor]:
    return {n: p.detach().full_tensor() for n, p in model.named_parameters()}


def _without_side_streams(rank: int) -> dict[str, torch.Tensor]:
    """The "plain" scenario on the CPU path (no side-stream branch taken)."""
    model, opt = _model()
    for step in range(2):
        x, y = batch(step, rank)
        loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return _params(model)


SCENARIOS = ("plain", "bf16_reduce", "sliced", "int8_resumed", "weighted", "moved_between_micro_batches")


def _all(rank: int, world: int) -> dict:
    out = {name: _scenario(name, rank) for name in SCENARIOS}
    out["reference"] = _without_side_streams(rank)
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_distributed(_all, 4)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_no_buffer_is_reused_or_read_while_another_stream_uses_it(results: list[dict], scenario: str) -> None:
    for rank, r in enumerate(results):
        assert r[scenario]["problems"] == [], (rank, r[scenario]["problems"])


def test_the_side_stream_paths_compute_what_the_cpu_path_does(results: list[dict]) -> None:
    for name, value in results[0]["reference"].items():
        torch.testing.assert_close(results[0]["plain"]["params"][name], value, rtol=0, atol=0)


def test_at_most_two_reduce_scatter_inputs_are_held_at_once(results: list[dict]) -> None:
    """The unit being reduced and the one before, as in FSDP2, even when the device never catches up."""
    for r in results:
        got = r["plain"]
        assert got["units"] >= 4, "enough units for the bound to mean something"
        assert 1 <= got["rs_inputs"] <= 2, got
