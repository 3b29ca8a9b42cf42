"""``hsdp plan``: the cost model of :mod:`hsdp.tools.planner` from the command line (the arguments, the
cluster and model they describe, the output). Imports neither torch nor torch.distributed."""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

from hsdp.apps.cli.helptext import RATE_UNITS, HelpFormatter
from hsdp.tools.planner.cluster import ClusterSpec
from hsdp.tools.planner.diloco import WIRE_BYTES, DiLoCoEstimate, DiLoCoOptions, diloco_estimates
from hsdp.tools.planner.goodput_plan import RecoveryTimes, goodput_title, layout_goodput, print_goodput
from hsdp.tools.planner.hetero import NODES_SPELLING, HeteroPlan, is_node_list, make_hetero_plan, parse_node_groups
from hsdp.tools.planner.model import ComputeProfile, ModelSpec, TransformerShape, transformer
from hsdp.tools.planner.options import PRECISIONS, REPLICATE_DTYPES, SYNC_MODES, TrainOptions, precision
from hsdp.tools.planner.plan import DEFAULT_HEADROOM, SHARD_OPTIMIZER_MODES, Plan, make_plan
from hsdp.tools.planner.presets import (
    INTER_LINKS,
    INTRA_LINKS,
    OPTIMIZER_BYTES_PER_ELEMENT,
    gpu,
    gpu_names,
    inter_link,
    intra_link,
    link_or_rate,
    model_preset,
)
from hsdp.tools.quantities import parse_bytes, parse_duration, parse_flops

DEFAULT_MFU = 0.45
DEFAULT_GPUS_PER_NODE = 8

PLAN_EPILOG = f"""\
examples:
  hsdp plan --model 7b --nodes 16 --gpus-per-node 8 --gpu-memory 80GiB \\
            --intra-node-bandwidth 450GB/s --inter-node-bandwidth 50GB/s
  hsdp plan --model 70b --nodes 64 --gpus-per-node 8 --gpu h100 --inter-node-bandwidth 8xib400 \\
            --precision bf16 --micro-batches 8 --plot plan.png --json plan.json
  hsdp plan --model 7b --nodes 4 --inter-node-bandwidth 10Gbit/s --diloco-every 40 --diloco-wire-dtype bf16
            plus each layout under DiLoCo (weights synced every 40 steps, not DDP's math): inner, sync and mean
            step, inter-node bytes per sync and per step, next to plain HSDP's
  hsdp plan --model 7b --nodes 2x8:h100,2x8:a100-40gb --micro-batch 4 --activation-checkpointing
            a heterogeneous cluster: per node type the shard degree by memory, batch weights by speed,
            tokens/s weighted vs even, and the init_mesh / distributed_sampler / hsdp train lines to paste

--nodes: a node count (with --gpus-per-node and --gpu), or node types COUNTxGPUS:GPU, comma separated, in
rank order: 2x8:h100,2x8:a100-40gb (2 nodes of 8 H100, then 2 of 8 A100 40GB); 4x8:h100,1x4 (the 4-GPU
node takes --gpu); 1x8:a40 is the same cluster as --nodes 1 --gpus-per-node 8 --gpu a40.
GPUs: {", ".join(gpu_names())}
intra-node links: {", ".join(sorted(INTRA_LINKS))} (or a rate: 450GB/s)
inter-node links (per NIC; 8xib400 = eight per node): {", ".join(sorted(INTER_LINKS))} (or a rate per node)
models: 125m 350m 1.3b 7b 13b 70b and the hsdp.models GPT presets (gpt2-124m, small, bench, ...)
"""


# --node-mtbf's companions: (flag, default, what it is), read into goodput_plan.RecoveryTimes.
_RECOVERY_FLAGS = (("--restart-time", "10min", "a restart of the whole job from its last checkpoint"),
                   ("--checkpoint-every", "Young's interval for the save time", "training time between checkpoints"),
                   ("--checkpoint-save", "30s", "how long a checkpoint save blocks training"),
                   ("--rejoin-time", "2min", "an elastic replica's restart and heal, until it trains again"),
                   ("--recovery-stall", "3s", "the survivors' pause when an elastic replica fails"))


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--precision", default="bf16", choices=sorted(PRECISIONS), help="bytes per copy")
    p.add_argument("--micro-batches", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--no-reshard-after-forward", action="store_true",
                   help="keep units gathered from forward to backward (one all-gather less, more memory)")
    p.add_argument("--inter-node-dtype", default="same", choices=REPLICATE_DTYPES,
                   help="dtype of the inter-node gradient hop (default: the reduce dtype)")
    p.add_argument("--sync", default="deferred", choices=SYNC_MODES,
                   help="micro-batch sync: deferred = inter-node once per step (default)")
    p.add_argument("--activation-checkpointing", action="store_true", help="recompute each block in backward")
    p.add_argument("--shard-optimizer-across-replicas", default="auto", choices=SHARD_OPTIMIZER_MODES,
                   help="gradients and optimizer state over all R x S ranks (ShardedModel's "
                        "shard_optimizer_across_replicas); auto: used where it lets a faster layout fit")


def add_plan(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``plan`` on ``subparsers``."""
    p = subparsers.add_parser("plan", help="predict memory and step time of every shard degree; recommend one",
                              description="Estimate every (replicate, shard, tensor parallel) layout of a cluster "
                                          "and recommend the fastest that fits, with reasons (layouts within 1% "
                                          "are tied; ties go to the least inter-node traffic).",
                              epilog=PLAN_EPILOG, formatter_class=HelpFormatter)
    p.add_argument("--model", default=None, help="a model size or preset, e.g. 7b, 70b, gpt2-124m")
    p.add_argument("--layers", type=int, default=None, help="a custom decoder instead: blocks (with --hidden)")
    p.add_argument("--hidden", type=int, default=None, help="custom decoder: hidden size")
    p.add_argument("--heads", type=int, default=None, help="custom decoder: attention heads (default hidden/128)")
    p.add_argument("--vocab", type=int, default=32000, help="custom decoder: vocabulary")
    p.add_argument("--ffn", type=int, default=None, help="custom decoder: gated (SwiGLU) MLP width (default: "
                                                          "a 4x GELU MLP)")
    p.add_argument("--metrics", default=None, help="take the model's units and a measured compute profile from "
                                                    "a metrics file (hsdp.tools.planner.metrics)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: the preset's)")
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per GPU per micro-batch")
    p.add_argument("--nodes", required=True,
                   help="nodes in the cluster (16), or node types in rank order: 2x8:h100,2x8:a100-40gb")
    p.add_argument("--gpus-per-node", type=int, default=None, help="GPUs (ranks) per node (default: 8)")
    p.add_argument("--gpu", default="h100", help="GPU preset for memory, compute and NVLink (with node types: "
                                                 "for a type written without one)")
    p.add_argument("--gpu-memory", default=None, help="memory per GPU with its unit, e.g. 80GiB (default: the GPU's)")
    p.add_argument("--compute", default=None, help="achieved FLOP/s per GPU, e.g. 400TFLOPS (default: peak x mfu)")
    p.add_argument("--mfu", type=float, default=DEFAULT_MFU, help="achieved fraction of peak")
    p.add_argument("--intra-node-bandwidth", default=None,
                   help=f"per GPU: a link preset (nvlink4) or a rate, {RATE_UNITS} (default: the GPU's link)")
    p.add_argument("--inter-node-bandwidth", default="ib400",
                   help=f"per node: a link preset (ib400, 8xib400 = eight NICs) or a rate, {RATE_UNITS}")
    p.add_argument("--intra-node-latency", default=None, help="per ring step, e.g. 3us (default: the link's)")
    p.add_argument("--inter-node-latency", default=None, help="per ring step, e.g. 5us (default: the link's)")
    add_model_arguments(p)
    p.add_argument("--headroom", type=float, default=DEFAULT_HEADROOM, help="memory kept free")
    p.add_argument("--degrees", default=None, help="comma list of shard degrees (default: every divisor)")
    p.add_argument("--tp", default="1",
                   help="tensor parallel degree T: a number forces it (default 1: no tensor parallelism); auto "
                        "considers every divisor of --gpus-per-node, with S x T inside a node or spanning whole "
                        "nodes, and picks T with S")
    p.add_argument("--diloco-every", type=int, default=None, metavar="H",
                   help="also estimate each layout under DiLoCo (ShardedModel(replica_sync=hsdp.DiLoCo(every=H))): "
                        "no per-step inter-node hop, the weights all-reduced every H steps; not DDP's math")
    p.add_argument("--diloco-wire-dtype", default="fp32", choices=sorted(WIRE_BYTES),
                   help="with --diloco-every: the dtype of the sync's pseudo-gradients (bf16: half the "
                        "bytes; int8: error feedback, about a quarter with 2 replicas)")
    p.add_argument("--diloco-fragments", type=int, default=1, metavar="F",
                   help="with --diloco-every: Streaming DiLoCo, the model synced in F fragments at staggered steps")
    p.add_argument("--diloco-delay", type=int, default=0, metavar="TAU",
                   help="with --diloco-every: inner steps a fragment's all-reduce runs behind before it lands")
    p.add_argument("--node-mtbf", default=None, metavar="DURATION",
                   help="mean time between failures of one node, e.g. 6000h: adds each layout's goodput (the "
                        "fraction of wall time that trains) restarting from checkpoints, with elastic replicas and "
                        "with elastic DiLoCo")
    for flag, default, what in _RECOVERY_FLAGS:
        p.add_argument(flag, default=None, metavar="DURATION", help=f"with --node-mtbf: {what} (default {default})")
    p.add_argument("--plot", metavar="FILE", help="write memory and step time against shard degree (PNG)")
    p.add_argument("--json", metavar="FILE", help="write the plan as JSON ('-': stdout, no table)")
    p.set_defaults(func=run_plan)
    return p


def node_count(args: argparse.Namespace) -> int:
    """``--nodes`` as a count (the uniform spelling); ``ValueError`` naming both spellings otherwise."""
    try:
        return int(args.nodes)
    except ValueError:
        raise ValueError(f"--nodes {args.nodes!r}: give a node count (16) or node types ({NODES_SPELLING})"
                         ) from None


def gpus_per_node(args: argparse.Namespace) -> int:
    return DEFAULT_GPUS_PER_NODE if args.gpus_per_node is None else args.gpus_per_node


def cluster_from_args(args: argparse.Namespace) -> ClusterSpec:
    g = gpu(args.gpu)
    intra_bw, intra_lat = link_or_rate(args.intra_node_bandwidth or g.intra_link, intra_link)
    inter_bw, inter_lat = link_or_rate(args.inter_node_bandwidth, inter_link)
    return ClusterSpec(
        node_count(args), gpus_per_node(args), parse_bytes(args.gpu_memory) if args.gpu_memory else g.memory,
        intra_bw, inter_bw, parse_flops(args.compute) if args.compute else g.peak_flops * args.mfu,
        intra_latency=parse_duration(args.intra_node_latency) if args.intra_node_latency else (intra_lat or 3e-6),
        inter_latency=parse_duration(args.inter_node_latency) if args.inter_node_latency else (inter_lat or 10e-6),
        optimizer_s_per_element=OPTIMIZER_BYTES_PER_ELEMENT / g.hbm_bandwidth, name=args.gpu)


def options_from_args(args: argparse.Namespace) -> TrainOptions:
    return TrainOptions(precision(args.precision), args.micro_batches, not args.no_reshard_after_forward,
                        args.inter_node_dtype, args.sync, activation_checkpointing=args.activation_checkpointing)


def parse_tp(text: str, gpus_per_node: int) -> list[int]:
    """``--tp``: ``auto`` (every divisor of the ranks per node) or one degree."""
    if text == "auto":
        return [t for t in range(1, gpus_per_node + 1) if gpus_per_node % t == 0]
    try:
        return [int(text)]
    except ValueError:
        raise ValueError(f"--tp {text!r}: give auto or an integer, e.g. --tp 2") from None


def parse_degrees(text: str | None) -> list[int] | None:
    if not text:
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--degrees {text!r}: give a comma list of integers, e.g. 4,8,16") from None


def model_from_args(args: argparse.Namespace) -> tuple[ModelSpec, ComputeProfile | None]:
    """A preset, a custom decoder shape, or the units and profile of a metrics file."""
    if args.metrics:
        from hsdp.tools.planner.tune import load_metrics, spec_from_metrics

        metrics = load_metrics([args.metrics])[0]
        profile = metrics.get("profile")
        return spec_from_metrics(metrics), None if not profile else ComputeProfile(
            profile["forward_s"], profile["backward_s"], profile["optimizer_s_per_element"])
    if args.layers and args.hidden:
        heads = args.heads or max(1, args.hidden // 128)
        shape = TransformerShape(args.layers, args.hidden, heads, args.vocab, ffn=args.ffn or 0,
                                 gated=bool(args.ffn), tied=False, bias=False)
        return transformer("custom", shape, args.seq_len or 2048, args.micro_batch), None
    if args.model:
        return model_preset(args.model, args.seq_len, args.micro_batch), None
    raise ValueError("no model: pass --model (e.g. 7b), or --layers and --hidden, or --metrics FILE")


def build_plan(args: argparse.Namespace) -> Plan:
    model, profile = model_from_args(args)
    return make_plan(model, cluster_from_args(args), options_from_args(args), profile,
                     degrees=parse_degrees(args.degrees), headroom=args.headroom,
                     shard_optimizer=args.shard_optimizer_across_replicas,
                     # A metrics file has no hidden size: auto then stays at T=1, a forced T says why not.
                     tensor_parallel=parse_tp(args.tp, gpus_per_node(args)) if model.hidden or args.tp != "auto"
                     else [1])


# What a heterogeneous plan does not take: each applies to one GPU type, or to layouts it does not explore.
_NOT_WITH_NODE_TYPES = (("gpus_per_node", "--gpus-per-node (each node type says its GPUs: 2x8:h100)"),
                        ("gpu_memory", "--gpu-memory (each type's preset sets it)"),
                        ("compute", "--compute (each type's preset and --mfu set it)"),
                        ("intra_node_bandwidth", "--intra-node-bandwidth (each type's preset sets it)"),
                        ("metrics", "--metrics (a measured profile is one GPU type's: pass --model)"),
                        ("degrees", "--degrees (the shard degree of each type is chosen by memory)"),
                        ("diloco_every", "--diloco-every (DiLoCo is planned for one node type)"),
                        ("plot", "--plot"))


def build_hetero_plan(args: argparse.Namespace) -> HeteroPlan:
    """``--nodes 2x8:h100,...``: a plan per node type; ``ValueError`` for the options it does not take."""
    given = [text for name, text in _NOT_WITH_NODE_TYPES if getattr(args, name) is not None]
    if args.tp != "1":
        given.append("--tp (tensor parallelism is not planned per node type)")
    if args.shard_optimizer_across_replicas == "on":
        given.append("--shard-optimizer-across-replicas on")
    if given:
        raise ValueError(f"--nodes with node types does not take {', '.join(given)}: drop it, or plan one type with "
                         f"--nodes N --gpus-per-node G --gpu NAME")
    model, _ = model_from_args(args)
    inter_bw, inter_lat = link_or_rate(args.inter_node_bandwidth, inter_link)
    latency = parse_duration(args.inter_node_latency) if args.inter_node_latency else (inter_lat or 10e-6)
    options = replace(options_from_args(args), shard_optimizer_across_replicas=False)
    return make_hetero_plan(model, parse_node_groups(args.nodes, args.gpu), options, inter_bw, latency, args.mfu,
                            args.headroom)


def _single_type(args: argparse.Namespace) -> argparse.Namespace:
    """``--nodes 2x8:a40`` (one node type) as the uniform ``--nodes 2 --gpus-per-node 8 --gpu a40``."""
    (group,) = parse_node_groups(args.nodes, args.gpu)
    if args.gpus_per_node is not None and args.gpus_per_node != group.gpus_per_node:
        raise ValueError(f"--nodes {args.nodes} has {group.gpus_per_node} GPUs per node, --gpus-per-node says "
                         f"{args.gpus_per_node}: drop one")
    return argparse.Namespace(**{**vars(args), "nodes": str(group.count), "gpus_per_node": group.gpus_per_node,
                                 "gpu": group.gpu})


def diloco_options(args: argparse.Namespace) -> DiLoCoOptions | None:
    """The ``--diloco-*`` flags (``None`` without ``--diloco-every``; ``ValueError`` for the others alone)."""
    if args.diloco_every is None:
        given = [flag for flag, value, default in (("--diloco-wire-dtype", args.diloco_wire_dtype, "fp32"),
                                                   ("--diloco-fragments", args.diloco_fragments, 1),
                                                   ("--diloco-delay", args.diloco_delay, 0)) if value != default]
        if given:
            raise ValueError(f"{given[0]} is read only with --diloco-every H: add it, or drop {given[0]}")
        return None
    return DiLoCoOptions(args.diloco_every, args.diloco_wire_dtype, fragments=args.diloco_fragments,
                         delay=args.diloco_delay)


def build_diloco(args: argparse.Namespace, plan: Plan) -> tuple[DiLoCoEstimate, ...] | None:
    """``--diloco-every H``: the plan's layouts with R > 1 under DiLoCo (``None`` without the flag)."""
    diloco = diloco_options(args)
    if diloco is None:
        return None
    _, profile = model_from_args(args)
    return diloco_estimates(plan.layouts, plan.model, plan.cluster, plan.options, diloco, profile, plan.memory_limit)


def recovery_times(args: argparse.Namespace) -> RecoveryTimes | None:
    """The ``--node-mtbf`` flags (``None`` without it; ``ValueError`` for its companions alone)."""
    given = {flag: getattr(args, flag[2:].replace("-", "_")) for flag, _, _ in _RECOVERY_FLAGS}
    if args.node_mtbf is None:
        alone = [flag for flag, value in given.items() if value is not None]
        if alone:
            raise ValueError(f"{alone[0]} is read only with --node-mtbf DURATION: add it, or drop {alone[0]}")
        return None
    names = {"--restart-time": "restart_s", "--checkpoint-every": "checkpoint_every_s",
             "--checkpoint-save": "save_s", "--rejoin-time": "rejoin_s", "--recovery-stall": "stall_s"}
    return RecoveryTimes(parse_duration(args.node_mtbf),
                         **{names[flag]: parse_duration(v) for flag, v in given.items() if v is not None})


def run_plan(args: argparse.Namespace) -> int:
    """Execute a parsed ``hsdp plan``: 0, or 2 with the fix on bad arguments."""
    from hsdp.tools.planner.render import dump_json, print_plan

    try:
        if is_node_list(args.nodes) and len(parse_node_groups(args.nodes, args.gpu)) > 1:
            return _run_hetero(build_hetero_plan(args), args)
        if is_node_list(args.nodes):
            args = _single_type(args)
        plan = build_plan(args)
        diloco = build_diloco(args, plan)
        times = recovery_times(args)
        goodput = None if times is None else layout_goodput(plan.layouts, plan.cluster.nodes,
                                                            plan.cluster.gpus_per_node, times, diloco)
    except ValueError as e:
        print(f"hsdp plan: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        extra = {} if diloco is None else {"diloco": _diloco_dict(args, diloco)}
        if goodput is not None:
            extra["goodput"] = {"title": goodput_title(times, plan.cluster.nodes),
                                "layouts": [g.as_dict() for g in goodput]}
        dump_json({**plan.as_dict(), **extra}, args.json)
    if args.json != "-":
        print_plan(plan)
        if diloco is not None:
            from hsdp.tools.planner.diloco_render import print_diloco

            print_diloco(diloco, plan.best, diloco_options(args), plan.cluster.inter_bandwidth)
        if goodput is not None:
            print_goodput(goodput, plan.best, goodput_title(times, plan.cluster.nodes))
    if args.plot:
        from hsdp.tools.planner.plot import plot_plan

        print(f"plot: {plot_plan(plan, args.plot)}")
    return 0


def _diloco_dict(args: argparse.Namespace, estimates: tuple[DiLoCoEstimate, ...]) -> dict[str, object]:
    from hsdp.tools.planner.diloco_render import NOT_DDP

    return {"every": args.diloco_every, "wire_dtype": args.diloco_wire_dtype, "fragments": args.diloco_fragments,
            "delay": args.diloco_delay, "note": NOT_DDP,
            "layouts": [d.as_dict() for d in estimates]}


def _run_hetero(plan: HeteroPlan, args: argparse.Namespace) -> int:
    from hsdp.tools.planner.hetero_render import hetero_dict, print_hetero
    from hsdp.tools.planner.render import dump_json

    if args.json:
        dump_json(hetero_dict(plan), args.json)
    if args.json != "-":
        print_hetero(plan)
    return 0
