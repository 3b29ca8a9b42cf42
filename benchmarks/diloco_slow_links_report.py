"""The Markdown, JSON and plot of ``diloco_slow_links.py``'s driver, and the table of its loss-only sweep."""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
RATES = ("100mbit", "10gbit")



def _wire_arg(wire: str) -> str:
    """``DiLoCo``'s ``wire_dtype`` argument for ``--wire`` (fp32: the default, none)."""
    return {"bf16": ", wire_dtype=torch.bfloat16", "int8": ", wire_dtype=torch.int8"}.get(wire, "")


def stem_of(date: str, tag: str) -> Path:
    """The result files' path without the suffix."""
    return RESULTS / (f"diloco_slow_links_{date}" + (f"_{tag}" if tag else ""))


def sweep_rows(sweep_record: dict) -> list[str]:
    plain = {r["steps"]: r["held_out"][-1][1] for r in sweep_record["runs"] if r["mode"] == "plain"}
    rows = ["| steps | mode | H | outer lr | outer momentum | wire | F | tau | outer steps | held-out at end | "
            "vs plain |", "|---" * 11 + "|"]
    for r in sweep_record["runs"]:
        final = r["held_out"][-1][1]
        gap = f"{100 * (final - plain[r['steps']]) / plain[r['steps']]:+.2f} %" if r["steps"] in plain else "?"
        if r["mode"] == "plain":
            rows.append(f"| {r['steps']} | plain | | | | | | | | {final:.4f} | |")
            continue
        rows.append(f"| {r['steps']} | {r['mode']} | {r['every']} | {r['outer_lr']} | {r['outer_momentum']} | "
                    f"{r['wire']} | {r.get('fragments', 1)} | {r.get('delay', 0)} | {r['steps'] // r['every']} | "
                    f"{final:.4f} | {gap} |")
    return rows


def _plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    per_step, rate = result["global_tokens_per_step"], RATES[0]
    fig, (held, train) = plt.subplots(1, 2, figsize=(13, 4.5))
    colours = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple")
    for mode, colour in zip(result["rates"][rate], colours, strict=False):
        s = result["rates"][rate][mode]
        held.plot([t * per_step for t, _ in s["held_out"]], [v for _, v in s["held_out"]], "o-", color=colour,
                  ms=3, label=_label(result, mode))
        tokens = [(i + 1) * per_step for i in range(len(s["train_loss"]))]
        train.plot(tokens, s["train_loss"], color=colour, alpha=0.25, lw=0.6)
        train.plot(tokens, _smooth(s["train_loss"], 20), color=colour, lw=1.2, label=f"{mode} (mean of 20)")
    held.set(xlabel="tokens (global)", ylabel="held-out loss (nats/byte)", title="held-out loss at equal tokens")
    train.set(xlabel="tokens (global)", ylabel="train loss (nats/byte)", title="train loss per step",
              ylim=(None, min(4.0, max(result["rates"][rate]["plain"]["train_loss"]))))
    for ax in (held, train):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"GPT {result['settings']['preset']}, 2 x 2 ranks, {rate} links (the loss is the same at 10gbit)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _smooth(values: list[float], window: int) -> list[float]:
    return [statistics.fmean(values[max(0, i - window + 1):i + 1]) for i in range(len(values))]


def _label(result: dict, mode: str) -> str:
    st = result["settings"]
    if mode == "plain":
        return "plain HSDP"
    torchft = mode.startswith("torchft-")
    outer = f"H={st['every']}, outer {st['outer_lr']}/{st['outer_momentum']}, {'fp32' if torchft else st['wire']}"
    name = ("torchft " if torchft else "") + ("DiLoCo" if mode.endswith("diloco") else "Streaming DiLoCo")
    return f"{name} ({outer})" if mode.endswith("diloco") else \
        f"{name} ({outer}, F={st['fragments']}, tau={st['delay']})"


def _rows(result: dict) -> list[str]:
    rows = ["| link | mode | tokens/s | ratio | median step s | inter-node B/step, nodes 0, 1 (hsdp) | "
            "(link counters) | held-out loss at end | gap |", "|---|---|---|---|---|---|---|---|---|"]
    for rate, s in result["rates"].items():
        for m, r in s.items():
            ratio = f"{r['tokens_per_s_ratio']:.2f}x" if m != "plain" else "1"
            gap = f"{100 * r['held_out_relative_gap']:+.2f} %" if m != "plain" else ""
            link = ", ".join(f"{b:.0f}" for b in r["link_bytes_per_step_per_node"])
            counted = ", ".join(f"{b:.0f}" for b in r["hsdp_bytes_per_step_per_node"])
            rows.append(f"| {rate} | {m} | {r['tokens_per_s']:.0f} | {ratio} | {r['median_step_s']:.3f} | "
                        f"{counted} | {link} | {r['held_out'][-1][1]:.4f} | {gap} |")
    return rows


def _curve_rows(result: dict) -> list[str]:
    per_step, modes = result["global_tokens_per_step"], list(result["rates"][RATES[0]])
    header = "| tokens | " + " | ".join(f"{m} {rate}" for rate in RATES for m in modes) + " |"
    rows = [header, "|---" * (1 + len(modes) * len(RATES)) + "|"]
    evals = result["rates"][RATES[0]]["plain"]["held_out"]
    for i, (step, _) in enumerate(evals):
        cells = [f"{result['rates'][rate][m]['held_out'][i][1]:.4f}" for rate in RATES for m in modes]
        rows.append(f"| {step * per_step} | " + " | ".join(cells) + " |")
    return rows


def write(result: dict, args: argparse.Namespace) -> None:
    RESULTS.mkdir(exist_ok=True)
    stem = stem_of(result["date"], args.tag)
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    _plot(result, stem.with_suffix(".png"))
    st = result["settings"]
    driver = "sudo python benchmarks/diloco_slow_links.py" + (" --quick" if args.quick else "") + \
        "".join(f" --{k.replace('_', '-')} {st[k]}" for k in ("steps", "every", "preset", "batch", "block",
                                                              "warmup", "outer_lr", "outer_momentum", "wire",
                                                              "fragments", "delay", "mix", "systems", "tag")) + \
        (f" --sweep-json benchmarks/results/{Path(args.sweep_json).name}" if args.sweep_json else "")
    lines = [f"# DiLoCo and Streaming DiLoCo vs plain HSDP on slow and fast emulated links ({result['date']})", "",
             f"{result['mesh']} on `hsdp launch --nodes 2 --nproc-per-node 2` (network namespaces, shaped links). "
             f"GPT `{st['preset']}` ({result['params'] / 1e6:.2f}M parameters, fp32), byte-level, stdlib sources "
             f"(first {st['corpus_bytes']:,} bytes, last 5 % held out); {st['batch']} x {st['block']} tokens per "
             f"rank per step ({result['global_tokens_per_step']} global), {st['steps']} steps, the same seed and "
             f"batches in every mode; AdamW lr {st['lr']}, betas (0.9, 0.95), weight decay 0.1, "
             f"`hsdp.clip_grad_norm_(model, 1.0)`. DiLoCo: `hsdp.DiLoCo(every={st['every']}, "
             f"outer_lr={st['outer_lr']}, outer_momentum={st['outer_momentum']}"
             f"{_wire_arg(st['wire'])})` (outer SGD, Nesterov when the "
             f"momentum is > 0). Streaming "
             f"DiLoCo: the same with `fragments={st['fragments']}, delay={st['delay']}, mix={st['mix']}`."
             + (" torchft-diloco, torchft-streaming: torchft 0.2.0's `torchft.local_sgd.DiLoCo` with the same "
                "settings (FSDP2 inside each node, fp32 pseudo-gradients, `Manager.allreduce`: the bytes it was "
                "handed in the hsdp-count column; benchmarks/diloco_slow_links_torchft.py)."
                if any(m.startswith("torchft-") for m in result["rates"][RATES[0]]) else ""), "",
             f"Tokens/s = global tokens of steps {st['warmup']}..{st['steps'] - 1} / their wall time (the slowest "
             f"rank's sum of step times, the syncs inside, evaluations outside). Held-out loss: "
             f"{st['eval_windows']} fixed windows, each replica evaluated on all of them, the replicas' mean; "
             f"before training and every {st['every']} steps (DiLoCo right after a sync, when the replicas agree; "
             f"Streaming DiLoCo's replicas never agree on every fragment: there the last fragment's update is "
             f"still in flight, it lands {st['delay']} steps later). Inter-node bytes per step over steps "
             f"{st['every']}..{st['steps'] - 1} (whole sync periods): hsdp's count (the node's ranks summed) and "
             f"the link counters, (long run - {st['every']}-step run at 10gbit) / {st['steps'] - st['every']}. "
             f"The machine (2 CPU cores) was shared with other jobs: timings are noisy, single runs.", "", "```",
             driver, *[result["rates"][r][m]["command"] for r in RATES for m in result["rates"][r]],
             *result["short_commands"], "```", "", *_rows(result), "", *result.get("notes", []),
             *([""] if result.get("notes") else []),
             "Held-out loss at equal tokens:", "", *_curve_rows(result), "",
             f"Plot: `{stem.with_suffix('.png').name}` (held-out loss and train loss vs tokens, {RATES[0]})."]
    if "sweep" in result:
        lines += ["", "## Every configuration tried (loss only, on loopback)", "",
                  "The loss does not depend on the link rate, so configurations were explored on loopback "
                  "(`hsdp launch --no-emulation`) and picked by the held-out loss this benchmark reports (the "
                  "same windows: a user tuning H and the outer optimizer on a validation split would do the "
                  f"same). `python benchmarks/diloco_slow_links.py --steps N --sweep H:outer_lr:outer_momentum:wire"
                  f"[:F:tau] ...` (`{Path(args.sweep_json).name}`), plain HSDP once per step count:", "",
                  *sweep_rows(result["sweep"])]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


