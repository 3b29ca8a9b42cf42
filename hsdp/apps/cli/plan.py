"""``hsdp plan``: the cost model of :mod:`hsdp.tools.planner` from the command line (the arguments, the
cluster and model they describe, the output). Imports neither torch nor torch.distributed."""

from __future__ import annotations

import argparse
import sys

from hsdp.apps.cli.helptext import RATE_UNITS, HelpFormatter
from hsdp.tools.planner.cluster import ClusterSpec
from hsdp.tools.planner.model import ComputeProfile, ModelSpec, TransformerShape, transformer
from hsdp.tools.planner.options import PRECISIONS, REPLICATE_DTYPES, SYNC_MODES, TrainOptions, precision
from hsdp.tools.planner.plan import DEFAULT_HEADROOM, SHARD_OPTIMIZER_MODES, Plan, make_plan
from hsdp.tools.planner.presets import (
    GPUS,
    INTER_LINKS,
    INTRA_LINKS,
    gpu,
    inter_link,
    intra_link,
    link_or_rate,
    model_preset,
)
from hsdp.tools.quantities import parse_bytes, parse_duration, parse_flops

DEFAULT_MFU = 0.45
OPTIMIZER_BYTES_PER_ELEMENT = 36  # AdamW reads param, grad, two moments and writes three: about 36 B/element

PLAN_EPILOG = f"""\
examples:
  hsdp plan --model 7b --nodes 16 --gpus-per-node 8 --gpu-memory 80GiB \\
            --intra-node-bandwidth 450GB/s --inter-node-bandwidth 50GB/s
  hsdp plan --model 70b --nodes 64 --gpus-per-node 8 --gpu h100 --inter-node-bandwidth 8xib400 \\
            --precision bf16 --micro-batches 8 --plot plan.png --json plan.json

GPUs: {", ".join(sorted(GPUS))}
intra-node links: {", ".join(sorted(INTRA_LINKS))} (or a rate: 450GB/s)
inter-node links (per NIC; 8xib400 = eight per node): {", ".join(sorted(INTER_LINKS))} (or a rate per node)
models: 125m 350m 1.3b 7b 13b 70b and the hsdp.models GPT presets (gpt2-124m, small, bench, ...)
"""


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
    p.add_argument("--nodes", type=int, required=True, help="nodes in the cluster")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs (ranks) per node")
    p.add_argument("--gpu", default="h100", help="GPU preset for memory, compute and NVLink")
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
    p.add_argument("--plot", metavar="FILE", help="write memory and step time against shard degree (PNG)")
    p.add_argument("--json", metavar="FILE", help="write the plan as JSON ('-': stdout, no table)")
    p.set_defaults(func=run_plan)
    return p


def cluster_from_args(args: argparse.Namespace) -> ClusterSpec:
    g = gpu(args.gpu)
    intra_bw, intra_lat = link_or_rate(args.intra_node_bandwidth or g.intra_link, intra_link)
    inter_bw, inter_lat = link_or_rate(args.inter_node_bandwidth, inter_link)
    return ClusterSpec(
        args.nodes, args.gpus_per_node, parse_bytes(args.gpu_memory) if args.gpu_memory else g.memory,
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
                     tensor_parallel=parse_tp(args.tp, args.gpus_per_node) if model.hidden or args.tp != "auto"
                     else [1])


def run_plan(args: argparse.Namespace) -> int:
    """Execute a parsed ``hsdp plan``: 0, or 2 with the fix on bad arguments."""
    from hsdp.tools.planner.render import dump_json, print_plan

    try:
        plan = build_plan(args)
    except ValueError as e:
        print(f"hsdp plan: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        dump_json(plan.as_dict(), args.json)
    if args.json != "-":
        print_plan(plan)
    if args.plot:
        from hsdp.tools.planner.plot import plot_plan

        print(f"plot: {plot_plan(plan, args.plot)}")
    return 0
