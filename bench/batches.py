"""A batch in the fleet's idle capacity: a large OpenAI batch on the simulated fleet beside a
steady interactive load; batch lines per second, the interactive time to first token with and
without the batch, and how much of the capacity the interactive load leaves idle the batch fills.

    nice -n 10 .venv/bin/python bench/batches.py [--lines 10000] [--workers 2] [--slots 8]
        [--rate 8] [--seconds 20] [--max-tokens 16] [--concurrency 16] [--max-loop-lag-ms 2]

In this process: a Redis, a real router ([fair_queue] on) and ``--workers`` simulated H100 workers
of ``--slots`` slots; beside it a gateway process whose batch runner runs ``--concurrency`` lines at
once, pausing while its event loop lags past ``--max-loop-lag-ms`` (0: never; ``[batches]
max_loop_lag_ms``). An open-loop interactive load (``--rate`` streamed chat completions a second,
Poisson arrivals, each ``--max-tokens`` long) runs ``--seconds`` alone, then the same again while
the batch runs (``--lines`` lines of the same shape). The time to first token is the time to the
stream's first event (the gateway answers once the worker's first token is there). Utilisation is
the busy slots' share, sampled every 10 ms from the workers' engines.

Printed: the interactive TTFT p50 and p99 alone and beside the batch (target: p99 within 1.2x),
the batch's lines per second in the window, and the share of the slots the interactive load left
idle that the batch used (target: >= 90 %).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import random
import statistics
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import aiohttp
import openai
import redis.asyncio as aioredis
from openai.types import Batch

from devtools.redis_server import RedisServer
from gateway.accounts.keys import create_key
from infermesh.ports import free_port
from router_svc.config import FairQueueSection
from tests.helpers import MODEL
from tests.helpers.batches import chat_line, submit
from tests.helpers.gateway import gateway_process, listening
from tests.helpers.inprocess import running_router, running_worker, sim_engine
from worker_svc.sim_engine.engine import SimEngine

_SAMPLE_S = 0.01


@dataclasses.dataclass(frozen=True)
class Spec:
    lines: int = 10_000
    workers: int = 2
    slots: int = 8
    rate: float = 8.0  # interactive requests a second
    seconds: float = 20.0  # each phase
    max_tokens: int = 16
    concurrency: int = 16  # batch lines one gateway runs at once
    max_loop_lag_ms: float = 2.0  # the runner pauses while the gateway's loop lags past this
    zero_latency: bool = False


@dataclasses.dataclass(frozen=True)
class Phase:
    ttfts_s: list[float]
    utilisation: float  # mean busy share of every slot
    errors: int

    def ttft(self, q: float) -> float:
        return percentile(self.ttfts_s, q)


@dataclasses.dataclass(frozen=True)
class Figures:
    alone: Phase
    beside: Phase
    lines_per_s: float
    batch_lines_done: int

    @property
    def idle_filled(self) -> float:
        """The share of the slots the interactive load left idle that the batch used."""
        idle = 1 - self.alone.utilisation
        return (self.beside.utilisation - self.alone.utilisation) / idle if idle > 0 else 1.0


def percentile(values: Sequence[float], q: float) -> float:
    if len(values) < 2:
        return values[0] if values else float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1]


async def _first_token_s(
    session: aiohttp.ClientSession, url: str, key: str, max_tokens: int
) -> float | None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"interactive {random.random()}"}],
        "max_tokens": max_tokens,
        "stream": True,
    }
    started = time.monotonic()
    headers = {"Authorization": f"Bearer {key}"}
    async with session.post(url, json=body, headers=headers) as response:
        if response.status != 200:
            return None
        await response.content.readline()  # the first event: the first token is there
        first = time.monotonic() - started
        await response.read()
    return first


async def _interactive(url: str, key: str, spec: Spec, engines: list[SimEngine]) -> Phase:
    """``spec.seconds`` of open-loop load; the TTFTs and the mean busy share of the slots."""
    ttfts: list[float] = []
    errors = 0
    busy: list[float] = []
    slots = spec.workers * spec.slots

    async def one(session: aiohttp.ClientSession) -> None:
        nonlocal errors
        try:
            first = await _first_token_s(session, url, key, spec.max_tokens)
        except aiohttp.ClientError:
            first = None
        if first is None:
            errors += 1
        else:
            ttfts.append(first)

    async def sample() -> None:
        while True:
            busy.append(sum(e.load().running for e in engines) / slots)
            await asyncio.sleep(_SAMPLE_S)

    sampler = asyncio.create_task(sample())
    async with aiohttp.ClientSession() as session:
        tasks = []
        end = time.monotonic() + spec.seconds
        while time.monotonic() < end:
            tasks.append(asyncio.create_task(one(session)))
            await asyncio.sleep(random.expovariate(spec.rate))
        await asyncio.gather(*tasks)
    sampler.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await sampler
    return Phase(ttfts, statistics.fmean(busy) if busy else 0.0, errors)


async def measure(redis_url: str, files_dir: str, spec: Spec) -> Figures:
    """Both phases on a fresh fleet sharing ``redis_url``; the batch is cancelled at the end.
    The gateway is a process of its own (``python -m gateway``), as deployed, so that its work
    (the interactive requests and the batch's lines) does not share this process's event loop
    with the router and workers."""
    engines = [
        sim_engine(max_parallel=spec.slots, max_waiting=1024, zero_latency=spec.zero_latency)
        for _ in range(spec.workers)
    ]
    fair_queue = FairQueueSection(enabled=True, max_per_tenant=4096, max_total=8192)
    async with contextlib.AsyncExitStack() as stack:
        router = await stack.enter_async_context(
            # a loaded machine may starve heartbeats: a long TTL keeps the workers registered
            running_router(ttl_s=30.0, redis_url=redis_url, fair_queue=fair_queue)
        )
        for i, engine in enumerate(engines):
            await stack.enter_async_context(
                running_worker(engine, router, f"sim-{i}", max_parallel=spec.slots)
            )
        client = aioredis.Redis.from_url(redis_url)
        stack.push_async_callback(client.aclose)
        key = await create_key(client, "bench")
        port = free_port()
        gateway = gateway_process(
            {
                "INFERMESH_GATEWAY_SERVER_PORT": str(port),
                "INFERMESH_GATEWAY_REDIS_URL": redis_url,
                "INFERMESH_GATEWAY_ROUTER_ADDRESS": router.address,
                "INFERMESH_GATEWAY_FILES_DIRECTORY": files_dir,
                "INFERMESH_GATEWAY_FILES_MAX_FILE_BYTES": str(1 << 30),
                "INFERMESH_GATEWAY_FILES_MAX_LINES": str(max(spec.lines, 1)),
                "INFERMESH_GATEWAY_BATCHES_CONCURRENCY": str(spec.concurrency),
                "INFERMESH_GATEWAY_BATCHES_POLL_S": "0.05",
                "INFERMESH_GATEWAY_BATCHES_MAX_LOOP_LAG_MS": str(spec.max_loop_lag_ms),
            }
        )
        stack.callback(_stop, gateway)
        await listening(gateway)
        base = f"http://127.0.0.1:{port}/v1"
        alone = await _interactive(f"{base}/chat/completions", key, spec, engines)
        sdk = openai.AsyncOpenAI(base_url=base, api_key=key, max_retries=0, timeout=60)
        stack.push_async_callback(sdk.close)
        lines = [chat_line(f"line {i}", max_tokens=spec.max_tokens) for i in range(spec.lines)]
        batch = await submit(sdk, lines)
        await asyncio.sleep(1.0)  # the runner fills its slots
        done_before = _completed(await sdk.batches.retrieve(batch.id))
        started = time.monotonic()
        beside = await _interactive(f"{base}/chat/completions", key, spec, engines)
        elapsed = time.monotonic() - started
        done_after = _completed(await sdk.batches.retrieve(batch.id))
        with contextlib.suppress(openai.APIError):  # the figures are in; a busy Redis may 503
            await sdk.batches.cancel(batch.id)
    return Figures(alone, beside, (done_after - done_before) / elapsed, done_after)


def _completed(batch: Batch) -> int:
    return batch.request_counts.completed if batch.request_counts else 0


def _stop(proc: subprocess.Popen[str]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()


def report(spec: Spec, figures: Figures) -> None:
    print(
        f"{spec.workers} simulated H100 workers x {spec.slots} slots; interactive {spec.rate:g}/s "
        f"open loop, {spec.max_tokens} tokens each; batch of {spec.lines} lines, "
        f"{spec.concurrency} at once, paused past {spec.max_loop_lag_ms:g} ms of loop lag; "
        f"{spec.seconds:g} s per phase"
    )
    for name, phase in (("alone", figures.alone), ("beside the batch", figures.beside)):
        print(
            f"interactive {name:>16}: TTFT p50 {phase.ttft(0.5) * 1000:6.1f} ms, "
            f"p99 {phase.ttft(0.99) * 1000:6.1f} ms, {len(phase.ttfts_s)} requests, "
            f"{phase.errors} errors, slots busy {phase.utilisation:.1%}"
        )
    alone, beside = figures.alone, figures.beside
    print(
        f"TTFT ratio beside/alone: p50 {beside.ttft(0.5) / alone.ttft(0.5):.2f}x, "
        f"p99 {beside.ttft(0.99) / alone.ttft(0.99):.2f}x (target: p99 <= 1.2x)"
    )
    print(
        f"batch: {figures.lines_per_s:.1f} lines/s ({figures.batch_lines_done} done); idle slots "
        f"filled {figures.idle_filled:.1%} (target: >= 90%)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    defaults = Spec()
    for field in dataclasses.fields(Spec):
        if field.type == "bool":
            continue
        parser.add_argument(
            f"--{field.name.replace('_', '-')}",
            type=float if field.type == "float" else int,
            default=getattr(defaults, field.name),
        )
    args = parser.parse_args()
    spec = Spec(
        **{f.name: getattr(args, f.name) for f in dataclasses.fields(Spec) if f.type != "bool"}
    )
    with tempfile.TemporaryDirectory() as workdir:
        redis = RedisServer(workdir=workdir)
        redis.start()
        try:
            figures = asyncio.run(measure(redis.url, str(Path(workdir) / "files"), spec))
        finally:
            redis.stop()
    report(spec, figures)


if __name__ == "__main__":
    main()
