"""Markdown and plot of benchmark results (shared by bench.py and `hsdp bench`)."""

from __future__ import annotations

from pathlib import Path


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def _step_cell(r: dict) -> str:
    """The step time; with repeats, the median run's and the range of every run's median."""
    runs = r.get("repeats_median_step_s", [])
    if len(runs) < 2:
        return f"{r['median_step_s']:.3f}"
    return f"{r['median_step_s']:.3f} ({min(runs):.3f}-{max(runs):.3f})"


def markdown_table(meta: dict, results: list[dict]) -> str:
    lines = [
        f"# Benchmark {meta['date']}",
        "",
        f"Command: `{meta['command']}` (git {meta['git']})",
        "",
        "2 nodes x 2 ranks, gloo on CPU. Step time: median over the measured steps of the slowest rank. "
        "Inter-node MB: bytes sent per node per step on the emulated link (kernel counters, TCP/IP headers "
        "included); floor = 2(R-1)/R x P x 4 bytes. Peak tensor MiB: the most bytes of live tensors on any "
        "rank during one step (PyTorch's MemTracker on CPU; max_memory_allocated on CUDA); peak RSS: the "
        "process's resident set over the timed steps (allocator and interpreter included, noisy).",
        *([f"With --repeat {meta['args']['repeat']}, the job list ran that many times, interleaved; each row is "
           "the run with the median step time, and the step column gives the range over the runs."]
          if meta.get("args", {}).get("repeat", 1) > 1 else []),
        "",
        "| network | system | micro-batches | median step s | ratio to FSDP2 HSDP | peak tensor MiB/rank "
        "| memory ratio | peak RSS MiB/rank | inter-node MB/step/node | floor MB | vs floor |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['network']} | {r['system']} | {r.get('micro_batches', '')} | failed |"
                         + " |" * 7)
            continue
        inter = r["inter_node_mb_per_node"]
        vs = None if inter is None else inter / r["floor_mb_per_node"]
        lines.append(
            f"| {r['network']} | {r['system']} | {r['micro_batches']} | {_step_cell(r)} "
            f"| {_fmt(r['ratio_to_fsdp2_hsdp'], '.2f')} | {r['peak_tensor_mib']:.1f} "
            f"| {_fmt(r['tensor_peak_ratio_to_fsdp2_hsdp'], '.3f')} | {r['peak_rss_mib']:.0f} "
            f"| {_fmt(inter, '.1f')} | {r['floor_mb_per_node']:.1f} | {_fmt(vs, '.3f')} |"
        )
    return "\n".join(lines + state_table(results)) + "\n"


def state_table(results: list[dict]) -> list[str]:
    """Markdown lines of the model state per rank, one row per system and micro-batch count (the bytes do not
    depend on the network: the first network's run is shown); no lines when no result measured it."""
    rows: dict[tuple[str, int], dict] = {}
    for r in results:
        if r.get("state_bytes"):
            rows.setdefault((r["system"], r["micro_batches"]), r)
    if not rows:
        return []
    lines = [
        "",
        "## Model state per rank",
        "",
        "Bytes held by the rank with the most, after `optimizer.step()` and before `zero_grad` (`hsdp.state_bytes`: "
        "hsdp's flat shard buffers and gradient/optimizer shards; the local chunks of FSDP2's DTensors; DDP's "
        "full tensors, its gradient buckets not counted). Ratios: against plain hsdp on the same network and "
        "micro-batches (the optimizer-state bytes; the median step time).",
        "",
        "| system | micro-batches | params MiB | grads MiB | optimizer MiB | total MiB | optimizer / hsdp "
        "| step / hsdp |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows.values():
        st = r["state_bytes"]
        lines.append(
            f"| {r['system']} | {r['micro_batches']} "
            + "".join(f"| {st[k] / 2**20:.2f} " for k in ("params", "grads", "optimizer", "total"))
            + f"| {_fmt(r.get('optimizer_bytes_ratio_to_hsdp'), '.3f')} | {_fmt(r.get('ratio_to_hsdp'), '.3f')} |"
        )
    return lines


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if "error" not in r and r["micro_batches"] == 1]
    networks = list(dict.fromkeys(r["network"] for r in ok))
    systems = list(dict.fromkeys(r["system"] for r in ok))
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    width = 0.8 / max(1, len(systems))
    for i, system in enumerate(systems):
        xs, steps, mbs, mems = [], [], [], []
        for j, network in enumerate(networks):
            match = [r for r in ok if r["system"] == system and r["network"] == network]
            if match:
                xs.append(j + i * width)
                steps.append(match[0]["median_step_s"])
                mbs.append(match[0]["inter_node_mb_per_node"] or 0.0)
                mems.append(match[0]["peak_tensor_mib"])
        axes[0].bar(xs, steps, width, label=system)
        axes[1].bar(xs, mbs, width, label=system)
        axes[2].bar(xs, mems, width, label=system)
    floor = ok[0]["floor_mb_per_node"] if ok else 0
    axes[1].axhline(floor, color="black", linestyle="--", label="floor 2(R-1)/R·P·4")
    titles = ("median step time (s)", "inter-node MB per step per node", "peak tensor MiB per rank")
    for ax, title in zip(axes, titles, strict=True):
        ax.set_xticks([j + width * (len(systems) - 1) / 2 for j in range(len(networks))], networks)
        ax.set_title(title)
    # One legend for the three panels, below them (inside, it would cover the tallest bars).
    handles, labels = axes[1].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
