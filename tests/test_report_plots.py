"""The plots: ``hsdp report``'s figures of a run and ``hsdp plan --plot``, read back as images and figures.

No training run: the metrics are synthetic records written with the real ``MetricsWriter`` (and a
``summary.json`` by hand), so the test knows every value a panel must show. An elastic run's records (members,
committed, global batch, writer per step) add the membership figure, whose bars and marks are read back
against the scenario the records describe.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from matplotlib.colors import to_hex
from matplotlib.image import imread
from PIL import Image
from rich.console import Console

from hsdp.apps.cli import build_parser, main
from hsdp.apps.cli.plan import build_plan
from hsdp.apps.train.elastic_run import ELASTIC_FIELDS, membership
from hsdp.apps.train.metrics import MetricsWriter
from hsdp.apps.train.report import report_figures, training_figure, write_report
from hsdp.apps.train.summary import run_table
from hsdp.tools.planner.plot import MEMORY_COLOURS, TIME_COLOURS, plan_figure

_PLAN_ARGS = ["plan", "--model", "7b", "--nodes", "16", "--gpus-per-node", "8", "--gpu-memory", "80GiB",
              "--intra-node-bandwidth", "450GB/s", "--inter-node-bandwidth", "50GB/s",
              "--shard-optimizer-across-replicas", "off"]  # with it S=1 fits too (71.4 GiB)


def _records(steps: int) -> list[dict[str, Any]]:
    # Collectives summing past the step (0.05 + ~0.02 s against 0.06 s): they overlap, as on a real run.
    return [{"step": s, "loss": 5.0 / s ** 0.3, "eval_loss": 5.2 / s ** 0.3 if s % 10 == 0 else None,
             "lr": 1e-3 * min(1.0, s / 4), "grad_norm": 10.0 / s, "tokens": 2048 * s, "step_s": 0.06,
             "tokens_per_s": 20_000 + 50 * (s % 7), "shard_bytes": 1.2e6, "replicate_bytes": 4.4e5,
             "shard_s": 0.05, "replicate_s": 0.02 + 0.001 * (s % 5), "exposed_comm_s": 0.01 + 0.001 * (s % 3),
             "mem_bytes": 3e8 + 1e6 * s}
            for s in range(1, steps + 1)]


def _run_dir(tmp_path: Path, steps: int, peaks: list[float] | None = None) -> Path:
    with MetricsWriter(str(tmp_path)) as w:
        for r in _records(steps):
            w.write(r)
    if peaks is not None:  # the end-of-run summary's per-rank records (only the field the report reads)
        ranks = [{"rank": i, "peak_bytes": p} for i, p in enumerate(peaks)]
        (tmp_path / "summary.json").write_text(json.dumps({"ranks": ranks}))
    return tmp_path


# An elastic run of 3 replicas (sequences per replica and step: 4): replica 2 dies during step 6 (discarded on
# all three), is out for steps 7-12 and rejoins at 13; replica 0, the writer, dies during step 16 (discarded),
# and replica 1 writes from step 17 on.
_SHARE, _DISCARDED = 4, (6, 16)


def _members(step: int) -> list[int]:
    return [0, 1, 2] if step <= 6 or 13 <= step <= 16 else [0, 1] if step < 13 else [1, 2]


def _elastic_records(steps: int = 20) -> list[dict[str, Any]]:
    out = []
    for r in _records(steps):
        members, committed = _members(r["step"]), r["step"] not in _DISCARDED
        out.append({**r, "committed": committed, "replicas": members, "writer": min(members),
                    "global_batch": _SHARE * len(members) if committed else 0,
                    "grad_norm": r["grad_norm"] if committed else None})
    return out


def _elastic_run_dir(tmp_path: Path) -> Path:
    with MetricsWriter(str(tmp_path), fields=ELASTIC_FIELDS) as w:
        for r in _elastic_records():
            w.write(r)
    return tmp_path


def _colour_pixels(img: Image.Image, rgb: tuple[int, int, int], tol: int = 30) -> int:
    a = np.asarray(img.convert("RGB")).astype(int)
    return int((np.abs(a - np.array(rgb)).max(axis=2) <= tol).sum())


def _line(ax: Any, label: str) -> tuple[list[float], list[float]]:
    (line,) = [ln for ln in ax.get_lines() if ln.get_label() == label]
    return list(line.get_xdata()), list(line.get_ydata())


def test_report_writes_pngs_with_the_plotted_series(tmp_path: Path) -> None:
    paths = write_report(str(_run_dir(tmp_path, 40, peaks=[3.5e8, 3.6e8])))
    names = ["loss.png", "throughput.png", "communication.png", "training.png"]
    assert [Path(p).name for p in paths] == names
    blue, orange, green, red = (31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40)
    purple, brown, cyan = (148, 103, 189), (140, 86, 75), (23, 190, 207)
    expected = {"loss.png": [blue, orange], "throughput.png": [green], "communication.png": [blue, red],
                "training.png": [purple, brown, cyan]}
    sizes = {"training.png": (800, 750)}  # three panels; the others one or two
    for path in paths:
        img = Image.open(path)
        assert img.size == sizes.get(Path(path).name, (800, 450))
        assert imread(path).shape[:2] == img.size[::-1]  # a PNG matplotlib reads back, not just a file
        assert len(img.convert("RGB").getcolors(maxcolors=1 << 16) or []) > 20  # not blank: lines, text
        for colour in expected[Path(path).name]:
            assert _colour_pixels(img, colour) > 100, (path, colour)
    with pytest.raises(ValueError, match="missing or empty"):
        write_report(str(tmp_path / "nothing"))


def test_every_report_step_axis_has_whole_steps(tmp_path: Path) -> None:
    figures = report_figures(str(_run_dir(tmp_path, 5)))  # 5 steps: matplotlib alone ticks at 1.5, 2.5, ...
    for name, draw in figures.items():
        for ax in draw().axes:
            ticks = [t for t in ax.get_xticks() if 1 <= t <= 5]
            assert len(ticks) >= 3 and all(float(t).is_integer() for t in ticks), (name, ax.get_title(), ticks)


def test_communication_plots_exposed_time_and_step_time_next_to_time_inside_collectives(tmp_path: Path) -> None:
    records = _records(12)
    sent_ax, time_ax = report_figures(str(_run_dir(tmp_path, 12)))["communication.png"]().axes
    assert sent_ax.get_ylabel() == "KiB sent" and _line(sent_ax, "shard (intra-node)")[1] == [1.2e6 / 1024] * 12
    assert "overlapped or not" in time_ax.get_title() and time_ax.get_ylabel() == "seconds"
    # The step time is on the same axis as the collectives: a shaded area under rank 0's step seconds, the
    # exposed communication a darker area inside it.
    area, exposed = time_ax.collections
    assert area.get_label() == "step time" and exposed.get_label() == "exposed (waited)"
    assert np.isclose(area.get_paths()[0].vertices[:, 1].max(), 0.06)
    assert np.isclose(exposed.get_paths()[0].vertices[:, 1].max(), max(r["exposed_comm_s"] for r in records))
    assert _line(time_ax, "inside shard collectives") == ([r["step"] for r in records], [0.05] * 12)
    assert _line(time_ax, "inside replicate collectives")[1] == [r["replicate_s"] for r in records]
    legend = [t.get_text() for t in time_ax.get_legend().get_texts()]
    assert legend == ["step time", "exposed (waited)", "inside shard collectives", "inside replicate collectives"]


def test_training_figure_plots_lr_grad_norm_and_memory_per_rank(tmp_path: Path) -> None:
    records = _records(30)
    run = _run_dir(tmp_path, 30, peaks=[3.5e8, 3.7e8, 3.6e8])
    lr_ax, norm_ax, mem_ax = report_figures(str(run))["training.png"]().axes
    assert [ax.get_title() for ax in (lr_ax, norm_ax)] == ["Learning rate", "Gradient norm (before clipping)"]
    steps = [r["step"] for r in records]
    assert _line(lr_ax, "lr") == (steps, [r["lr"] for r in records])
    assert _line(norm_ax, "grad norm")[1] == [r["grad_norm"] for r in records]
    assert norm_ax.get_yscale() == "linear"  # 10 .. 0.33: a 30x range stays linear
    spiky = [{**r, "grad_norm": 1e3 if r["step"] == 1 else 1.0} for r in records]
    assert training_figure(spiky).axes[1].get_yscale() == "log"  # a spike must not flatten the rest
    assert mem_ax.get_title().startswith("Peak memory") and mem_ax.get_ylabel() == "MiB"
    assert _line(mem_ax, "rank 0, peak so far")[1] == pytest.approx([r["mem_bytes"] / 2**20 for r in records])
    (ends,) = mem_ax.collections  # every rank's end-of-run peak, at the last step
    assert ends.get_label() == "ranks 0-2 at the end"
    expected = [[30, 3.5e8 / 2**20], [30, 3.7e8 / 2**20], [30, 3.6e8 / 2**20]]
    assert np.allclose(np.asarray(ends.get_offsets()), expected)
    # A run still going has no summary.json: the panel shows rank 0's series alone.
    (tmp_path / "summary.json").unlink()
    assert not report_figures(str(run))["training.png"]().axes[2].collections


def test_plan_plot_has_a_log_memory_axis_and_one_colour_meaning(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture) -> None:
    assert main([*_PLAN_ARGS, "--plot", str(tmp_path / "p.png")]) == 0
    assert "plot:" in capsys.readouterr().out
    img = Image.open(tmp_path / "p.png")
    assert img.size == (1320, 495)  # 12 x 4.5 inches at 110 dpi
    assert imread(tmp_path / "p.png").shape[:2] == (495, 1320)
    plan = build_plan(build_parser().parse_args(_PLAN_ARGS))
    mem_ax, time_ax = plan_figure(plan).axes
    assert mem_ax.get_yscale() == "log" and time_ax.get_yscale() == "linear"
    bottom, top = mem_ax.get_ylim()
    totals = [e.memory.total / 2**30 for e in plan.layouts]
    assert bottom > 0 and bottom < min(totals) and top > max(totals)
    assert len(set(MEMORY_COLOURS.values()) | set(TIME_COLOURS.values())) == len(MEMORY_COLOURS) + len(TIME_COLOURS)
    fits = [e.fits for e in plan.layouts]
    assert fits[0] is False and all(fits[1:])  # S=1 is over 80 GiB: the rest fit
    for ax, colours in ((mem_ax, MEMORY_COLOURS), (time_ax, TIME_COLOURS)):
        for bars in ax.containers:  # each kind keeps its panel's colour; only unfitting layouts are hatched
            assert {to_hex(b.get_facecolor(), keep_alpha=False) for b in bars} == {colours[bars.get_label()]}
            assert [bool(b.get_hatch()) for b in bars] == [not ok for ok in fits]
        labels = ax.get_xticklabels()
        assert [t.get_text() for t in labels] == [str(e.layout.shard) for e in plan.layouts]
        assert [to_hex(t.get_color()) == "#000000" for t in labels] == fits
        assert [t.get_fontweight() == "bold" for t in labels] == [e is plan.best for e in plan.layouts]
        assert "does not fit" in [t.get_text() for t in ax.get_legend().get_texts()]


def test_an_elastic_run_adds_the_membership_figure(tmp_path: Path) -> None:
    paths = write_report(str(_elastic_run_dir(tmp_path)))
    assert [Path(p).name for p in paths][-1] == "membership.png"  # the other runs' four come first
    img = Image.open(paths[-1])
    assert img.size == (800, 750)
    for colour in ((31, 119, 180), (214, 39, 40), (188, 189, 34)):  # member bars, discarded marks, batch line
        assert _colour_pixels(img, colour) > 100, colour


def test_membership_figure_bars_each_replicas_member_steps_and_marks_the_discarded_ones(tmp_path: Path) -> None:
    member_ax, batch_ax = report_figures(str(_elastic_run_dir(tmp_path)))["membership.png"]().axes
    bars = {c.get_label(): c for c in member_ax.collections if c.get_label().startswith("replica ")}
    assert list(bars) == ["replica 0", "replica 1", "replica 2"]
    # Each bar spans whole steps (first - 0.5 .. last + 0.5) on its replica's row.
    expected = {0: [(1, 16)], 1: [(1, 20)], 2: [(1, 6), (13, 20)]}  # replica 0 left after 16, 2 for 7-12
    for replica, runs in expected.items():
        boxes = [(p.vertices[:, 0].min(), p.vertices[:, 0].max(), (p.vertices[:, 1].min() + p.vertices[:, 1].max()) / 2)
                 for p in bars[f"replica {replica}"].get_paths()]
        assert [(lo, hi) for lo, hi, _ in boxes] == [(first - 0.5, last + 0.5) for first, last in runs], replica
        assert all(np.isclose(y, replica) for _, _, y in boxes)
    (lost,) = [c for c in member_ax.collections if c.get_label().startswith("discarded")]
    marked = sorted(map(tuple, np.asarray(lost.get_offsets()).tolist()))
    assert marked == [(float(s), float(r)) for s in _DISCARDED for r in (0, 1, 2)]  # every member of each
    (writers,) = [c for c in member_ax.collections if c.get_label() == "writer of the record"]
    assert [tuple(o) for o in np.asarray(writers.get_offsets()).tolist()] == [
        (float(s), float(min(_members(s)))) for s in range(1, 21)]
    assert [t.get_text() for t in member_ax.get_yticklabels()] == ["replica 0", "replica 1", "replica 2"]
    assert member_ax.get_ylim()[0] > 2 > 0 > member_ax.get_ylim()[1]  # replica 0 on top
    title = member_ax.get_title()
    assert "18 steps committed, 2 discarded (steps 6, 16)" in title, title
    assert "members from step 1: [0, 1, 2], 7: [0, 1], 13: [0, 1, 2], 17: [1, 2]" in title, title
    steps, batch = _line(batch_ax, "global batch")
    assert steps == list(range(1, 21))
    assert batch == [0 if s in _DISCARDED else _SHARE * len(_members(s)) for s in steps]
    assert batch[:7] == [12, 12, 12, 12, 12, 0, 8] and batch_ax.get_ylabel() == "sequences"
    for ax in (member_ax, batch_ax):
        ticks = [t for t in ax.get_xticks() if 1 <= t <= 20]
        assert len(ticks) >= 3 and all(float(t).is_integer() for t in ticks), ticks


def test_the_run_summary_says_the_same_membership_changes() -> None:
    records = _elastic_records()
    said = membership(records)  # the summary.json's "elastic" part (with the replica and the configured count)
    assert said["discarded"] == list(_DISCARDED) and said["committed"] == 18 and said["writers"] == [0, 1]
    assert said["membership"] == [{"step": 1, "replicas": [0, 1, 2]}, {"step": 7, "replicas": [0, 1]},
                                  {"step": 13, "replicas": [0, 1, 2]}, {"step": 17, "replicas": [1, 2]}]
    summary = {"mesh": {"replicas": 3, "shards": 2, "world": 2}, "model": {"kind": "gpt", "preset": "tiny",
               "params": 1000}, "steps": {"first": 1, "last": 20, "planned": 20}, "loss_first": None,
               "eval_loss_last": None, "tokens_per_s": 1.0, "tokens": 1, "seconds": 1.0,
               "elastic": {"replica": 1, "replicas": 3, **said}}
    console = Console(record=True, width=300)
    console.print(run_table(summary, "data"))
    text = console.export_text()
    assert ("18 steps committed, 2 discarded [6, 16]; members from step 1: [0, 1, 2], 7: [0, 1], 13: [0, 1, 2], "
            "17: [1, 2]") in text, text
