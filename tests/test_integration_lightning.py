"""Lightning's Trainer and Fabric on hsdp (``hsdp.integrations.lightning``), against the same framework on one
process.

One spawn of 4 gloo ranks as 2 emulated nodes x 2 (``LOCAL_WORLD_SIZE=2``, mesh 2x2) trains a 2-block GPT
(vocab 64, width 32, sequence 16) with AdamW, gradient clipping by norm and accumulation over 2 micro-batches:

* Fabric (``HSDPFabricStrategy``): per micro-batch losses, per step gradient norms (``fabric.clip_gradients``)
  and the final full parameters equal one plain process running the same loop on the global batch (1e-5);
  inside ``fabric.no_backward_sync`` a micro-batch reduce-scatters in the node and sends nothing across nodes,
  the last one of the window crosses once (``comm_stats()``); ``fabric.save`` after step 2 and ``fabric.load``
  into a freshly initialised model and optimizer give the straight run's remaining losses and weights.
* Trainer (``HSDPStrategy``, the step calling ``self(...)``): the same parity against a one-device Trainer,
  the same per micro-batch communication (and as many all-gathers as Fabric's direct call: the step's nested
  root call regathers nothing), ``ModelCheckpoint``'s epoch-0 checkpoint resumed with ``fit(ckpt_path=...)``
  gives the straight run's epoch-1 losses and weights, and ``hsdp.export_safetensors`` of the last one loads
  into a plain LightningModule with ``load_state_dict`` and equals ``hsdp.full_state_dict``.
* ``precision="bf16-mixed"`` is hsdp's mixed precision (losses equal a hand-written hsdp loop with the same
  ``MixedPrecision``, and differ from fp32), no process is launched, the sampler is by data-parallel rank (a
  tensor-parallel pair shares one), Lightning's ``data_parallel`` mesh is refused.
* Nodes of different sizes (3 + 1, no degree): the Trainer's strategy builds a heterogeneous mesh, hands the
  LightningModule ``device_mesh=None`` and trains as the one-device Trainer does (1e-5); a module wrapped on
  another heterogeneous mesh is refused.

Bad input that needs no processes (precision flags, degrees, the wrong framework's strategy, a missing
launcher) is checked in the test process.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("lightning", reason="the lightning extra (pip install 'hsdp[lightning]'); `make test` installs it")

import lightning as L
from harness import run_distributed
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import hsdp
from hsdp.integrations.lightning import HSDPFabricStrategy, HSDPStrategy
from hsdp.integrations.lightning.precision import BF16_MIXED

WORLD, PER_RANK, ACC, CLIP, LR = 4, 2, 2, 0.5, 1e-3
VOCAB, SEQ = 64, 16
SAMPLES = 64  # Fabric: 8 micro-batches of 8 = 4 optimizer steps; the Trainer's epochs take the first 32
QUIET = {"logger": False, "enable_progress_bar": False, "enable_model_summary": False}


def _gpt(seed: int = 0) -> torch.nn.Module:
    from hsdp.models.gpt import GPT, GPTConfig

    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=2, n_embd=32))


def _meta_gpt() -> torch.nn.Module:
    with torch.device("meta"):
        return _gpt()


def _dataset(n: int = SAMPLES) -> TensorDataset:
    ids = torch.randint(0, VOCAB, (n, SEQ + 1), generator=torch.Generator().manual_seed(7))
    return TensorDataset(ids[:, :-1], ids[:, 1:])


def _optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.1)


def _close(actual: Any, expected: Any, tol: float = 1e-5, what: str = "") -> None:
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol, msg=lambda m: f"{what}: {m}")


def _hops(stats: dict) -> tuple[int, int, int]:
    """(inter-node calls, inter-node bytes, intra-node reduce-scatters) of one micro-batch's comm_stats()."""
    rep = sum(op["calls"] for op in stats.get("replicate", {}).values())
    rep_bytes = sum(op["bytes"] for op in stats.get("replicate", {}).values())
    return int(rep), int(rep_bytes), int(stats.get("shard", {}).get("reduce_scatter", {}).get("calls", 0))


def _gathers(stats: dict) -> int:
    return int(stats.get("shard", {}).get("all_gather", {}).get("calls", 0))


# -- Fabric ------------------------------------------------------------------------------------------------
def _fabric_loop(fabric: L.Fabric, model: Any, opt: Any, loader: Any, *, skip: int = 0,
                 save: tuple[str, int] | None = None, stats: list | None = None) -> tuple[list, list]:
    """Accumulate ACC micro-batches per step, clip, step; optionally save after step ``save[1]``."""
    losses, norms = [], []
    for i, (x, y) in enumerate(loader):
        if i < skip:
            continue
        accumulating = (i + 1) % ACC != 0
        if stats is not None:
            model.reset_comm_stats()
        with fabric.no_backward_sync(model, enabled=accumulating):
            _, loss = model(x, y)
            fabric.backward(loss / ACC)
        if stats is not None:
            stats.append(model.comm_stats())
        losses.append(loss.detach())
        if not accumulating:
            norms.append(fabric.clip_gradients(model, opt, max_norm=CLIP).detach())
            opt.step()
            opt.zero_grad()
            if save is not None and (i + 1) // ACC == save[1]:
                fabric.save(save[0], {"model": model, "optimizer": opt, "step": save[1]})
    return losses, norms


def _fabric_reference() -> tuple[list, list, dict]:
    fabric = L.Fabric(accelerator="cpu", devices=1)
    module = _gpt()
    model, opt = fabric.setup(module, _optimizer(module.parameters()))
    loader = fabric.setup_dataloaders(DataLoader(_dataset(), batch_size=PER_RANK * WORLD))
    losses, norms = _fabric_loop(fabric, model, opt, loader)
    return losses, norms, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _hsdp_fabric(strategy_kwargs: dict | None = None, precision: str = "32-true") -> L.Fabric:
    fabric = L.Fabric(accelerator="cpu", strategy=HSDPFabricStrategy(sharding_degree=2, **(strategy_kwargs or {})),
                      precision=precision)
    fabric.launch()
    return fabric


def _fabric_checks(rank: int, tmp: str) -> dict:
    ref_losses, ref_norms, ref_params = _fabric_reference()
    fabric = _hsdp_fabric()
    assert fabric.strategy.launcher is None and fabric.world_size == WORLD and fabric.global_rank == rank
    module = _gpt()
    model, opt = fabric.setup(module, _optimizer(module.parameters()))
    assert isinstance(model.module, hsdp.ShardedModel) and isinstance(opt.optimizer, hsdp.ShardedOptimizer)
    loader = fabric.setup_dataloaders(DataLoader(_dataset(), batch_size=PER_RANK))
    assert (loader.sampler.num_replicas, loader.sampler.rank) == (WORLD, rank)
    path = os.path.join(tmp, "fabric", "step-2")
    stats: list = []
    losses, norms = _fabric_loop(fabric, model, opt, loader, save=(path, 2), stats=stats)
    mean = fabric.all_reduce(torch.stack(losses), reduce_op="mean")
    _close(mean, torch.stack(ref_losses))
    _close(torch.stack(norms), torch.stack(ref_norms))
    full = hsdp.full_state_dict(model.module)
    if rank == 0:
        for name, value in ref_params.items():
            _close(full[name], value, what=name)
    hops = [_hops(s) for s in stats]
    assert all(h[:2] == (0, 0) and h[2] > 0 for h in hops[0::2]), hops  # inside no_backward_sync: in the node only
    assert all(h[0] > 0 and h[1] > 0 for h in hops[1::2]), hops  # the window's last micro-batch crosses, once

    # Resume: a fresh model (another seed) and optimizer, loaded from the checkpoint of step 2.
    again = _hsdp_fabric()
    module = _gpt(seed=1)
    model2, opt2 = again.setup(module, _optimizer(module.parameters()))
    state = {"model": model2, "optimizer": opt2, "step": 0}
    remainder = again.load(path, state)
    assert state["step"] == 2 and remainder == {}, (state["step"], remainder)
    loader2 = again.setup_dataloaders(DataLoader(_dataset(), batch_size=PER_RANK))
    resumed, _ = _fabric_loop(again, model2, opt2, loader2, skip=2 * ACC)
    _close(torch.stack(resumed), torch.stack(losses[2 * ACC:]), tol=1e-6)
    full2 = hsdp.full_state_dict(model2.module)
    if rank == 0:
        for name, value in full.items():
            _close(full2[name], value, tol=1e-6, what=name)
    return {"gathers": _gathers(stats[0]), "hops": hops[1]}


def _bf16_and_sampler_checks(rank: int) -> None:
    """bf16-mixed is hsdp's MixedPrecision (= a hand-written hsdp loop with it); a TP pair shares a batch; a
    Lightning mesh is refused before any collective."""
    fabric = _hsdp_fabric(precision="bf16-mixed")
    assert fabric.strategy.precision.policy == BF16_MIXED
    module = _gpt()
    model, opt = fabric.setup(module, _optimizer(module.parameters()))
    batches = list(fabric.setup_dataloaders(DataLoader(_dataset(8 * WORLD), batch_size=PER_RANK)))[:2]
    hand = hsdp.ShardedModel(_gpt(), mesh=fabric.strategy.mesh, mixed_precision=BF16_MIXED)
    hand_opt = hsdp.ShardedOptimizer(hand, _optimizer(hand.parameters()))
    plain = hsdp.ShardedModel(_gpt(), mesh=fabric.strategy.mesh)
    for x, y in batches:
        logits, loss = model(x, y)
        assert logits.dtype == torch.float32  # output_dtype: the loss is computed in fp32
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        _, expected = hand(x, y)
        expected.backward()
        hand_opt.step()
        hand_opt.zero_grad()
        _close(loss.detach(), expected.detach(), tol=0.0)
        assert float(loss) != float(plain(x, y)[1])  # bf16 compute really ran

    # fabric.init_module(empty_init=True): built on meta, materialised at setup (reset_parameters, this seed).
    with fabric.init_module(empty_init=True):
        meta = _gpt(seed=3)
    assert meta.tok_emb.weight.is_meta
    materialised = fabric.setup_module(meta)
    by_hand = hsdp.ShardedModel(_meta_gpt(), mesh=fabric.strategy.mesh)
    torch.manual_seed(3)
    hsdp.materialize(by_hand)
    ours, theirs = hsdp.full_state_dict(materialised.module), hsdp.full_state_dict(by_hand)
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)

    tp = L.Fabric(accelerator="cpu", strategy=HSDPFabricStrategy(sharding_degree=1, tensor_parallel_degree=2))
    tp.launch()
    assert tp.strategy.distributed_sampler_kwargs == {"num_replicas": 2, "rank": rank // 2}
    from lightning.fabric.strategies.model_parallel import _setup_device_mesh

    lightning_mesh = _setup_device_mesh(2, 2, WORLD, torch.device("cpu"))
    with pytest.raises(ValueError, match="sharding_degree=S"):
        HSDPStrategy(device_mesh=lightning_mesh)


# -- Trainer -----------------------------------------------------------------------------------------------
class LitGPT(L.LightningModule):
    """The step calls ``self(...)``: under HSDPStrategy a call of the root inside the step (run as its forward)."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self.model = _gpt(seed)
        self.losses: list[torch.Tensor] = []
        self.norms: list[torch.Tensor] = []
        self.stats: list[dict] = []

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.model(x, y)[1]

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self(*batch)
        self.losses.append(loss.detach().clone())
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self(*batch), sync_dist=True)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if hasattr(self, "reset_comm_stats"):  # a ShardedModel (not the one-device reference)
            self.reset_comm_stats()

    def on_after_backward(self) -> None:
        if hasattr(self, "comm_stats"):
            self.stats.append(self.comm_stats())

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        norm = torch.nn.utils.get_total_norm([p.grad for p in self.parameters() if p.grad is not None])
        self.norms.append(norm.full_tensor() if hasattr(norm, "full_tensor") else norm.detach())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return _optimizer(self.parameters())


def _trainer(strategy: Any, root: str, **kwargs: Any) -> L.Trainer:
    return L.Trainer(accelerator="cpu", strategy=strategy, max_epochs=2, accumulate_grad_batches=ACC,
                     gradient_clip_val=CLIP, default_root_dir=root, num_sanity_val_steps=0, **QUIET, **kwargs)


def _trainer_checks(rank: int, tmp: str, fabric_gathers: int, fabric_hops: tuple) -> dict[str, torch.Tensor]:
    from lightning.pytorch.callbacks import ModelCheckpoint
    from safetensors.torch import load_file

    data = _dataset(SAMPLES // 2)
    # The Trainer shuffles training data (DistributedSampler(shuffle=True), seed 0): the global batch of each
    # step is the next PER_RANK x WORLD indices of the permutation one replica's sampler draws for the epoch.
    ref = LitGPT()
    one_replica = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)
    _trainer("auto", tmp, devices=1, enable_checkpointing=False).fit(
        ref, DataLoader(data, batch_size=PER_RANK * WORLD, sampler=one_replica))

    lit = LitGPT()
    ckpt_dir = os.path.join(tmp, "trainer")
    saver = ModelCheckpoint(dirpath=ckpt_dir, filename="{epoch}", save_top_k=-1, every_n_epochs=1)
    trainer = _trainer(HSDPStrategy(sharding_degree=2), tmp, callbacks=[saver])
    trainer.fit(lit, DataLoader(data, batch_size=PER_RANK))
    assert trainer.strategy.launcher is None and trainer.world_size == WORLD and trainer.global_rank == rank
    assert isinstance(lit, hsdp.ShardedModel) and isinstance(trainer.optimizers[0], hsdp.ShardedOptimizer)
    mean = trainer.strategy.reduce(torch.stack(lit.losses), reduce_op="mean")
    _close(mean, torch.stack(ref.losses))
    _close(torch.stack(lit.norms), torch.stack(ref.norms))
    full = hsdp.full_state_dict(lit)
    # A second stage on the same Trainer: the same mesh and wrapped module, the step redirected under no_grad.
    val = trainer.validate(lit, DataLoader(data, batch_size=PER_RANK), verbose=False)[0]["val_loss"]
    ref_val = L.Trainer(accelerator="cpu", devices=1, **QUIET).validate(
        ref, DataLoader(data, batch_size=PER_RANK * WORLD), verbose=False)[0]["val_loss"]
    _close(torch.tensor(val), torch.tensor(ref_val))
    hops = [_hops(s) for s in lit.stats]
    assert all(h[:2] == (0, 0) and h[2] > 0 for h in hops[0::2]), hops
    assert all(h == fabric_hops for h in hops[1::2]), (hops, fabric_hops)  # the same model's one crossing
    assert all(_gathers(s) == fabric_gathers for s in lit.stats), ([_gathers(s) for s in lit.stats], fabric_gathers)

    resumed = LitGPT(seed=1)
    again = _trainer(HSDPStrategy(sharding_degree=2), tmp, enable_checkpointing=False)
    again.fit(resumed, DataLoader(data, batch_size=PER_RANK), ckpt_path=os.path.join(ckpt_dir, "epoch=0.ckpt"))
    assert again.global_step == trainer.global_step == 4 and again.current_epoch == 2
    _close(torch.stack(resumed.losses), torch.stack(lit.losses[2 * ACC:]), tol=1e-6)
    full_resumed = hsdp.full_state_dict(resumed)
    if rank == 0:
        for name, value in ref.state_dict().items():
            _close(full[name], value, what=name)
            _close(full_resumed[name], full[name], tol=1e-6, what=name)
        out = Path(tmp) / "export" / "model.safetensors"
        hsdp.export_safetensors(os.path.join(ckpt_dir, "epoch=1.ckpt"), out)
        plain = LitGPT(seed=2)
        plain.load_state_dict(load_file(out))  # strict: every key, tied ones included
        for name, value in plain.state_dict().items():
            assert torch.equal(value, full[name]), name
    return ref.state_dict()


class MeshProbe(LitGPT):
    """Records the ``device_mesh`` the strategy hands to ``configure_model``."""

    def configure_model(self) -> None:
        self.seen_mesh = ("set", self.device_mesh)


def _heterogeneous_checks(rank: int, tmp: str, ref_state: dict[str, torch.Tensor]) -> None:
    """Nodes of 3 and 1 ranks (torchrun's LOCAL_WORLD_SIZE per node) and no degree: the Trainer's strategy builds
    a heterogeneous mesh [3, 1], hands the LightningModule device_mesh=None (no grid), and trains as one process
    does (the sampler by data-parallel rank: the grid's global batches). A module wrapped on another
    heterogeneous mesh is refused (both meshes have device_mesh None: comparing those passed)."""
    os.environ.update(LOCAL_WORLD_SIZE=str((3, 3, 3, 1)[rank]), LOCAL_RANK=str((0, 1, 2, 0)[rank]))
    try:
        lit = MeshProbe()
        trainer = _trainer(HSDPStrategy(), tmp, enable_checkpointing=False)
        trainer.fit(lit, DataLoader(_dataset(SAMPLES // 2), batch_size=PER_RANK))
        mesh = trainer.strategy.mesh
        assert mesh.heterogeneous and mesh.replicas.degrees == (3, 1) and lit.seen_mesh == ("set", None)
        full = hsdp.full_state_dict(lit)
        if rank == 0:
            for name, value in ref_state.items():
                _close(full[name], value, what=name)
        elsewhere = hsdp.ShardedModel(LitGPT(), mesh=hsdp.init_mesh(fault_policy=None))  # another [3, 1] mesh
        with pytest.raises(ValueError, match="already a ShardedModel on another mesh"):
            _trainer(HSDPStrategy(), tmp, enable_checkpointing=False).fit(
                elsewhere, DataLoader(_dataset(SAMPLES // 2), batch_size=PER_RANK))
    finally:
        os.environ.update(LOCAL_WORLD_SIZE="2", LOCAL_RANK=str(rank % 2))


def _everything(rank: int, world: int, tmp: str) -> None:
    fabric = _fabric_checks(rank, tmp)
    _bf16_and_sampler_checks(rank)
    ref_state = _trainer_checks(rank, tmp, fabric["gathers"], fabric["hops"])
    _heterogeneous_checks(rank, tmp, ref_state)


def test_lightning_fabric_and_trainer_match_one_process(tmp_path: Path) -> None:
    run_distributed(_everything, WORLD, str(tmp_path), env={"LOCAL_WORLD_SIZE": "2"}, timeout=300)


# -- bad input, no processes needed ---------------------------------------------------------------------------
@pytest.mark.parametrize("precision", ["16-true", "bf16-true", "64-true"])  # 16-mixed: bf16-mixed on CPUs
def test_unsupported_precision_is_refused_naming_the_fix(precision: str) -> None:
    with pytest.raises(ValueError, match="bf16-mixed"):
        L.Trainer(accelerator="cpu", strategy=HSDPStrategy(), precision=precision, **QUIET)
    with pytest.raises(ValueError, match="bf16-mixed"):
        L.Fabric(accelerator="cpu", strategy=HSDPFabricStrategy(), precision=precision)


def test_supported_precisions_map_to_hsdp_policies() -> None:
    for precision, policy in (("32-true", None), ("bf16-mixed", BF16_MIXED)):
        trainer = L.Trainer(accelerator="cpu", strategy=HSDPStrategy(), precision=precision, **QUIET)
        assert trainer.strategy.precision_plugin.policy == policy
        fabric = L.Fabric(accelerator="cpu", strategy=HSDPFabricStrategy(), precision=precision)
        assert fabric.strategy.precision.policy == policy
    explicit = hsdp.MixedPrecision(param_dtype=torch.float64)  # an explicit policy wins over the flag
    strategy = HSDPStrategy(mixed_precision=explicit)
    assert strategy._policy(strategy.precision_plugin) is explicit


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"sharding_degree": 0}, "positive int"),
    ({"sharding_degree": "2"}, "positive int"),
    ({"tensor_parallel_degree": 1.5}, "positive int"),
    ({"mixed_precision": torch.bfloat16}, "hsdp.MixedPrecision"),
    ({"replica_hop": "bf16"}, "AllReduceHop"),
    ({"device_mesh": "mesh"}, "DeviceMesh"),
])
def test_bad_strategy_arguments_are_refused_naming_the_fix(kwargs: dict, match: str) -> None:
    for strategy in (HSDPStrategy, HSDPFabricStrategy):
        with pytest.raises(ValueError, match=match):
            strategy(**kwargs)


def test_each_framework_names_its_own_strategy() -> None:
    with pytest.raises(ValueError, match="HSDPFabricStrategy"):
        L.Fabric(accelerator="cpu", strategy=HSDPStrategy())


def test_without_torchrun_the_strategy_names_the_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    fabric = L.Fabric(accelerator="cpu", strategy=HSDPFabricStrategy())
    with pytest.raises(ValueError, match="torchrun --nproc-per-node"):
        fabric.launch()
