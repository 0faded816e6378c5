"""Charts as inline SVG, drawn by matplotlib on the server (no script in the browser).

Built with matplotlib's object API (``Figure``), never pyplot's global state, so charts can be
drawn in worker threads; the SVG's text stays text (readable, searchable, zoomable)."""

from __future__ import annotations

import io

import matplotlib
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

matplotlib.rcParams["svg.fonttype"] = "none"  # text as <text>, not paths
matplotlib.rcParams["svg.hashsalt"] = "infermesh-console"  # the same data: the same SVG

_SIZE_IN = (9.0, 3.2)
_MAX_SERIES = 8  # more keys than this: the rest summed as "others"


def stacked_bars(title: str, days: list[str], series: dict[str, list[int]], y_label: str) -> str:
    """One bar per day, stacked by series (e.g. by key)."""
    figure = Figure(figsize=_SIZE_IN, layout="constrained")
    axes = figure.add_subplot()
    bottom = [0] * len(days)
    labels = [d[5:] for d in days]  # MM-DD
    for name, values in _top(series).items():
        axes.bar(labels, values, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    return _svg(figure, axes, title, y_label, bool(series))


def lines(title: str, days: list[str], series: dict[str, list[int]], y_label: str) -> str:
    """One line per series over the days."""
    figure = Figure(figsize=_SIZE_IN, layout="constrained")
    axes = figure.add_subplot()
    labels = [d[5:] for d in days]
    for name, values in _top(series).items():
        axes.plot(labels, values, marker="o", label=name)
    return _svg(figure, axes, title, y_label, bool(series))


def _top(series: dict[str, list[int]]) -> dict[str, list[int]]:
    """The largest series; the others summed into one."""
    ranked = sorted(series.items(), key=lambda item: -sum(item[1]))
    top = dict(ranked[:_MAX_SERIES])
    rest = [values for _, values in ranked[_MAX_SERIES:]]
    if rest:
        top["others"] = [sum(day) for day in zip(*rest, strict=True)]
    return top


def _svg(figure: Figure, axes: Axes, title: str, y_label: str, has_series: bool) -> str:
    axes.set_title(title, loc="left")
    axes.set_ylabel(y_label)
    axes.tick_params(axis="x", labelrotation=45)
    axes.grid(axis="y", alpha=0.3)
    axes.yaxis.set_major_locator(MaxNLocator(integer=True))  # counts: no half requests
    if has_series:
        axes.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    out = io.StringIO()
    figure.savefig(out, format="svg")
    svg = out.getvalue()
    return svg[svg.index("<svg") :]  # inline: without the XML prolog and doctype
