"""``hsdp report``'s figure of an elastic run (``parallel.elastic = true``): which replicas trained each step.

Drawn only when the records carry ``replicas`` (:mod:`hsdp.apps.train.elastic_run` adds it, with ``committed``,
``global_batch`` and ``writer``, to every record). Two panels over the same whole steps:

  * members: one row per replica id, a bar over every run of consecutive steps in which it was a member, so a
    replica that left and rejoined shows a gap; a discarded step (a member failed during it: applied nowhere,
    no tokens) is a red cross on each member's row; the writer of each step (the lowest member id, which wrote
    its record) is a small black dot;
  * the global batch: the sequences whose gradients each step averaged (it shrinks while a replica is out,
    and is 0 on a discarded step).

The title says what the run's summary says (:func:`~hsdp.apps.train.elastic_run.membership`): the committed and
discarded steps and the steps at which the members changed.
"""

from __future__ import annotations

from typing import Any

from hsdp.apps.train.elastic_run import membership
from hsdp.apps.train.report_canvas import TALL, figure

_MEMBER, _DISCARDED, _BATCH = "tab:blue", "tab:red", "tab:olive"
_BAR = 0.6  # a row's bar height (rows are one apart)
_CHANGES_SHOWN = 6  # membership changes the title lists; a longer run shows the first and the last ones


def is_elastic(records: list[dict[str, Any]]) -> bool:
    """Whether ``records`` are an elastic run's (they name each step's members)."""
    return any("replicas" in r for r in records)


def member_spans(records: list[dict[str, Any]]) -> dict[int, list[tuple[int, int]]]:
    """Replica id -> its runs of consecutive member steps, as ``(first step, step count)``; a step missing from
    the records ends a run (nothing says who trained it)."""
    spans: dict[int, list[tuple[int, int]]] = {}
    previous: dict[int, int] = {}  # id -> the last step it was a member of
    for r in sorted((r for r in records if "replicas" in r), key=lambda r: r["step"]):
        for replica in r["replicas"]:
            runs = spans.setdefault(replica, [])
            if previous.get(replica) == r["step"] - 1:
                first, count = runs[-1]
                runs[-1] = (first, count + 1)
            else:
                runs.append((r["step"], 1))
            previous[replica] = r["step"]
    return dict(sorted(spans.items()))


def membership_title(records: list[dict[str, Any]]) -> str:
    """The figure's title, two lines: committed and discarded steps; the steps where the members changed."""
    said = membership([r for r in records if "replicas" in r])
    lost = said["discarded"]
    listed = f" (steps {_shorten([str(s) for s in lost], 8)})" if lost else ""
    changes = _shorten([f"{c['step']}: {c['replicas']}" for c in said["membership"]], _CHANGES_SHOWN)
    return (f"Replicas per step: {said['committed']} steps committed, {len(lost)} discarded{listed}\n"
            f"members from step {changes}")


def _shorten(items: list[str], most: int) -> str:
    if len(items) <= most:
        return ", ".join(items)
    head, tail = items[:most // 2], items[len(items) - (most - most // 2):]
    return f"{', '.join(head)}, ... ({len(items) - most} more), {', '.join(tail)}"


def membership_figure(records: list[dict[str, Any]]) -> Any:
    """The two panels (see the module docstring); ``records`` as :func:`~hsdp.apps.train.metrics.read_metrics`
    returns them."""
    elastic = sorted((r for r in records if "replicas" in r), key=lambda r: r["step"])
    fig, (member_ax, batch_ax) = figure(rows=2, size=TALL)
    spans = member_spans(elastic)
    for replica, runs in spans.items():
        member_ax.broken_barh([(first - 0.5, count) for first, count in runs], (replica - _BAR / 2, _BAR),
                              color=_MEMBER, label=f"replica {replica}")
    lost = [(r["step"], replica) for r in elastic if not r["committed"] for replica in r["replicas"]]
    if lost:
        member_ax.scatter([s for s, _ in lost], [i for _, i in lost], marker="x", color=_DISCARDED, s=60,
                          zorder=3, label="discarded step (applied nowhere)")
    writers = [(r["step"], r["writer"]) for r in elastic if r.get("writer") is not None]
    if writers:
        member_ax.scatter([s for s, _ in writers], [w for _, w in writers], marker=".", color="black", s=8,
                          zorder=4, label="writer of the record")
    ids = list(spans)
    member_ax.set_yticks(ids, [f"replica {i}" for i in ids])
    # Replica 0 on top, and a free band above it for the legend (it must not hide a bar).
    member_ax.set_ylim(max(ids, default=0) + 0.7, min(ids, default=0) - 1.5)
    member_ax.set_title(membership_title(elastic), fontsize="medium")
    member_ax.legend(handles=member_ax.collections[len(spans):], fontsize="small", loc="upper right", ncols=2)
    batch = [(r["step"], r.get("global_batch") or 0) for r in elastic]
    batch_ax.step([s for s, _ in batch], [b for _, b in batch], where="mid", color=_BATCH, label="global batch")
    batch_ax.set(title="Global batch: sequences whose gradients were averaged (0: discarded)", xlabel="step",
                 ylabel="sequences")
    batch_ax.set_ylim(0, max([b for _, b in batch] + [1]) * 1.15)
    batch_ax.legend(fontsize="small", loc="lower right")
    return fig
