"""Ordinary PyTorch code written for a plain model gives the plain model's results on a ShardedModel.

Every case compares against one plain process on the same global batch: torch's own clip_grad_norm_,
parameter counts, a parent module's state_dict (saved with torch.save and loaded back, full or sharded),
torch.distributed.checkpoint.state_dict's get/set_state_dict, and a Hugging Face model's num_parameters.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable

import torch
from harness import run_distributed
from models import Block, ParityNet, batch, global_batch, loss_fn
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map

import hsdp

STEPS = 3


class Parent(nn.Module):
    """An unwrapped parent holding a wrapped child (HF's ``PreTrainedModel.model``, Lightning's module)."""

    def __init__(self, child: nn.Module) -> None:
        super().__init__()
        self.child = child
        self.bias = nn.Parameter(torch.zeros(3))


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert list(a) == list(b)
    return max((_full(a[k]).double() - _full(b[k]).double()).abs().max().item() for k in a)


def _train_pair(rank: int, world: int, make: Callable[[], nn.Module], *,
                before: Callable[[int, nn.Module, nn.Module], None] | None = None,
                clip: Callable[[int, nn.Module], torch.Tensor] | None = None,
                norm_type: float = 2.0) -> tuple[nn.Module, nn.Module, float]:
    """The same model (same seed) trained STEPS AdamW steps in one plain process on the global batch and
    wrapped on a 2x2 mesh. ``before(step, ref, model)`` runs first in a step; ``clip(step, model)`` clips
    the wrapped model's gradients while the reference uses torch's clip_grad_norm_. Returns (reference,
    wrapped model, worst relative error of the clipping norm)."""
    torch.manual_seed(0)
    ref = make()
    torch.manual_seed(0)
    model = hsdp.ShardedModel(make(), mesh=hsdp.init_mesh(2))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = hsdp.ShardedOptimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    norm_err = 0.0
    for step in range(STEPS):
        if before is not None:
            before(step, ref, model)
        x, y = global_batch(step, world)
        loss_fn(ref(x), y).backward()
        xb, yb = batch(step, rank)
        loss_fn(model(xb), yb).backward()
        if clip is not None:
            ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05, norm_type=norm_type)
            norm = _full(clip(step, model))
            norm_err = max(norm_err, abs(norm.item() - ref_norm.item()) / ref_norm.item())
        for o in (ref_opt, opt):
            o.step()
            o.zero_grad()
    return ref, model, norm_err


def _param_diff(ref: nn.Module, model: nn.Module) -> float:
    return _max_diff(dict(model.named_parameters()), dict(ref.named_parameters()))


def _clip_training(rank: int, world: int, norm_type: float) -> dict:
    """AdamW steps clipped by torch.nn.utils.clip_grad_norm_ on hsdp and on one plain process."""
    ref, model, norm_err = _train_pair(
        rank, world, ParityNet, norm_type=norm_type,
        clip=lambda step, m: torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05, norm_type=norm_type))
    return {"norm_rel_err": norm_err, "param_diff": _param_diff(ref, model)}


class MixedBlock(nn.Module):
    """A float64 linear with a float32 norm in one unit (as a bf16 block keeps its norms in fp32)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 17).double()
        self.norm = nn.LayerNorm(17)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(torch.tanh(self.lin(x.double())).float())


class MixedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(17, 16)
        self.blocks = nn.ModuleList([MixedBlock(), MixedBlock()])
        self.proj = nn.ModuleList([nn.Linear(17, 16), nn.Linear(17, 16)])
        self.head = nn.Linear(16, 17).double()  # the root unit mixes dtypes too

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block, proj in zip(self.blocks, self.proj, strict=True):
            x = x + proj(block(x))
        return self.head(x.double()).float()


def _mixed_dtypes(rank: int, world: int) -> dict:
    """A unit whose parameters mix dtypes trains like the plain model."""
    ref, model, _ = _train_pair(rank, world, MixedNet)
    dtypes = {p.dtype for p in model.parameters()}
    return {"diff": _param_diff(ref, model), "units": [u.key for u in model.units],
            "dtypes_kept": dtypes == {torch.float32, torch.float64}}


def _wrap_forms(rank: int, world: int) -> dict[str, list[str]]:
    """``wrap=`` as accelerate (class names), Lightning (a set of classes) and FSDP2 users pass it."""
    mesh = hsdp.init_mesh(2)
    forms = {"class": Block, "list": [Block], "set": {Block}, "names": ["Block"], "name": "Block",
             "callable": lambda m: isinstance(m, Block)}
    return {k: [u.key for u in hsdp.ShardedModel(ParityNet(), mesh=mesh, wrap=w).units] for k, w in forms.items()}


class GatedBlock(Block):
    def __init__(self) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.tensor(0.3))  # 0-d, inside a unit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.alpha * (super().forward(x) - x)


class ScaledNet(ParityNet):
    """CLIP-style 0-d parameters: a logit scale in the root unit and a gate in every block unit."""

    def __init__(self) -> None:
        super().__init__()
        self.logit_scale = nn.Parameter(torch.tensor(0.7))
        self.blocks = nn.ModuleList([GatedBlock() for _ in range(3)])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) * self.logit_scale.exp()


class TitanNet(ParityNet):
    """torchtitan's layout: the blocks in an ``nn.ModuleDict`` keyed "0", "1", ..."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleDict({str(i): Block() for i in range(3)})  # type: ignore[assignment]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks.values():
            x = block(x)
        x = self.twice(torch.tanh(self.twice(self.frozen(x))))
        return self.head(self.norm(x) * self.scale)


def _default_units(rank: int, world: int) -> dict:
    """A ModuleDict of blocks is a repeated stack (each block a unit, training equal to one process); a sizeable
    model whose default leaves one unit holding most parameters warns, naming wrap=."""
    import warnings

    ref, model, _ = _train_pair(rank, world, TitanNet)
    out: dict = {"titan_units": [u.key for u in model.units], "titan_diff": _param_diff(ref, model)}
    mesh = hsdp.init_mesh(2)
    big = (lambda: nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 512)),  # no stack: warns
           lambda: Parent(nn.ModuleDict({str(i): nn.Linear(512, 512) for i in range(4)})))  # 4 units of 25%
    for name, make, wrap in (("unstacked", big[0], None), ("wrapped", big[0], nn.Linear), ("stacked", big[1], None)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            hsdp.ShardedModel(make(), mesh=mesh, wrap=wrap)
        out[name] = [str(w.message) for w in caught if "default units" in str(w.message)]
    return out


def _zero_dim(rank: int, world: int, tmp: str) -> dict:
    """0-d parameters train like the plain model (clipped by torch's util and hsdp's, alternately) and
    survive a checkpoint."""
    ref, model, norm_err = _train_pair(
        rank, world, ScaledNet,
        clip=lambda step, m: hsdp.clip_grad_norm_(m, 0.05) if step % 2 else torch.nn.utils.clip_grad_norm_(
            m.parameters(), 0.05))
    diff = _param_diff(ref, model)
    opt = hsdp.ShardedOptimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    loss_fn(model(batch(0, rank)[0]), batch(0, rank)[1]).backward()
    opt.step()  # optimizer state to checkpoint
    hsdp.save_checkpoint(tmp, model, opt)
    saved = {k: _full(v).clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model.logit_scale.fill_(5.0)
    hsdp.load_checkpoint(tmp, model, opt)
    # Every parameter lives on its replica's own shard mesh (the replicas are hsdp's, not a DTensor dim).
    meshes = {(p.device_mesh.mesh_dim_names, tuple(p.device_mesh.mesh.tolist())) for p in model.parameters()}
    return {"diff": diff, "norm_err": norm_err, "placements": str(model.logit_scale.placements),
            "restored": _max_diff(model.state_dict(), saved), "meshes": sorted(meshes), "rank": rank}


def _freeze_unfreeze(rank: int, world: int) -> float:
    """requires_grad_ changed between steps on the wrapped model acts as on a plain one."""

    def freeze_some(step: int, ref: nn.Module, model: nn.Module) -> None:
        if step == 1:
            for m in (ref, model):
                m.blocks[0].up.requires_grad_(False)
                m.frozen.requires_grad_(True)

    return _param_diff(*_train_pair(rank, world, ParityNet, before=freeze_some)[:2])


def _counts_and_state_dicts(rank: int, world: int, tmp: str) -> dict:
    out: dict = {}
    torch.manual_seed(0)
    plain_parent = Parent(ParityNet())
    plain_sd = {k: v.clone() for k, v in plain_parent.state_dict().items()}
    torch.manual_seed(0)
    parent = Parent(hsdp.ShardedModel(ParityNet(), mesh=hsdp.init_mesh(2)))
    count = sum(p.numel() for p in parent.parameters())
    out["numel"] = (count, sum(p.numel() for p in plain_parent.parameters()))
    out["trainable"] = (sum(p.numel() for p in parent.parameters() if p.requires_grad),
                        sum(p.numel() for p in plain_parent.parameters() if p.requires_grad))
    # A parent's state_dict: original keys and shapes; the child's entries are DTensors of the full tensor.
    sd = parent.state_dict()
    out["keys_equal"] = list(sd) == list(plain_sd)
    out["shapes_equal"] = all(tuple(sd[k].shape) == tuple(v.shape) for k, v in plain_sd.items())
    out["child_dtensor"] = isinstance(sd["child.blocks.0.up.weight"], DTensor)
    out["sd_diff"] = _max_diff(sd, plain_sd)
    # torch.save of every rank's state dict keeps the global view (a DTensor pickles its placement).
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    out["saved_shapes"] = tuple(torch.load(buf, weights_only=False)["child.blocks.0.up.weight"].shape)
    # Loading through the parent: full tensors (a plain checkpoint) and DTensors (a sharded one). State dict
    # values alias the parameters, as in plain torch: keep a copy before zeroing them.
    sd = {k: v.clone() for k, v in sd.items()}
    with torch.no_grad():
        for p in parent.parameters():
            p.zero_()
    parent.load_state_dict(plain_sd)
    out["load_full_diff"] = _max_diff(parent.state_dict(), plain_sd)
    with torch.no_grad():
        for p in parent.parameters():
            p.zero_()
    parent.load_state_dict(sd)
    out["load_sharded_diff"] = _max_diff(parent.state_dict(), plain_sd)
    out.update(_dcp_state_dict_helpers(rank, world, parent, plain_parent))
    return out


def _dcp_state_dict_helpers(rank: int, world: int, parent: nn.Module, plain_parent: nn.Module) -> dict:
    """get_state_dict / set_state_dict (torch.distributed.checkpoint.state_dict), FSDP2 users' entry point."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    opt = torch.optim.AdamW(parent.parameters(), lr=1e-2)
    x, y = batch(0, rank)
    (loss_fn(parent.child(x), y) + parent.bias.square().sum()).backward()
    opt.step()
    model_sd, optim_sd = tree_map(_clone, get_state_dict(parent, opt))  # copies: values alias the live state
    full_sd, _ = get_state_dict(parent, opt, options=StateDictOptions(full_state_dict=True))
    out = {"gsd_keys_equal": list(model_sd) == list(plain_parent.state_dict()),
           "gsd_full_plain": not any(isinstance(v, DTensor) for v in full_sd.values()),
           "gsd_full_shapes": all(tuple(full_sd[k].shape) == tuple(v.shape)
                                  for k, v in plain_parent.state_dict().items())}
    expected = {k: _full(v).clone() for k, v in model_sd.items()}
    exp_avg = _full(optim_sd["state"]["child.blocks.0.up.weight"]["exp_avg"]).clone()
    with torch.no_grad():
        for p in parent.parameters():
            p.zero_()
    for s in opt.state.values():
        s["exp_avg"].zero_()
    # strict=False: ParityNet's never-used parameter has no AdamW state (the same on a plain model).
    set_state_dict(parent, opt, model_state_dict=model_sd, optim_state_dict=optim_sd,
                   options=StateDictOptions(strict=False))
    out["ssd_model_diff"] = _max_diff(parent.state_dict(), expected)
    after = _full(opt.state_dict()["state"][_index_of(parent, opt, "child.blocks.0.up.weight")]["exp_avg"])
    out["ssd_optim_diff"] = (after - exp_avg).abs().max().item()
    return out


def _clone(x: object) -> object:
    return x.clone() if isinstance(x, torch.Tensor) else x


def _index_of(module: nn.Module, opt: torch.optim.Optimizer, name: str) -> int:
    target = dict(module.named_parameters())[name]
    return next(i for i, p in enumerate(opt.param_groups[0]["params"]) if p is target)


def _hf_counts(rank: int, world: int) -> dict:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=37, n_positions=16, n_embd=16, n_layer=2, n_head=2)
    torch.manual_seed(0)
    plain = GPT2LMHeadModel(config)
    torch.manual_seed(0)
    model = hsdp.ShardedModel(GPT2LMHeadModel(config), mesh=hsdp.init_mesh(2))
    return {"hf": (model.num_parameters(), plain.num_parameters()),
            "hf_trainable": (model.num_parameters(only_trainable=True), plain.num_parameters(only_trainable=True))}


def _pickled_on_one_rank(rank: int, world: int, tmp: str) -> dict:
    """rank 0 torch.saves its state dicts, every rank loads them (the generic framework save paths): the ranks
    holding other rows refuse with the fix, nothing changes; a rank's own file, or another replica's file of the
    same shard, loads exactly."""
    import torch.distributed as dist

    torch.manual_seed(0)
    model = hsdp.ShardedModel(ParityNet(), mesh=hsdp.init_mesh(2))
    opt = hsdp.ShardedOptimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    x, y = batch(0, rank)
    loss_fn(model(x), y).backward()
    opt.step()
    if rank == 0:
        torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, f"{tmp}/rank0.pt")
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, f"{tmp}/own_{rank}.pt")
    dist.barrier()
    before = {k: _full(v).clone() for k, v in model.state_dict().items()}
    from_rank0 = torch.load(f"{tmp}/rank0.pt", weights_only=False)
    out: dict = {"shard_rank": model.mesh.shard_rank}
    for what, target in (("model", model), ("optim", opt)):
        try:
            target.load_state_dict(from_rank0[what])
            out[f"{what}_error"] = None
        except ValueError as e:
            out[f"{what}_error"] = str(e)
    out["unchanged"] = _max_diff(model.state_dict(), before)
    own = torch.load(f"{tmp}/own_{rank}.pt", weights_only=True)  # DTensors load with weights_only too
    model.load_state_dict(own["model"])
    opt.load_state_dict(own["optim"])
    out["own_diff"] = _max_diff(model.state_dict(), before)
    return out


def _all_cases(rank: int, world: int, tmp: str) -> dict:
    return {"clip_2": _clip_training(rank, world, 2.0), "clip_inf": _clip_training(rank, world, math.inf),
            "freeze_diff": _freeze_unfreeze(rank, world), "mixed": _mixed_dtypes(rank, world),
            "wrap": _wrap_forms(rank, world), "zero_dim": _zero_dim(rank, world, f"{tmp}/ckpt"),
            **_counts_and_state_dicts(rank, world, tmp), **_hf_counts(rank, world),
            "pickled": _pickled_on_one_rank(rank, world, tmp), "units": _default_units(rank, world)}


def test_ordinary_pytorch_code_matches_a_plain_process(tmp_path: object) -> None:
    for r in run_distributed(_all_cases, 4, str(tmp_path)):
        for kind in ("clip_2", "clip_inf"):
            assert r[kind]["norm_rel_err"] < 1e-5, (kind, r[kind])
            assert r[kind]["param_diff"] < 1e-5, (kind, r[kind])
        assert r["freeze_diff"] < 1e-5, r["freeze_diff"]
        z = r["zero_dim"]
        assert z["diff"] < 1e-5 and z["norm_err"] < 1e-5 and z["restored"] == 0.0, z
        assert "Shard" not in z["placements"], z  # replicated in the shard group too
        first = 2 * (z["rank"] // 2)  # world 4, sharding degree 2: replica r is ranks 2r, 2r+1
        assert z["meshes"] == [(("shard",), (first, first + 1))], z
        for form, keys in r["wrap"].items():
            assert keys == ["", "blocks.0", "blocks.1", "blocks.2"], (form, keys)
        assert r["mixed"]["diff"] < 1e-5 and r["mixed"]["dtypes_kept"], r["mixed"]
        assert r["mixed"]["units"] == ["", "[float64]", "blocks.0", "blocks.0[float32]", "blocks.1",
                                       "blocks.1[float32]", "proj.0", "proj.1"], r["mixed"]
        for key in ("numel", "trainable", "hf", "hf_trainable"):
            assert r[key][0] == r[key][1], (key, r[key])
        assert r["keys_equal"] and r["shapes_equal"] and r["child_dtensor"], r
        assert r["sd_diff"] == 0.0 and r["load_full_diff"] == 0.0 and r["load_sharded_diff"] == 0.0, r
        assert r["saved_shapes"] == (17, 16), r
        assert r["gsd_keys_equal"] and r["gsd_full_plain"] and r["gsd_full_shapes"], r
        u = r["units"]
        assert u["titan_units"] == ["", "blocks.0", "blocks.1", "blocks.2"] and u["titan_diff"] < 1e-5, u
        assert len(u["unstacked"]) == 1 and "100% of the parameters" in u["unstacked"][0], u
        assert "wrap=" in u["unstacked"][0] and u["wrapped"] == [] and u["stacked"] == [], u
        pk = r["pickled"]
        assert pk["unchanged"] == 0.0 and pk["own_diff"] == 0.0, pk
        if pk["shard_rank"] == 0:  # rank 0 itself, and rank 2: the same rows in the other replica
            assert pk["model_error"] is None and pk["optim_error"] is None, pk
        else:
            for what in ("model", "optim"):
                assert "holds the chunk of rank 0" in pk[f"{what}_error"], pk
                assert "hsdp.save_checkpoint" in pk[f"{what}_error"], pk
        assert r["ssd_model_diff"] == 0.0 and r["ssd_optim_diff"] == 0.0, r
