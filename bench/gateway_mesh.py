"""Gateway overhead (issue #4): the whole mesh against the same load sent straight to the worker.

    .venv/bin/python bench/gateway_mesh.py [--duration 5] [--concurrency 1 16 64]

Starts Redis, the router, one worker and the gateway as processes (infermesh.cli.mesh), the
worker on the simulated engine in zero-latency mode (INFERMESH_WORKER_ENGINE_KIND=sim,
INFERMESH_WORKER_ENGINE_ZERO_LATENCY=true: tokens cost nothing, so what is measured is the
mesh). Pinned as the reference figures were taken: gateway and router together on core 0,
worker and this load generator on core 1 (every thread, by sched_setaffinity). Tracing is
off (OTEL_SDK_DISABLED) and the API key has no limits, but its admission and settlement
scripts run as for any key.

For each concurrency, closed-loop clients send for --duration seconds (after a warm-up) by
four paths: ``direct`` (gRPC to the worker), ``router`` (gRPC to the router, which relays),
``mesh`` (HTTP chat completions through the gateway, which asks the router to choose and
calls the worker itself: the default) and ``relay`` (the same through a second gateway with
``[router] relay = true``); non-streamed with 16 tokens (the gRPC paths then call the unary
Complete RPCs, as the gateway does for a non-streamed request) and streamed with 64 tokens
(Generate). Prints requests/s, p50/p99 latency and what the path adds to direct, streamed
tokens/s, and CPU milliseconds per request of the gateway that served the path and of the
router.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import grpc
import psutil
import redis.asyncio as aioredis

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gateway.keys import create_key  # noqa: E402
from infermesh.cli.mesh import Mesh, MeshSpec  # noqa: E402
from infermesh.pb import common_pb2, router_pb2_grpc, worker_pb2_grpc  # noqa: E402
from infermesh.cli.redis_server import RedisServer  # noqa: E402
from infermesh.ports import free_port  # noqa: E402
from worker_svc.config import DEFAULT_MODEL_PATH  # noqa: E402

_MESH_CORE, _LOAD_CORE = 0, 1
_WARMUP_S = 1.0
_MESSAGES = [{"role": "user", "content": "Benchmark the mesh, please."}]


@dataclass
class Run:
    requests: int
    tokens: int
    elapsed_s: float
    latencies_s: list[float]
    cpu_s: dict[str, float]  # per process name, over the run

    def pct(self, q: float) -> float:
        ordered = sorted(self.latencies_s)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


def _pin(pid: int, core: int) -> None:
    for thread in psutil.Process(pid).threads():
        try:
            os.sched_setaffinity(thread.id, {core})
        except ProcessLookupError:  # a thread that just ended
            pass


def _cpu(pids: dict[str, int]) -> dict[str, float]:
    return {name: sum(psutil.Process(pid).cpu_times()[:2]) for name, pid in pids.items()}


async def _measure(concurrency: int, duration_s: float, one: Callable[[], Awaitable[int]],
                   pids: dict[str, int]) -> Run:
    """Closed loop: ``concurrency`` clients each sending ``one()`` (returns tokens) back to back."""
    loop = asyncio.get_running_loop()

    async def clients(until: float, latencies: list[float], tokens: list[int]) -> None:
        async def client() -> None:
            while loop.time() < until:
                started = time.perf_counter()
                tokens.append(await one())
                latencies.append(time.perf_counter() - started)
        await asyncio.gather(*(client() for _ in range(concurrency)))

    await clients(loop.time() + _WARMUP_S, [], [])
    for name, pid in pids.items():
        _pin(pid, _LOAD_CORE if name == "worker0" else _MESH_CORE)
    cpu_before, started = _cpu(pids), time.perf_counter()
    latencies: list[float] = []
    tokens: list[int] = []
    await clients(loop.time() + duration_s, latencies, tokens)
    elapsed = time.perf_counter() - started
    cpu_after = _cpu(pids)
    return Run(len(latencies), sum(tokens), elapsed, latencies,
               {name: cpu_after[name] - cpu_before[name] for name in pids})


def _grpc_one(stub, model: str, max_tokens: int, unary: bool) -> Callable[[], Awaitable[int]]:
    request = common_pb2.GenerateRequest(
        model=model, messages=[common_pb2.ChatMessage(**m) for m in _MESSAGES],
        sampling=common_pb2.SamplingParams(temperature=0, max_tokens=max_tokens))
    if unary:
        async def complete() -> int:
            return len((await stub.Complete(request)).token_ids)
        return complete

    async def one() -> int:
        tokens = 0
        async for chunk in stub.Generate(request):
            tokens += len(chunk.token_ids)
        return tokens
    return one


def _http_one(session: aiohttp.ClientSession, url: str, key: str, model: str, max_tokens: int,
              stream: bool) -> Callable[[], Awaitable[int]]:
    body = json.dumps({"model": model, "messages": _MESSAGES, "temperature": 0,
                       "max_tokens": max_tokens, "stream": stream,
                       **({"stream_options": {"include_usage": True}} if stream else {})})
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}

    async def one() -> int:
        async with session.post(url, data=body, headers=headers) as response:
            if response.status != 200:
                raise RuntimeError(f"{response.status}: {await response.text()}")
            if not stream:
                return (await response.json())["usage"]["completion_tokens"]
            last = b""
            async for line in response.content:
                if line.startswith(b"data: {"):
                    last = line
            return json.loads(last[6:])["usage"]["completion_tokens"]
    return one


async def _bench(args: argparse.Namespace, mesh: Mesh, relay_url: str, key: str,
                 pids: dict[str, int]) -> None:
    spec = mesh.spec
    os.sched_setaffinity(0, {_LOAD_CORE})
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session, \
            grpc.aio.insecure_channel(f"127.0.0.1:{spec.worker_ports[0]}") as worker_channel, \
            grpc.aio.insecure_channel(spec.router_address) as router_channel:
        async with session.get(f"{spec.base_url}/models",
                               headers={"Authorization": f"Bearer {key}"}) as response:
            model = (await response.json())["data"][0]["id"]
        worker = worker_pb2_grpc.WorkerStub(worker_channel)
        router = router_pb2_grpc.RouterStub(router_channel)
        url = f"{spec.base_url}/chat/completions"
        print(f"{'mode':<10} {'c':>3} {'path':<7} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} "
              f"{'+p50 ms':>8} {'+p99 ms':>8} {'tok/s':>9} {'gw ms CPU/req':>14} "
              f"{'rt ms CPU/req':>14}", flush=True)
        gateway_of = {"mesh": "gateway", "relay": "relay-gateway"}
        for mode, max_tokens, stream in [("plain-16", 16, False), ("stream-64", 64, True)]:
            for concurrency in args.concurrency:
                paths = {"direct": _grpc_one(worker, model, max_tokens, unary=not stream),
                         "router": _grpc_one(router, model, max_tokens, unary=not stream),
                         "mesh": _http_one(session, url, key, model, max_tokens, stream),
                         "relay": _http_one(session, f"{relay_url}/chat/completions", key, model,
                                            max_tokens, stream)}
                direct: Run | None = None
                for path, one in paths.items():
                    run = await _measure(concurrency, args.duration, one, pids)
                    direct = direct or run
                    gateway_cpu_s = run.cpu_s[gateway_of[path]] if path in gateway_of else 0.0
                    print(f"{mode:<10} {concurrency:>3} {path:<7} "
                          f"{run.requests / run.elapsed_s:>8.0f} {run.pct(0.5):>8.2f} "
                          f"{run.pct(0.99):>8.2f} {run.pct(0.5) - direct.pct(0.5):>8.2f} "
                          f"{run.pct(0.99) - direct.pct(0.99):>8.2f} "
                          f"{run.tokens / run.elapsed_s:>9.0f} "
                          f"{gateway_cpu_s * 1000 / run.requests:>14.3f} "
                          f"{run.cpu_s['router'] * 1000 / run.requests:>14.3f}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per measurement")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    args = parser.parse_args()
    if len(os.sched_getaffinity(0)) < 2:
        print("needs two cores: gateway and router on one, worker and load on the other",
              file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory() as workdir, RedisServer(workdir=workdir) as redis_server:
        spec = MeshSpec(
            redis_url=redis_server.url, model_path=DEFAULT_MODEL_PATH, gateway_port=free_port(),
            router_port=free_port(), worker_ports=(free_port(),), log_dir=Path(workdir),
            env={"OTEL_SDK_DISABLED": "true", "INFERMESH_LOG_LEVEL": "WARNING",
                 "INFERMESH_WORKER_ENGINE_KIND": "sim",
                 "INFERMESH_WORKER_ENGINE_ZERO_LATENCY": "true",
                 "INFERMESH_WORKER_PARALLEL_MAX_PARALLEL": "256",
                 "INFERMESH_WORKER_PARALLEL_MAX_WAITING": "1024"})
        relay_port = free_port()
        with Mesh(spec) as mesh:
            mesh.add_gateway("relay-gateway", relay_port, {"INFERMESH_GATEWAY_ROUTER_RELAY": "true"})
            key = asyncio.run(_create_key(redis_server.url))
            pids = {name: mesh.pid(name) for name in ("router", "worker0", "gateway", "relay-gateway")}
            print(f"python {sys.version.split()[0]}, {psutil.cpu_count()} cores, "
                  f"{args.duration:.0f} s per point; gateway+router on core {_MESH_CORE}, "
                  f"worker+load on core {_LOAD_CORE}", flush=True)
            asyncio.run(_bench(args, mesh, f"http://127.0.0.1:{relay_port}/v1", key, pids))
    return 0


async def _create_key(redis_url: str) -> str:
    client = aioredis.Redis.from_url(redis_url)
    try:
        return await create_key(client, "bench")
    finally:
        await client.aclose()


if __name__ == "__main__":
    sys.exit(main())
