"""The canvas ``hsdp report``'s figures are drawn on (``report.py``, ``report_membership.py``): one size, whole
steps on every x axis."""

from __future__ import annotations

from typing import Any

DPI = 100
SIZE = (8, 4.5)  # inches: 800 x 450 pixels at DPI
TALL = (8, 7.5)  # three stacked panels: 800 x 750 pixels


def figure(rows: int = 1, size: tuple[float, float] = SIZE) -> tuple[Any, Any]:
    """A bare matplotlib ``Figure`` (no pyplot state) of ``rows`` stacked panels sharing a whole-step x axis;
    the figure and its axes."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=size, dpi=DPI)
    axes = fig.subplots(rows, 1, sharex=True)
    for ax in axes if rows > 1 else [axes]:
        _step_axis(ax)
    return fig, axes


def _step_axis(ax: Any) -> None:
    # Steps are whole numbers: without this a short run gets ticks at 2.5, 7.5.
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
