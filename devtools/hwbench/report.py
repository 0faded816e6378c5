"""The study's files: results.json (everything), results.csv (per point), requests.csv (raw),
report.md (the table to paste, the best value per column in bold, and the recommendation).
Written to a scratch folder first and moved in at the end, so a failure leaves no
half-written set; an interrupted study says so in every file."""

from __future__ import annotations

import csv
import dataclasses
import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from devtools.hwbench import plots
from devtools.hwbench.load import Sample
from devtools.hwbench.results import Point

# (header, field, format, best: min or max or None)
_COLUMNS: list[tuple[str, str, Callable[[Any], str], Callable[..., float] | None]] = [
    ("GPUs/worker", "gpus_per_worker", str, None),
    ("precision", "precision", str, None),
    ("memory GB", "memory_used_gb", "{:.1f}".format, None),
    ("p50 latency s", "latency_p50_s", "{:.3f}".format, min),
    ("p99 latency s", "latency_p99_s", "{:.3f}".format, min),
    ("p50 TTFT s", "ttft_p50_s", "{:.3f}".format, min),
    ("p99 TTFT s", "ttft_p99_s", "{:.3f}".format, min),
    ("ms/token", "time_per_output_token_s", lambda s: f"{s * 1000:.1f}", min),
    ("tokens/s", "output_tokens_per_s", "{:.1f}".format, max),
    ("requests/s", "requests_per_s", "{:.2f}".format, max),
    ("errors", "errors", str, min),
    ("$/Mtok", "usd_per_mtok", "{:.2f}".format, min),
]


def write(
    out: Path, meta: dict[str, Any], points: list[Point], samples: list[Sample]
) -> list[Path]:
    """Writes every file into ``out``; returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".partial-", dir=out))
    try:
        _write_json(scratch / "results.json", meta, points, samples)
        _write_csv(scratch / "results.csv", [dataclasses.asdict(p) for p in points])
        _write_csv(scratch / "requests.csv", [dataclasses.asdict(s) for s in samples])
        (scratch / "report.md").write_text(markdown(meta, points))
        plots.draw(scratch, points)
        written = []
        for file in sorted(scratch.iterdir()):
            written.append(file.replace(out / file.name))
        return written
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _write_json(
    path: Path, meta: dict[str, Any], points: list[Point], samples: list[Sample]
) -> None:
    path.write_text(
        json.dumps(
            {
                "meta": meta,
                "points": [dataclasses.asdict(p) for p in points],
                "requests": [dataclasses.asdict(s) for s in samples],
            },
            indent=1,
        )
        + "\n"
    )


def _write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    with path.open("w", newline="") as f:
        if not rows:
            return
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def markdown(meta: dict[str, Any], points: list[Point]) -> str:
    w = meta["workload"]
    lines = [f"# Hardware study: {meta['model']}", ""]
    if not meta["complete"]:
        lines += ["**INTERRUPTED: partial results** (what was measured before Ctrl-C).", ""]
    lines += [
        f"{w['prompt_tokens']}-token prompts, {w['max_tokens']} new tokens, temperature 0; "
        f"{meta['requests']} requests per point, warm-up {meta['warmup']}, "
        f"repeated {meta['repeat']} times; {meta['fleet']}. Prices: {meta['prices']}. "
        f"Best value per column in bold.",
        "",
        "| GPU | concurrency | " + " | ".join(c[0] for c in _COLUMNS) + " |",
        "|---|---:|" + "---:|" * len(_COLUMNS),
    ]
    best = {
        field: pick([getattr(p, field) for p in points if getattr(p, field) is not None], how)
        for _, field, _, how in _COLUMNS
        if how is not None
    }
    best = {k: v for k, v in best.items() if v is not None}
    for p in points:
        cells = []
        for _, field, fmt, _how in _COLUMNS:
            value = getattr(p, field)
            text = "–" if value is None else fmt(value)
            cells.append(f"**{text}**" if field in best and value == best[field] else text)
        lines.append(f"| {p.gpu} | {p.concurrency} | " + " | ".join(cells) + " |")
    return "\n".join([*lines, "", "\n\n".join(recommendation(points)), ""])


def pick(values: list[float], how: Callable[..., float]) -> float | None:
    return how(values) if values else None


def recommendation(points: list[Point]) -> list[str]:
    """Which kind for latency-first and for cost-first serving, and why, from the numbers."""
    ok = [(p.latency_p99_s, p) for p in points if p.latency_p99_s is not None]
    if not ok:
        return ["No point completed a request: no recommendation."]
    lowest = min(p.concurrency for _, p in ok)
    alone = sorted(
        ((latency, p) for latency, p in ok if p.concurrency == lowest), key=lambda pair: pair[0]
    )
    first_latency, first = alone[0]
    text = [
        f"**Latency-first: {first.gpu}.** At concurrency {lowest} its p99 latency is "
        f"{first_latency:.3f} s ({_ms(first.time_per_output_token_s)} per token, TTFT p99 "
        f"{first.ttft_p99_s:.3f} s)"
    ]
    if len(alone) > 1:
        next_latency, runner_up = alone[1]
        text[0] += (
            f", {next_latency / first_latency:.2f}x better than the next, "
            f"{runner_up.gpu} ({next_latency:.3f} s)"
        )
    text[0] += "."
    priced = sorted(
        ((p.usd_per_mtok, p) for _, p in ok if p.usd_per_mtok is not None), key=lambda pair: pair[0]
    )
    if priced:
        cheap_usd, cheap = priced[0]
        line = (
            f"**Cost-first: {cheap.gpu}.** At concurrency {cheap.concurrency} it serves "
            f"{cheap.output_tokens_per_s:.0f} tokens/s on "
            f"{cheap.workers * cheap.gpus_per_worker} GPU(s) "
            f"at ${cheap.usd_per_gpu_hour:.2f}/GPU-hour: "
            f"${cheap_usd:.2f} per million output tokens"
        )
        other = next(((usd, p) for usd, p in priced if p.gpu != cheap.gpu), None)
        if other is not None:
            other_usd, other_point = other
            line += (
                f"; the cheapest other kind, {other_point.gpu}, costs ${other_usd:.2f} "
                f"(at concurrency {other_point.concurrency})"
            )
        text.append(line + ".")
    return text


def _ms(seconds: float | None) -> str:
    return "–" if seconds is None else f"{seconds * 1000:.1f} ms"
