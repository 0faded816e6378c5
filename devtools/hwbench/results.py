"""From samples to the study's points: percentiles, throughput, cost per million output
tokens, and the cost-throughput Pareto frontier."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from devtools.hwbench.fleet import Kind
from devtools.hwbench.load import Sample


@dataclass(frozen=True)
class Point:
    """One GPU kind at one concurrency."""

    gpu: str
    concurrency: int
    requests: int
    errors: int
    latency_p50_s: float | None
    latency_p99_s: float | None
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    time_per_output_token_s: float | None  # after the first token, mean over requests
    output_tokens_per_s: float  # mean over the repeats
    requests_per_s: float
    prompt_tokens: float  # mean, as the workers counted them
    output_tokens: float
    precision: str
    workers: int
    gpus_per_worker: int
    memory_used_gb: float  # the most one worker reported while the point ran
    memory_total_gb: float
    usd_per_gpu_hour: float | None
    usd_per_mtok: float | None  # None: no price, or no token came
    on_frontier: bool = False


@dataclass(frozen=True)
class Run:
    """One repeat of one point: its samples and wall time."""

    samples: list[Sample]
    wall_s: float


def point(
    kind: Kind, concurrency: int, runs: list[Run], memory_used_bytes: int, price: float | None
) -> Point:
    samples = [s for r in runs for s in r.samples]
    ok = [s for s in samples if not s.error]
    tokens_per_s = (
        float(
            np.mean(
                [sum(s.output_tokens for s in r.samples if not s.error) / r.wall_s for r in runs]
            )
        )
        if runs
        else 0.0
    )
    requests_per_s = (
        float(np.mean([sum(1 for s in r.samples if not s.error) / r.wall_s for r in runs]))
        if runs
        else 0.0
    )
    gpus = kind.workers * kind.gpus_per_worker
    cost = (
        price * gpus / 3600 / tokens_per_s * 1e6 if price is not None and tokens_per_s > 0 else None
    )
    tpot = [
        (s.latency_s - s.ttft_s) / (s.output_tokens - 1)
        for s in ok
        if s.ttft_s is not None and s.output_tokens > 1
    ]
    return Point(
        gpu=kind.name,
        concurrency=concurrency,
        requests=len(samples),
        errors=len(samples) - len(ok),
        latency_p50_s=_pct([s.latency_s for s in ok], 50),
        latency_p99_s=_pct([s.latency_s for s in ok], 99),
        ttft_p50_s=_pct([s.ttft_s for s in ok if s.ttft_s is not None], 50),
        ttft_p99_s=_pct([s.ttft_s for s in ok if s.ttft_s is not None], 99),
        time_per_output_token_s=float(np.mean(tpot)) if tpot else None,
        output_tokens_per_s=tokens_per_s,
        requests_per_s=requests_per_s,
        prompt_tokens=float(np.mean([s.prompt_tokens for s in ok])) if ok else 0.0,
        output_tokens=float(np.mean([s.output_tokens for s in ok])) if ok else 0.0,
        precision=kind.precision,
        workers=kind.workers,
        gpus_per_worker=kind.gpus_per_worker,
        memory_used_gb=max(memory_used_bytes, kind.memory_used_bytes) / 1e9,
        memory_total_gb=kind.memory_total_bytes / 1e9,
        usd_per_gpu_hour=price,
        usd_per_mtok=cost,
    )


def dominates(a: Point, b: Point) -> bool:
    """``a`` is at least as cheap and as fast as ``b``, and better in one of the two."""
    assert a.usd_per_mtok is not None and b.usd_per_mtok is not None
    return (
        a.usd_per_mtok <= b.usd_per_mtok
        and a.output_tokens_per_s >= b.output_tokens_per_s
        and (a.usd_per_mtok < b.usd_per_mtok or a.output_tokens_per_s > b.output_tokens_per_s)
    )


def with_frontier(points: list[Point]) -> list[Point]:
    """The points, those no other point dominates in $/Mtok and tokens/s marked on_frontier."""
    priced = [p for p in points if p.usd_per_mtok is not None]
    return [
        dataclasses.replace(
            p, on_frontier=p.usd_per_mtok is not None and not any(dominates(q, p) for q in priced)
        )
        for p in points
    ]


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None
