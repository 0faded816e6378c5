"""Soak (issue #13): the whole mesh under a steady mixed load; nothing may grow.

    .venv/bin/python bench/soak.py [--duration 600] [--window 60] [--concurrency 64]

Starts Redis, the router, one simulated worker (the H200 roofline: about 2 ms per decode
step, so streams are still running when a client drops them) and the gateway as processes.
After a warm-up at the same load (``--window`` seconds, then a second's pause), closed-loop
clients send chat completions for ``--duration`` seconds with four API keys (one with
``max_concurrent``, so concurrency leases are taken and freed): 45 % non-streamed, 45 %
streamed, 10 % streamed and dropped by the client after the first content chunk.

Every request counts: the warm-up's (a row of its own) and the load's tail (those still running
when the load stops end in the last window). Prints, per window: requests, errors, p99 latency
of the completed requests, and per service RSS, open file descriptors and asyncio tasks (the
``infermesh_asyncio_tasks`` metric), Redis keys, and the requests in flight (mean and least of
samples every 0.1 s, from the requests' own start and end times); then the checks: 0 errors
other than the disconnects (warm-up included), RSS at the end within 10 % of the first window's,
p99 of the last window within 20 % of the second's, and, idle after the load against idle after
the warm-up, no more file descriptors or tasks, the same Redis keys and no concurrency lease
left.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import dataclasses
import functools
import random
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import aiohttp
import psutil
import redis.asyncio as aioredis

from bench.mesh_load import Kind, MeshLoad, Outcome, simulated_mesh
from devtools.mesh import Mesh, MeshSpec
from devtools.redis_server import RedisServer
from gateway.accounts.keys import create_key
from infermesh.ports import free_port
from worker_svc.config import DEFAULT_MODEL_PATH

SERVICES = ("gateway", "router", "worker0")
_MIX: tuple[tuple[Kind, float], ...] = (("plain", 0.45), ("stream", 0.45), ("disconnect", 0.10))
_KEYS = 4
_IDLE_S = 1.0  # pause before an idle snapshot: settlements and closes finish
_SAMPLE_S = 0.1  # between two samples of the requests in flight


@dataclasses.dataclass(frozen=True)
class Snapshot:
    at_s: float
    rss_mb: dict[str, float]
    fds: dict[str, int]  # but the Redis pool's connections (bounded by [redis] max_connections)
    tasks: dict[str, int]
    redis_keys: int
    leases: int  # members of the concurrency lease sets


@dataclasses.dataclass(frozen=True)
class InFlight:
    """Requests in flight over a window, sampled every _SAMPLE_S."""

    mean: float
    least: int


@dataclasses.dataclass
class SoakResult:
    warmup: list[Outcome]
    # each window's end snapshot and the requests that ended in it (the last window: also
    # those that ended after it, the load's tail)
    windows: list[tuple[Snapshot, list[Outcome]]]
    in_flight: list[InFlight]  # per window
    idle_before: Snapshot
    idle_after: Snapshot

    def errors(self) -> list[Outcome]:
        measured = [o for _, outcomes in self.windows for o in outcomes]
        return [o for o in self.warmup + measured if is_error(o)]

    def p99_ms(self, window: int) -> float:
        latencies = sorted(
            o.latency_s for o in self.windows[window][1] if o.ok and o.kind != "disconnect"
        )
        return latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))] * 1000


def is_error(outcome: Outcome) -> bool:
    """A request that failed, other than by its client dropping the stream."""
    return not outcome.ok


def mesh_spec(redis_url: str, log_dir: Path, gpu: str) -> MeshSpec:
    """The simulated mesh as a ``gpu`` would serve it, its metrics ports open for the leak reads."""
    return simulated_mesh(
        redis_url,
        log_dir,
        {
            "INFERMESH_WORKER_ENGINE_GPU": gpu,
            "INFERMESH_ROUTER_METRICS_PORT": str(free_port()),
            "INFERMESH_WORKER_METRICS_PORT": str(free_port()),
        },
    )


class _Probe:
    """Reads what may leak: per service RSS, fds and tasks; Redis keys and leases."""

    def __init__(self, mesh: Mesh, redis_url: str, session: aiohttp.ClientSession) -> None:
        env = mesh.spec.env
        self._procs = {name: psutil.Process(mesh.pid(name)) for name in SERVICES}
        self._metrics = {
            "gateway": f"http://127.0.0.1:{mesh.spec.gateway_port}/metrics",
            "router": f"http://127.0.0.1:{env['INFERMESH_ROUTER_METRICS_PORT']}/metrics",
            "worker0": f"http://127.0.0.1:{env['INFERMESH_WORKER_METRICS_PORT']}/metrics",
        }
        self._redis = aioredis.Redis.from_url(redis_url)
        self._redis_port = urlparse(redis_url).port
        self._session = session
        self._start = time.monotonic()

    async def snapshot(self) -> Snapshot:
        tasks = {name: await self._tasks(url) for name, url in self._metrics.items()}
        leases = 0
        async for name in self._redis.scan_iter(match="infermesh:rl:*:inflight"):
            leases += await self._redis.zcard(name)
        # one marker per settled request, expiring on its own (gateway.accounts.limits): not growth
        settled = sum(
            [1 async for _ in self._redis.scan_iter(match="infermesh:settled:*", count=1000)]
        )
        return Snapshot(
            at_s=time.monotonic() - self._start,
            rss_mb={n: p.memory_info().rss / 2**20 for n, p in self._procs.items()},
            fds={n: p.num_fds() - self._redis_connections(p) for n, p in self._procs.items()},
            tasks=tasks,
            redis_keys=await self._redis.dbsize() - settled,
            leases=leases,
        )

    def _redis_connections(self, process: psutil.Process) -> int:
        """A pool opens one more at a new peak of concurrent calls, up to its bound: no leak."""
        return sum(
            1
            for c in process.net_connections(kind="tcp")
            if c.raddr and c.raddr.port == self._redis_port
        )

    async def _tasks(self, url: str) -> int:
        async with self._session.get(url) as response:
            for line in (await response.text()).splitlines():
                if line.startswith("infermesh_asyncio_tasks "):
                    return int(float(line.split()[1]))
        raise RuntimeError(f"{url} has no infermesh_asyncio_tasks")

    async def close(self) -> None:
        await self._redis.aclose()


def _pick() -> Kind:
    return random.choices([k for k, _ in _MIX], [w for _, w in _MIX])[0]


async def _soak(
    mesh: Mesh, redis_url: str, duration_s: float, window_s: float, concurrency: int
) -> SoakResult:
    client = aioredis.Redis.from_url(redis_url)
    keys = [
        await create_key(client, f"soak-{i}", **({"max_concurrent": concurrency} if i == 0 else {}))
        for i in range(_KEYS)
    ]
    await client.aclose()
    load = functools.partial(_load, mesh.spec.base_url, keys, concurrency)
    async with aiohttp.ClientSession() as session:
        probe = _Probe(mesh, redis_url, session)
        try:
            warmup: list[Outcome] = []
            await load(time.monotonic() + window_s, warmup)
            # Idle snapshots come after the load's connections closed: the gateway then
            # holds only what it keeps for itself.
            await asyncio.sleep(_IDLE_S)
            idle_before = await probe.snapshot()
            windows, in_flight = await _measured(load, probe, duration_s, window_s)
            await asyncio.sleep(_IDLE_S)
            idle_after = await probe.snapshot()
        finally:
            await probe.close()
    return SoakResult(warmup, windows, in_flight, idle_before, idle_after)


async def _load(
    base_url: str, keys: list[str], concurrency: int, until: float, outcomes: list[Outcome]
) -> None:
    """``concurrency`` clients spread over ``keys`` until ``until``, on connections of their own."""
    model = Path(DEFAULT_MODEL_PATH).name
    per_key = [concurrency // len(keys) + (i < concurrency % len(keys)) for i in range(len(keys))]
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        await asyncio.gather(
            *(
                MeshLoad(session, base_url, key, model).run(c, until, _pick, outcomes)
                for key, c in zip(keys, per_key, strict=True)
            )
        )


async def _measured(
    load: Callable[[float, list[Outcome]], Coroutine[Any, Any, None]],
    probe: _Probe,
    duration_s: float,
    window_s: float,
) -> tuple[list[tuple[Snapshot, list[Outcome]]], list[InFlight]]:
    outcomes: list[Outcome] = []
    start = time.monotonic()
    running = asyncio.create_task(load(start + duration_s, outcomes))
    ends = [start + window_s * (i + 1) for i in range(max(1, round(duration_s / window_s)))]
    snapshots = []
    for end in ends:
        await asyncio.sleep(max(0.0, end - time.monotonic()))
        snapshots.append(await probe.snapshot())
    await running  # the tail: requests still running at the last window's end
    bounds = [end - window_s for end in ends]
    windows = [(snapshot, list[Outcome]()) for snapshot in snapshots]
    for o in outcomes:
        windows[max(0, bisect.bisect_right(bounds, o.ended) - 1)][1].append(o)
    return windows, [_in_flight(outcomes, end - window_s, end) for end in ends]


def _in_flight(outcomes: list[Outcome], start: float, end: float) -> InFlight:
    """The requests in flight between ``start`` and ``end``, sampled every _SAMPLE_S from
    their start and end times."""
    starts = sorted(o.started for o in outcomes)
    ends = sorted(o.ended for o in outcomes)
    samples = [
        bisect.bisect_right(starts, t) - bisect.bisect_right(ends, t)
        for t in (start + i * _SAMPLE_S for i in range(max(1, round((end - start) / _SAMPLE_S))))
    ]
    return InFlight(sum(samples) / len(samples), min(samples))


def run(
    workdir: Path, duration_s: float, window_s: float, concurrency: int, gpu: str = "H200"
) -> SoakResult:
    """The whole soak on a fresh Redis and mesh; returns what was measured."""
    with (
        RedisServer(workdir=workdir) as redis_server,
        Mesh(mesh_spec(redis_server.url, workdir, gpu)) as mesh,
    ):
        return asyncio.run(_soak(mesh, redis_server.url, duration_s, window_s, concurrency))


def _print(result: SoakResult) -> None:
    print(
        f"{'t s':>6} {'reqs':>6} {'errors':>6} {'p99 ms':>7} "
        + " ".join(f"{n + ' rss/fd/tasks':>22}" for n in SERVICES)
        + f" {'redis':>6} {'in flight mean/least':>20}"
    )
    warmup = sum(1 for o in result.warmup if is_error(o))
    print(f"{'warm-up':>6} {len(result.warmup):>6} {warmup:>6}")
    rows = [
        (result.idle_before, [], None),
        *((s, o, f) for (s, o), f in zip(result.windows, result.in_flight, strict=True)),
        (result.idle_after, [], None),
    ]
    for snapshot, outcomes, in_flight in rows:
        errors = sum(1 for o in outcomes if is_error(o))
        p99 = sorted(o.latency_s for o in outcomes if o.ok and o.kind != "disconnect") or [0]
        print(
            f"{snapshot.at_s:>6.0f} {len(outcomes):>6} {errors:>6} "
            f"{p99[min(len(p99) - 1, int(0.99 * len(p99)))] * 1000:>7.1f} "
            + " ".join(
                f"{snapshot.rss_mb[n]:>10.1f}/{snapshot.fds[n]:>4}/{snapshot.tasks[n]:>5}"
                for n in SERVICES
            )
            + f" {snapshot.redis_keys:>6}"
            + (f" {in_flight.mean:>15.1f}/{in_flight.least:>4}" if in_flight else "")
        )
    first, last = result.windows[0][0], result.windows[-1][0]
    before, after = result.idle_before, result.idle_after
    every = result.warmup + [o for _, w in result.windows for o in w]
    by_kind = {k: sum(1 for o in every if o.kind == k) for k, _ in _MIX}
    print(
        f"requests by kind (warm-up included): {by_kind}; errors other than the disconnects: "
        f"{len(result.errors())}"
    )
    for name in SERVICES:
        print(
            f"{name}: RSS {first.rss_mb[name]:.1f} -> {last.rss_mb[name]:.1f} MB "
            f"({(last.rss_mb[name] / first.rss_mb[name] - 1) * 100:+.1f} %); idle fds "
            f"{before.fds[name]} -> {after.fds[name]}, idle tasks {before.tasks[name]} -> "
            f"{after.tasks[name]}"
        )
    print(f"redis keys idle {before.redis_keys} -> {after.redis_keys}; leases left {after.leases}")
    if len(result.windows) >= 2:
        second, final = result.p99_ms(1), result.p99_ms(-1)
        print(
            f"p99 second window {second:.1f} ms, last window {final:.1f} ms "
            f"({(final / second - 1) * 100:+.1f} %)"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of measured load")
    parser.add_argument("--window", type=float, default=60.0, help="seconds per window")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--gpu", default="H200", help="the simulated worker's GPU profile")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        print(
            f"python {sys.version.split()[0]}, {psutil.cpu_count()} cores; "
            f"{args.duration:.0f} s at c={args.concurrency}, windows of {args.window:.0f} s, "
            f"simulated {args.gpu}",
            flush=True,
        )
        _print(run(Path(workdir), args.duration, args.window, args.concurrency, args.gpu))
    return 0


if __name__ == "__main__":
    sys.exit(main())
