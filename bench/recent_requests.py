"""What recording the recent requests costs per request (docs/benchmarks/hot-path.md): the two
capped Redis stream entries every authenticated request writes (``gateway.accounts.recent``).

    .venv/bin/python bench/recent_requests.py [--requests 20000] [--batch 64]

Starts Redis, then writes ``--requests`` entries through ``RecentRequests`` in pipelined
batches of ``--batch`` (what one write carries when that many requests ended meanwhile, as at
c=64), each way in turn: the entries as the gateway writes them (two streams, each trimmed
exactly), each trimmed approximately (``MAXLEN ~``, whole macro nodes), and only the all-keys
stream exactly. Prints, per request, this process's CPU (building and sending the entries)
and Redis's (psutil, before and after), and each way's Redis CPU against the gateway's own.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import tempfile
import time
from collections.abc import Callable
from typing import Any

import psutil

from devtools.redis_server import RedisServer
from gateway.accounts.recent import ALL_KEYS, RecentRequest, RecentRequests, key_stream
from gateway.config import ConsoleSection
from infermesh.redis_client import RedisClient, redis_client

_KEYS = 50  # API keys the entries spread over


def _entry(i: int) -> RecentRequest:
    return RecentRequest(
        at=time.time(),
        key_id=f"key{i % _KEYS:04d}",
        key_name=f"bench {i % _KEYS}",
        path="/v1/chat/completions",
        model="deepseek-v3",
        status=200,
        prompt_tokens=24,
        cached_tokens=0,
        completion_tokens=16,
        first_token_ms=4,
        duration_ms=9,
        trace_id="0" * 32,
        request_id=f"req-{i:032x}",
    )


async def _changed(
    redis: RedisClient,
    batch: list[RecentRequest],
    config: ConsoleSection,
    *,
    exact: bool,
    per_key: bool,
) -> None:
    """The gateway's write, changed: trimmed approximately (not ``exact``), or only the
    all-keys stream (not ``per_key``)."""
    async with redis.pipeline(transaction=False) as pipe:
        for entry in batch:
            fields: dict[Any, Any] = entry.fields()
            if per_key:
                pipe.xadd(
                    key_stream(entry.key_id),
                    fields,
                    maxlen=config.recent_per_key,
                    approximate=not exact,
                )
            pipe.xadd(ALL_KEYS, fields, maxlen=config.recent_total, approximate=not exact)
        await pipe.execute()


@dataclasses.dataclass
class _Cost:
    client_ms: float
    redis_ms: float


async def _measure(
    redis: RedisClient, server: psutil.Process, way: str, requests: int, batch_size: int
) -> _Cost:
    config = ConsoleSection()
    recorder = RecentRequests(redis, config)
    await redis.flushall()
    entries = [_entry(i) for i in range(requests)]
    # the recorder's own path for the gateway's way; the others write what it would, changed
    writers: dict[str, Callable[[list[RecentRequest]], Any]] = {
        "approximate": lambda b: _changed(redis, b, config, exact=False, per_key=True),
        "all-keys only": lambda b: _changed(redis, b, config, exact=True, per_key=False),
    }
    redis_before = sum(server.cpu_times()[:2])
    client_before = time.process_time()
    for start in range(0, requests, batch_size):
        batch = entries[start : start + batch_size]
        if way == "gateway":
            for entry in batch:
                recorder.record(entry)
            await recorder.drain()
        else:
            await writers[way](batch)
    client_s = time.process_time() - client_before
    redis_s = sum(server.cpu_times()[:2]) - redis_before
    return _Cost(client_s * 1000 / requests, redis_s * 1000 / requests)


async def _run(requests: int, batch_size: int) -> None:
    with tempfile.TemporaryDirectory() as workdir, RedisServer(workdir=workdir) as server:
        redis = redis_client(server.url, timeout_s=5.0)
        process = psutil.Process(server.pid)
        try:
            await _measure(redis, process, "gateway", batch_size * 10, batch_size)  # warm-up
            print(f"{requests} requests in batches of {batch_size}, {_KEYS} keys")
            print(f"{'way':<16} {'client ms/req':>14} {'redis ms/req':>13} {'redis ÷ gateway':>16}")
            reference: _Cost | None = None
            for way in ("gateway", "approximate", "all-keys only"):
                cost = await _measure(redis, process, way, requests, batch_size)
                reference = reference or cost
                print(
                    f"{way:<16} {cost.client_ms:>14.4f} {cost.redis_ms:>13.4f} "
                    f"{cost.redis_ms / reference.redis_ms:>16.2f}"
                )
        finally:
            await redis.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()
    asyncio.run(_run(args.requests, args.batch))


if __name__ == "__main__":
    main()
