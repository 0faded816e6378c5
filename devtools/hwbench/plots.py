"""The study's PNGs (matplotlib, no display needed): tokens/s and p99 latency against
concurrency per GPU kind, and $/Mtok against tokens/s with the Pareto frontier."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on a server
import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from devtools.hwbench.results import Point

SIZE_PX = (800, 500)
_DPI = 100


def draw(out: Path, points: list[Point]) -> list[Path]:
    files = [
        _by_concurrency(
            out / "throughput.png",
            points,
            lambda p: p.output_tokens_per_s,
            "output tokens/s",
            "Throughput by concurrency",
        ),
        _by_concurrency(
            out / "latency_p99.png",
            points,
            lambda p: p.latency_p99_s,
            "p99 request latency, s",
            "p99 latency by concurrency",
        ),
    ]
    if any(p.usd_per_mtok is not None for p in points):
        files.append(_frontier(out / "cost_frontier.png", points))
    return files


def _figure() -> tuple[Figure, Axes]:
    return plt.subplots(figsize=(SIZE_PX[0] / _DPI, SIZE_PX[1] / _DPI), dpi=_DPI)


def _save(fig: Figure, path: Path) -> Path:
    fig.savefig(path, dpi=_DPI)
    plt.close(fig)
    return path


def _by_concurrency(
    path: Path, points: list[Point], value: Callable[[Point], float | None], label: str, title: str
) -> Path:
    fig, ax = _figure()
    for gpu in sorted({p.gpu for p in points}):
        mine = [(p.concurrency, value(p)) for p in points if p.gpu == gpu and value(p) is not None]
        if mine:
            ax.plot(*zip(*sorted(mine), strict=True), marker="o", label=gpu)
    ax.set_xscale("log", base=2)
    ax.set(xlabel="concurrency", ylabel=label, title=title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return _save(fig, path)


def _frontier(path: Path, points: list[Point]) -> Path:
    fig, ax = _figure()
    priced = [(p.usd_per_mtok, p) for p in points if p.usd_per_mtok is not None]
    for gpu in sorted({p.gpu for _, p in priced}):
        mine = [(usd, p) for usd, p in priced if p.gpu == gpu]
        ax.scatter([p.output_tokens_per_s for _, p in mine], [usd for usd, _ in mine], label=gpu)
    frontier = sorted(
        ((usd, p) for usd, p in priced if p.on_frontier),
        key=lambda pair: pair[1].output_tokens_per_s,
    )
    ax.plot(
        [p.output_tokens_per_s for _, p in frontier],
        [usd for usd, _ in frontier],
        color="black",
        linestyle="--",
        label="Pareto frontier",
    )
    for usd, p in frontier:
        ax.annotate(
            f"{p.gpu} c={p.concurrency}",
            (p.output_tokens_per_s, usd),
            textcoords="offset points",
            xytext=(4, 4),
            fontsize=8,
        )
    ax.set(
        xlabel="output tokens/s",
        ylabel="$ per million output tokens",
        title="Cost against throughput (lower right is better)",
    )
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return _save(fig, path)
