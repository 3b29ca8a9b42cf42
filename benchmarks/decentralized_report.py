"""``decentralized.py``'s accounting, tables and result files, from the ranks' step logs.

Every rank of both systems writes one JSON line per inner step into ``r<replica>_s<rank>_i<restart>.jsonl``
(time, step, tokens, loss; hsdp: the step's commit, its replicas, the syncs landed and its replicate wire bytes;
torchft: the commit, quorum and landing on the steps a fragment's sync lands, and ``healed`` on the step during
which a heal overwrote the replica), a ``joined`` line first and an ``eval`` line last. A run: ``{"logs":
{(replica, rank): [each incarnation's lines]}, "kills", "t0", "window", "links"}``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import shlex
import statistics
import sys
from collections.abc import Iterable
from pathlib import Path

Logs = dict[tuple[int, int], list[list[dict]]]


def read(out: Path) -> Logs:
    """(replica, rank) -> each incarnation's records, in restart order."""
    logs: Logs = {}
    for path in sorted(out.glob("r*_s*_i*.jsonl"), key=lambda p: int(p.stem.rsplit("_i", 1)[1])):
        replica, rank = int(path.name[1:].split("_")[0]), int(path.stem.split("_s")[1].split("_")[0])
        lines = [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]
        logs.setdefault((replica, rank), []).append(lines)
    return logs


def steps(lines: list[dict]) -> list[dict]:
    return [r for r in lines if "step" in r]


def leaders(out: Path) -> dict[int, list[dict]]:
    """Each replica's rank-0 step records over all its incarnations."""
    return {replica: [r for lines in inc for r in steps(lines)] for (replica, rank), inc in read(out).items()
            if rank == 0}


def kept_steps(lines: list[dict], died: bool) -> list[dict]:
    """An incarnation's inner steps that reached the others: each step up to a landed sync. Lost: the steps a
    heal overwrote (torchft's restarted node trains before its first quorum heals it; the healing step's own
    landing carries the peer's weights) and, when the incarnation died, those after its last landing."""
    kept: list[dict] = []
    pending: list[dict] = []
    for r in steps(lines):
        if "healed" in r:
            pending = []
            continue
        pending.append(r)
        if r.get("landed"):
            kept, pending = kept + pending, []
    return kept if died else kept + pending


def kept_tokens(run: dict, window_only: bool = True) -> int:
    """Tokens of the inner steps that reached the others (of the window's, or of the whole run's)."""
    t0, end, kept = run["t0"], run["t0"] + run["window"], 0
    for incarnations in run["logs"].values():
        for i, lines in enumerate(incarnations):
            kept += sum(r["tokens"] for r in kept_steps(lines, died=i + 1 < len(incarnations))
                        if not window_only or t0 <= r["t"] <= end)
    return kept


def alone_rate(run: dict) -> float:
    """Tokens per second of the window, every inner step trained (kept or not): the alone run's rate."""
    t0, end = run["t0"], run["t0"] + run["window"]
    return sum(r["tokens"] for lines in run["logs"].values() for inc in lines for r in steps(inc)
               if t0 <= r["t"] <= end) / run["window"]


def node_bytes_per_step(run: dict, nproc: list[int], in_window: bool) -> float:
    """hsdp's replicate-group wire bytes per step of the busiest node (its ranks summed; the median node's
    would hide the one that heals the others)."""
    return max(nodes_bytes_per_step(run, nproc, in_window))


def nodes_bytes_per_step(run: dict, nproc: list[int], in_window: bool) -> list[float]:
    """hsdp's replicate-group wire bytes per step of each node (its ranks summed): their sum is what crossed
    between nodes per step, the heals counted once (sent by the healer)."""
    t0 = run["t0"] or 0.0
    end = t0 + run["window"] if in_window else math.inf
    per_node = []
    for replica in range(len(nproc)):
        inside = [r for rank in range(nproc[replica]) for inc in run["logs"].get((replica, rank), [])
                  for r in steps(inc) if not in_window or t0 <= r["t"] <= end]
        sent = sum(r.get("sent", 0) for r in inside)
        per_node.append(sent / max(1, len({r["step"] for r in inside})))
    return per_node


def leader_steps(run: dict, in_window: bool = False) -> int:
    """Replica 0's distinct steps (of the window's, or of the whole run's)."""
    t0, end = run["t0"], run["t0"] + run["window"]
    return len({r["step"] for inc in run["logs"][(0, 0)] for r in steps(inc) if not in_window or t0 <= r["t"] <= end})


def link_bytes_per_step(run: dict) -> float | None:
    """The busiest node's link counter (every frame sent, the whole run) per step of replica 0."""
    nodes = links_per_step(run)
    return None if nodes is None else max(nodes)


def links_per_step(run: dict) -> list[float] | None:
    """Each node's link counter (every frame sent, the whole run) per step of replica 0."""
    if not run["links"]:
        return None
    return [n["sent_bytes"] / max(1, leader_steps(run)) for n in run["links"]["nodes"]]


def final_eval(run: dict) -> list[float]:
    """Each replica's held-out loss at the end (its rank 0's, the last incarnation)."""
    return [incs[-1][-1]["eval"] for (replica, rank), incs in sorted(run["logs"].items())
            if rank == 0 and incs[-1] and "eval" in incs[-1][-1]]


def eval_after(run: dict, steps_done: int) -> float:
    """Replica 0's held-out loss after ``steps_done`` steps (the plain run evaluates where each system's tokens
    are reached)."""
    return next(r["eval"] for inc in run["logs"][(0, 0)] for r in inc if r.get("after") == steps_done - 1)


def evals_near(run: dict, steps_done: int, span: int) -> list[float]:
    """Replica 0's held-out losses after ``steps_done - span`` to ``steps_done + span`` steps, in step order, one
    per step count (the run's closing evaluation repeats its last ``--eval-at``)."""
    found = {r["after"]: r["eval"] for inc in run["logs"][(0, 0)] for r in inc
             if "eval" in r and abs(r["after"] + 1 - steps_done) <= span}
    return [found[after] for after in sorted(found)]


def plain_grid(steps: Iterable[int], span: int, every: int) -> list[int]:
    """The step counts after which plain HSDP evaluates, for systems whose kept tokens are ``steps`` of its steps:
    every ``every`` steps within ``span`` either side of each, each itself among them (:func:`plain_reference`)."""
    return sorted({t for s in steps for t in (s, *(range(max(1, s - span), s + span + 1, every) if span else ()))})


def plain_reference(run: dict, steps_done: int, span: int) -> dict:
    """Plain HSDP's held-out loss after ``steps_done`` steps: the mean of its evaluations within ``span`` steps
    either side (a constant learning rate leaves the last iterate jittering by a few tenths of a percent from one
    evaluation to the next; a symmetric window's mean is the curve's value at its centre to first order), the
    single evaluation at ``steps_done`` and the window's range beside it. ``span`` 0: that evaluation alone."""
    near = evals_near(run, steps_done, span) if span else []
    at = eval_after(run, steps_done)
    return {"held_out_plain": statistics.fmean(near) if near else at, "held_out_plain_at_step": at,
            "held_out_plain_range": [min(near), max(near)] if near else [at, at], "plain_span": span,
            "plain_evals": len(near) or 1}


def _first_counted(lines: list[dict]) -> float | None:
    """When an incarnation's first inner step that counts ended: its first after its heal, if it healed."""
    trained = steps(lines)
    healed = [i for i, r in enumerate(trained) if "healed" in r]
    rest = trained[healed[0] + 1:] if healed else trained
    return rest[0]["t"] if rest else None


def recoveries(run: dict) -> tuple[list[float], list[float]]:
    """Per kill: seconds until the survivors commit again (hsdp: an inner step; torchft: a fragment's sync):
    without the victim, or with its next incarnation (a torchft kill landing in an all-reduce holds the
    survivors for gloo's timeout, often past the victim's restart); and until that incarnation ends an inner
    step that counts."""
    lead = {replica: incs for (replica, rank), incs in run["logs"].items() if rank == 0}
    recovery, again = [], []
    for kill in run["kills"]:
        t, victim = kill["t"], kill["victim"]
        later = [inc for inc in lead.get(victim, []) if inc and inc[0]["t"] > t]
        rejoined = later[0][0]["t"] if later else math.inf  # its "joined" line: a commit with it after is anew
        survivors = [r["t"] for q, incs in lead.items() if q != victim for inc in incs for r in steps(inc)
                     if r.get("committed") and r["t"] > t and (victim not in r["replicas"] or r["t"] > rejoined)]
        back = _first_counted(later[0]) if later else None
        if survivors:
            recovery.append(round(min(survivors) - t, 2))
        if back is not None:
            again.append(round(back - t, 2))
    return recovery, again


def committed_fraction(run: dict) -> float:
    """Of the window's commits on replica 0 (hsdp: every inner step; torchft: every fragment's sync), the
    fraction that committed."""
    t0, end = run["t0"], run["t0"] + run["window"]
    votes = [r["committed"] for r in steps([x for inc in run["logs"][(0, 0)] for x in inc])
             if "committed" in r and t0 <= r["t"] <= end]
    return sum(votes) / max(1, len(votes))


def median_step_s(run: dict) -> float | None:
    """The median seconds between consecutive inner steps of the replicas' rank 0 in the window (syncs included):
    the systems' own step cost, apart from what the kills lost."""
    t0, end = run["t0"], run["t0"] + run["window"]
    gaps = [b["t"] - a["t"] for (replica, rank), incs in run["logs"].items() if rank == 0 for inc in incs
            for a, b in zip(steps(inc), steps(inc)[1:]) if t0 <= a["t"] and b["t"] <= end]
    return round(statistics.median(gaps), 3) if gaps else None


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 2) if values else None


def measure_system(run: dict, alone: float, nproc: list[int]) -> dict:
    """One system's figures over its window (see the side-by-side table)."""
    t0, end = run["t0"], run["t0"] + run["window"]
    trained = sum(r["tokens"] for incs in run["logs"].values() for inc in incs for r in steps(inc)
                  if t0 <= r["t"] <= end)
    kept = kept_tokens(run)
    recovery, again = recoveries(run)
    link = link_bytes_per_step(run)
    return {"kept_tokens": kept, "trained_tokens_window": trained, "kept_fraction": round(kept / max(1, trained), 4),
            "tokens_per_s": round(kept / run["window"], 1), "utilization": round(kept / run["window"] / alone, 4),
            "committed_fraction": round(committed_fraction(run), 4), "total_kept_tokens": kept_tokens(run, False),
            "kills": [{"victim": k["victim"], "ranks_killed": k["ranks_killed"], "at_s": round(k["t"] - t0, 1)}
                      for k in run["kills"]],
            "recovery_s": recovery, "recovery_median_s": _median(recovery), "trains_again_s": again,
            "trains_again_median_s": _median(again), "median_step_s": median_step_s(run), "held_out": final_eval(run),
            "held_out_mean": statistics.fmean(final_eval(run)), "steps_in_window": leader_steps(run, True),
            "link_bytes_per_step_node": None if link is None else round(link),
            "link_bytes_per_step_nodes": [round(b) for b in links_per_step(run) or []],
            "hsdp_bytes_per_step_node": round(node_bytes_per_step(run, nproc, in_window=True)),
            "hsdp_bytes_per_step_nodes": [round(b) for b in nodes_bytes_per_step(run, nproc, in_window=True)]}


def measure(alone: list[dict], runs: dict[str, dict], plain: dict, nproc: list[int],
            plain_steps: dict[str, int], span: int = 0) -> dict:
    """hsdp's recipe against its references (the keys of the first results) and, per system, the side by side
    figures, each against plain HSDP after as many tokens as it kept (``plain_reference`` over ``span``)."""
    rates = [alone_rate(run) for run in alone]  # before and after the runs (decentralized.py: the drift)
    rate = statistics.fmean(rates)
    systems = {name: measure_system(run, rate, nproc) for name, run in runs.items()}
    for name, s in systems.items():
        s["plain_steps"] = plain_steps[name]
        s.update(plain_reference(plain, plain_steps[name], span))
        s["held_out_gap"] = round(s["held_out_mean"] / s["held_out_plain"] - 1, 4)
        if name != "hsdp":
            s["hsdp_bytes_per_step_node"] = None  # no such count: its link counters only
            s["hsdp_bytes_per_step_nodes"] = None
    h = systems["hsdp"]
    plain_bytes = node_bytes_per_step(plain, nproc, in_window=False)
    plain_all = sum(nodes_bytes_per_step(plain, nproc, in_window=False))
    dec_all = sum(nodes_bytes_per_step(runs["hsdp"], nproc, in_window=True))
    link, link_all = h["link_bytes_per_step_node"], sum(h["link_bytes_per_step_nodes"]) or None
    return {
        "alone_tokens_per_s": round(rate, 1), "alone_tokens_per_s_runs": [round(r, 1) for r in rates],
        "kept_tokens": h["kept_tokens"], "trained_tokens": h["total_kept_tokens"],
        "decentralized_tokens_per_s": h["tokens_per_s"], "compute_utilization": h["utilization"], "kills": h["kills"],
        "inner_steps_in_window": h["steps_in_window"], "plain_steps": h["plain_steps"],
        "held_out_decentralized": h["held_out"], "held_out_decentralized_mean": h["held_out_mean"],
        "held_out_plain": h["held_out_plain"], "held_out_gap": h["held_out_gap"],
        **{k: h[k] for k in ("held_out_plain_at_step", "held_out_plain_range", "plain_span", "plain_evals")},
        "plain_bytes_per_step_node": round(plain_bytes),
        "decentralized_bytes_per_step_node": h["hsdp_bytes_per_step_node"],
        "decentralized_link_bytes_per_step_node": link,
        "bytes_ratio": round(plain_bytes / max(1.0, h["hsdp_bytes_per_step_node"]), 1),
        "link_bytes_ratio": None if link is None else round(plain_bytes / link, 1), "systems": systems,
        "plain_bytes_per_step_all": round(plain_all), "decentralized_bytes_per_step_all": round(dec_all),
        "bytes_ratio_all": round(plain_all / max(1.0, dec_all), 1), "decentralized_link_bytes_per_step_all": link_all,
        "link_bytes_ratio_all": None if link_all is None else round(plain_all / link_all, 1),
    }


def table(m: dict) -> list[str]:
    """hsdp's recipe against its targets."""
    util = "yes" if m["compute_utilization"] >= 0.90 else "no"
    gap = "yes" if abs(m["held_out_gap"]) <= 0.03 else "no"
    # Every frame on our side counted where the links were (link counters), against plain HSDP's own count.
    ratio_all = m.get("link_bytes_ratio_all") or m["bytes_ratio_all"]
    ratio = "yes" if min(ratio_all, m["bytes_ratio_all"]) >= 100 else "no"
    link, link_all = m["decentralized_link_bytes_per_step_node"], m.get("decentralized_link_bytes_per_step_all")
    return [
        "| | value | target |", "|---|---|---|",
        f"| tokens/s, the replicas alone (no inter-node communication, no faults; the mean of one run before and one "
        f"after: {' and '.join(map(str, m['alone_tokens_per_s_runs']))}) | {m['alone_tokens_per_s']} | |",
        f"| tokens/s kept, decentralized with the kills | {m['decentralized_tokens_per_s']} | |",
        f"| compute utilization | {m['compute_utilization']:.3f} | >= 0.90: {util} |",
        f"| held-out loss at equal tokens ({m['trained_tokens']:,}): decentralized (replicas' mean) | "
        f"{m['held_out_decentralized_mean']:.4f} | |",
        f"| held-out loss, plain HSDP on unlimited links, no faults ({_plain_steps(m)}) | "
        f"{m['held_out_plain']:.4f} | |",
        f"| gap | {100 * m['held_out_gap']:+.2f} % | within 3 %: {gap} |",
        f"| inter-node bytes per step, busiest node: plain HSDP (hsdp's count) | "
        f"{m['plain_bytes_per_step_node']:,} | |",
        f"| ... decentralized, hsdp's count (pseudo-gradients, heals) | {m['decentralized_bytes_per_step_node']:,} | |",
        f"| ... decentralized, link counters (every frame: control traffic too) | "
        f"{'n/a' if link is None else f'{link:,}'} | |",
        f"| plain / decentralized bytes, busiest node (hsdp's count; link counters) | {m['bytes_ratio']}x; "
        f"{m['link_bytes_ratio']}x | |",
        f"| inter-node bytes per step, all nodes summed: plain HSDP; decentralized (hsdp's count; link counters) | "
        f"{m['plain_bytes_per_step_all']:,}; {m['decentralized_bytes_per_step_all']:,}; {_bytes(link_all)} | |",
        f"| plain / decentralized bytes, all nodes summed (hsdp's count; link counters) | {m['bytes_ratio_all']}x; "
        f"{m.get('link_bytes_ratio_all') or 'n/a'}x | >= 100x: {ratio} |",
    ]


def _plain_steps(m: dict) -> str:
    """Where plain HSDP's held-out loss was read: the step, or the window whose evaluations were averaged."""
    span = m.get("plain_span", 0)
    if not span:
        return f"{m['plain_steps']} steps"
    low, high = m["held_out_plain_range"]
    return (f"the mean of {m['plain_evals']} evaluations within {m['plain_steps']} +- {span} steps: {low:.4f} to "
            f"{high:.4f}; at {m['plain_steps']} steps {m['held_out_plain_at_step']:.4f}")


def _bytes(value: int | None) -> str:
    return "n/a" if value is None else f"{value:,}"


_ROWS = (
    ("tokens/s kept, window (compute utilization: / the hsdp replicas alone)",
     lambda s: f"{s['tokens_per_s']} ({s['utilization']:.3f})"),
    ("inner steps kept: tokens kept / trained in the window", lambda s: f"{s['kept_fraction']:.3f}"),
    ("median seconds per inner step (replicas' rank 0, syncs included)", lambda s: s["median_step_s"]),
    ("committed (hsdp: inner steps; torchft: fragment syncs), window", lambda s: f"{s['committed_fraction']:.3f}"),
    ("kill -> survivors commit again (without it, or with its restart), median s", lambda s: s["recovery_median_s"]),
    ("kill -> the killed node ends an inner step that counts, median s", lambda s: s["trains_again_median_s"]),
    ("held-out loss at the end (replicas' mean, on the global copy)", lambda s: f"{s['held_out_mean']:.4f}"),
    ("plain HSDP at equal tokens (its steps); gap",
     lambda s: f"{s['held_out_plain']:.4f} ({s['plain_steps']}); {100 * s['held_out_gap']:+.2f} %"),
    ("inter-node bytes/step, busiest node: link counters", lambda s: _bytes(s["link_bytes_per_step_node"])),
    ("... hsdp's own count (pseudo-gradients, heals)", lambda s: _bytes(s["hsdp_bytes_per_step_node"])),
)


def side_by_side(m: dict, timeouts: dict[str, float], wire: str, nproc: list[int], mix: float = 0.0) -> list[str]:
    """Both systems' figures in one table, and what is not equal between them."""
    systems = m["systems"]
    one = "the plain module (one rank per node: FSDP2 would shard nothing)" if max(nproc) == 1 else \
        f"FSDP2 (`fully_shard`) over the node's {nproc[0]} ranks"
    lines = ["## Side by side: hsdp and torchft", "", "| | " + " | ".join(systems) + " |",
             "|---|" + "---|" * len(systems),
             f"| pseudo-gradients on the wire | {wire} | fp32 (torchft's quantised all-reduce needs triton: a GPU) |"]
    lines += [f"| {name} | " + " | ".join(str(value(s)) for s in systems.values()) + " |" for name, value in _ROWS]
    t = timeouts
    lines += ["", *[f"{name}: per kill (victim, at s), survivors commit again (s) {s['recovery_s']}, the killed node "
                    f"trains again (s) {s['trains_again_s']}; kills {[(k['victim'], k['at_s']) for k in s['kills']]}; "
                    f"held-out per replica {[round(x, 4) for x in s['held_out']]}." for name, s in systems.items()], "",
              f"- Timeouts, both systems: heartbeat {t['heartbeat_interval']:g} s, declared dead after "
              f"{t['heartbeat_timeout']:g} s (torchft's lighthouse `--heartbeat_timeout_ms`), collectives "
              f"{t['hop_timeout']:g} s (torchft's Manager and gloo `timeout`), quorum / admission "
              f"{t['join_timeout']:g} s, "
              f"connect {t['connect_timeout']:g} s, start grace {t['start_grace']:g} s (the lighthouse's "
              f"`--join_timeout_ms`), at least 2 replicas. hsdp's coordinator also probes a failed reduction's ranks "
              f"(a dead one is dropped at once); torchft's lighthouse has only the heartbeat, and a kill landing in a "
              f"fragment's all-reduce waits out gloo's {t['hop_timeout']:g} s receive timeout.",
              f"- torchft 0.2.0: `torchft.local_sgd.DiLoCo` (hsdp's fragments, `fragment_sync_delay` = tau, "
              f"`fragment_update_alpha` {mix:g}, hsdp's `mix`), a `torchft.Manager` per node (synchronous quorum), "
              f"the lighthouse on node 0; inside each node {one}.",
              "- Healing: hsdp admits and heals a restarted node before its first step, at a sync; torchft's trains "
              "H/F - tau inner steps from its fresh start before its first quorum heals it (lost, counted so), then "
              "repeats the peer it was copied from until its next sync.",
              "- Batches: hsdp weights every rank's contribution by its batch (batch weights); torchft weights the "
              "ranks inside a node (the loss scaled before FSDP2's mean) but averages the nodes' pseudo-gradients "
              "equally: equal only with equal batches per node.",
              "- The end: both sync every fragment before the held-out eval (hsdp `opt.sync_replicas()`, every "
              "replica the global copy; torchft: past any sync in flight, every fragment synced once"
              + (")." if mix == 0 else f", its landings mixing by alpha {mix:g} as any: its replicas end apart, "
                 "the held-out loss is their mean)."),
              "- Utilization's denominator is hsdp's alone run for both (torchft's inner steps run FSDP2, not "
              "hsdp's sharding; no alone run of its own)."]
    return lines


def shown_argv(argv: list[str]) -> list[str]:
    """The driver's arguments as the results show them: without ``--keep`` and ``--results`` (this machine's
    folders)."""
    shown, skip = [], False
    for part in argv:
        if skip or part.startswith(("--keep=", "--results=")):
            skip = False
            continue
        skip = part in ("--keep", "--results")
        if not skip:
            shown.append(part)
    return shown


def balance_lines(balance: dict | None) -> list[str]:
    """How the batches were chosen (``decentralized_balance.py``) and how even the replicas' steps came out."""
    if not balance or not balance["rounds"]:
        return []
    rounds = "; ".join(f"{r['batches']}: {', '.join(f'{t:.3f}' for t in r['step_s'])} s" for r in balance["rounds"])
    alone = ", ".join(f"{t:.3f}" for t in balance["alone_step_s"])
    after = ", ".join(f"{t:.3f}" for t in balance["alone_after_step_s"])
    paced = ("" if not balance.get("paced") else f" Paced in the run (`--pace`): the ranks' mean batches over the "
             f"window {','.join(f'{b:g}' for b in balance['paced'])}, which the alone run after it and plain HSDP ran.")
    return [f"Batches balanced by {len(balance['rounds'])} short alone runs (mean inner-step seconds per replica at"
            f" each round's batches: {rounds}); the alone runs then: {alone} s before, {after} s after.{paced}", ""]


def write_results(args: argparse.Namespace, systems: list[str], m: dict, commands: dict[str, str]) -> None:
    """``<--results>/decentralized_<date>[_<tag>].{json,md}``: the arguments, figures, timeouts and commands."""
    from elastic_recovery_torchft import installed_version, timeouts

    date = datetime.date.today().isoformat()
    commands = {"driver": shlex.join(["sudo", "python", "benchmarks/decentralized.py", *shown_argv(sys.argv[1:])]),
                **commands}
    result = {"date": date, "args": {k: v for k, v in vars(args).items() if k not in ("keep", "results")},
              "systems": systems, "timeouts_s": timeouts(),
              "torchft_version": installed_version() if "torchft" in systems else None,
              "measured": m, "commands": commands}
    md = [f"# Decentralized training: replicas of {args.nproc} ranks, {args.bandwidth} links, a kill every "
          f"{args.kill_every:g} s ({date})", "",
          f"GPT `{args.preset}`, byte-level, stdlib sources; per-rank batches {args.batches} sequences (batch "
          f"weights); node CPUs {args.node_cpus}; elastic replicas, Streaming DiLoCo H = {args.every}, F = "
          f"{args.fragments}, tau = {args.delay}, alpha = {args.mix}, {args.wire} wire, outer lr {args.outer_lr}, "
          f"momentum {args.outer_momentum}; inner AdamW lr {args.lr}, clip 1.0. Window {args.minutes:g} min from "
          f"the first step all replicas committed together. Kills: "
          + ", ".join(f"replica {k['victim']} at +{k['at_s']} s" for k in m["kills"]) + ".", "",
          *balance_lines(m.get("balance")), "```", *commands.values(), "```", "", *table(m), "",
          f"Held-out loss per replica at the end: {m['held_out_decentralized']}."]
    if "torchft" in systems:
        md += ["", *side_by_side(m, result["timeouts_s"], args.wire, [int(n) for n in args.nproc.split(",")],
                                 args.mix)]
    stem = f"decentralized_{date}{'_' + args.tag if args.tag else ''}"
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / f"{stem}.json").write_text(json.dumps(result, indent=1))
    (args.results / f"{stem}.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
