"""Gateway overhead (issues #4, #16): the whole mesh against the same load sent straight to the
worker, and LiteLLM's proxy against the same load sent straight to its upstream, in one run.

    .venv/bin/python bench/gateway_mesh.py [--duration 5] [--concurrency 1 16 64]
        [--paths direct mesh tls upstream litellm] [--litellm /path/to/venv/bin/litellm]
        [--gateway-processes 1] [--unpinned]

Starts Redis, the router, one worker and the gateway as processes (devtools.mesh), the
worker on the simulated engine in zero-latency mode (INFERMESH_WORKER_ENGINE_KIND=sim,
INFERMESH_WORKER_ENGINE_ZERO_LATENCY=true: tokens cost nothing, so what is measured is the
mesh). Pinned as the reference figures were taken: gateway, router and Redis together on core
0, worker and this load generator on core 1 (every thread, by sched_setaffinity). Tracing is
off (OTEL_SDK_DISABLED) and the API key has no limits, but its admission and settlement
scripts run as for any key, so Redis's CPU is the mesh's and is counted with it.

For each concurrency, closed-loop clients send for --duration seconds (after a warm-up) by these
paths (--paths): ``direct`` (gRPC to the worker over the transport the gateway uses, its
long-lived ``Worker.Serve`` streams: ``infermesh.serve_client``, in this load process),
``router`` (an internal caller's gRPC calls to the router, which serves them as the gateway
does), ``mesh`` (HTTP chat completions through the gateway, which asks the router to choose and
streams from the worker itself), ``tls`` (as ``mesh``, through a second mesh whose gRPC hops
are all mutual TLS, its processes pinned as the first's; its reference is ``mesh``, so its +p50
is what TLS adds), ``upstream`` (HTTP straight to bench/zero_upstream.py, a zero-latency
OpenAI-compatible server with its own step loop on core 1) and ``litellm`` (LiteLLM's proxy, one
worker, no database, on core 0, in front of that upstream; --litellm names its executable,
installed in a venv of its own). Non-streamed with 16 tokens (``direct`` then asks the stream
for the whole answer, ``router`` calls the unary Complete RPC) and streamed with 64 tokens
(``router``: Generate). Prints requests/s, p50/p99 latency and what the path adds to its
reference (``direct`` for the mesh's paths, ``upstream`` for ``litellm``), streamed tokens/s,
the SSE events a client received per streamed request (``ev/req``; a stream of 64 tokens
delivered one event per token shows 64 plus its role, finish and usage events), and CPU
milliseconds per request of the process that served the path on core 0 (gateway or LiteLLM), of
the router and of Redis (read from each process before and after, psutil), then, for each mode
and concurrency that measured both, the mesh's core-0 CPU per request (gateway + router + Redis)
against LiteLLM's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import grpc
import psutil

from bench.mesh_load import simulated_mesh
from devtools.mesh import Mesh, MeshSpec
from devtools.redis_server import RedisServer
from gateway.accounts.keys import create_key_at
from infermesh.channels import WorkerChannels
from infermesh.pb import common_pb2, router_pb2_grpc
from infermesh.ports import free_port
from infermesh.serve_client import ServeClient
from infermesh.tls import TlsSection

_MESH_CORE, _LOAD_CORE = 0, 1
_LOAD_SIDE = {"worker0", "tls-worker0", "upstream"}  # processes pinned with the load generator
_WARMUP_S = 1.0
_START_TIMEOUT_S = 120.0
_MESSAGES = [{"role": "user", "content": "Benchmark the mesh, please."}]
_PATHS = ("direct", "router", "mesh", "tls", "upstream", "litellm")
_REFERENCE = {"litellm": "upstream", "tls": "mesh"}  # else direct
_TLS = "tls-"  # the names of the TLS mesh's processes
_SERVED_BY = {
    "mesh": "gateway",
    "tls": f"{_TLS}gateway",
    "litellm": "litellm",
}
_LITELLM_KEY = "sk-bench-litellm-0123456789abcdef"
_LITELLM_MODEL = "zero"

# One answer: (tokens, SSE events received; 0 for a gRPC path).
Answer = tuple[int, int]


@dataclass
class Run:
    requests: int
    tokens: int
    events: int
    elapsed_s: float
    latencies_s: list[float]
    cpu_s: dict[str, float]  # per process name, over the run

    def pct(self, q: float) -> float:
        ordered = sorted(self.latencies_s)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


def _pin(pid: int, core: int) -> None:
    processes = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    for process in processes:
        for thread in process.threads():
            with contextlib.suppress(ProcessLookupError):  # a thread that just ended
                os.sched_setaffinity(thread.id, {core})


def _cpu(pids: dict[str, int]) -> dict[str, float]:
    def of(pid: int) -> float:
        process = psutil.Process(pid)
        return sum(sum(p.cpu_times()[:2]) for p in [process, *process.children(recursive=True)])

    return {name: of(pid) for name, pid in pids.items()}


async def _measure(
    concurrency: int,
    duration_s: float,
    one: Callable[[], Awaitable[Answer]],
    pids: dict[str, int],
    pin: bool,
) -> Run:
    """Closed loop: ``concurrency`` clients each sending ``one()`` back to back."""
    loop = asyncio.get_running_loop()

    async def clients(until: float, latencies: list[float], answers: list[Answer]) -> None:
        async def client() -> None:
            while loop.time() < until:
                started = time.perf_counter()
                answers.append(await one())
                latencies.append(time.perf_counter() - started)

        await asyncio.gather(*(client() for _ in range(concurrency)))

    await clients(loop.time() + _WARMUP_S, [], [])
    for name, pid in pids.items() if pin else ():
        _pin(pid, _LOAD_CORE if name in _LOAD_SIDE else _MESH_CORE)
    cpu_before, started = _cpu(pids), time.perf_counter()
    latencies: list[float] = []
    answers: list[Answer] = []
    await clients(loop.time() + duration_s, latencies, answers)
    elapsed = time.perf_counter() - started
    cpu_after = _cpu(pids)
    return Run(
        len(latencies),
        sum(t for t, _ in answers),
        sum(e for _, e in answers),
        elapsed,
        latencies,
        {name: cpu_after[name] - cpu_before[name] for name in pids},
    )


def _request(model: str, max_tokens: int) -> common_pb2.GenerateRequest:
    return common_pb2.GenerateRequest(
        model=model,
        messages=[common_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in _MESSAGES],
        sampling=common_pb2.SamplingParams(temperature=0, max_tokens=max_tokens),
    )


def _stream_one(
    streams: ServeClient, address: str, model: str, max_tokens: int, whole: bool
) -> Callable[[], Awaitable[Answer]]:
    """A request on the worker's Serve stream, as the gateway sends it."""
    request = _request(model, max_tokens)

    async def one() -> Answer:
        tokens = 0
        async for chunk in streams.open(address, request, whole=whole, timeout_s=60).chunks():
            tokens += len(chunk.token_ids)
        return tokens, 0

    return one


def _grpc_one(
    stub: router_pb2_grpc.RouterStub, model: str, max_tokens: int, unary: bool
) -> Callable[[], Awaitable[Answer]]:
    request = _request(model, max_tokens)
    if unary:

        async def complete() -> Answer:
            return len((await stub.Complete(request)).token_ids), 0

        return complete

    async def one() -> Answer:
        tokens = 0
        async for chunk in stub.Generate(request):
            tokens += len(chunk.token_ids)
        return tokens, 0

    return one


def _http_one(
    session: aiohttp.ClientSession, url: str, key: str, model: str, max_tokens: int, stream: bool
) -> Callable[[], Awaitable[Answer]]:
    body = json.dumps(
        {
            "model": model,
            "messages": _MESSAGES,
            "temperature": 0,
            "max_tokens": max_tokens,
            "stream": stream,
            **({"stream_options": {"include_usage": True}} if stream else {}),
        }
    )
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}

    async def one() -> Answer:
        async with session.post(url, data=body, headers=headers) as response:
            if response.status != 200:
                raise RuntimeError(f"{response.status}: {await response.text()}")
            if not stream:
                return (await response.json())["usage"]["completion_tokens"], 0
            last, events = b"", 0
            async for line in response.content:
                if line.startswith(b"data: {"):
                    last = line
                    events += 1
            return json.loads(last[6:])["usage"]["completion_tokens"], events

    return one


async def _model(session: aiohttp.ClientSession, base_url: str, key: str) -> str:
    async with session.get(
        f"{base_url}/models", headers={"Authorization": f"Bearer {key}"}
    ) as response:
        return (await response.json())["data"][0]["id"]


async def _bench(
    args: argparse.Namespace,
    urls: dict[str, str],
    key: str,
    router_address: str,
    worker_address: str,
    pids: dict[str, int],
) -> None:
    if not args.unpinned:
        os.sched_setaffinity(0, {_LOAD_CORE})
    connector = aiohttp.TCPConnector(limit=0)
    channels = WorkerChannels(TlsSection(plaintext=True))
    streams = ServeClient(channels)  # the gateway's defaults
    async with (
        aiohttp.ClientSession(connector=connector) as session,
        grpc.aio.insecure_channel(router_address) as router_channel,
    ):
        model = await _model(session, urls["mesh"], key)
        router = router_pb2_grpc.RouterStub(router_channel)
        try:
            await _table(args, urls, key, model, session, streams, worker_address, router, pids)
        finally:
            await streams.close()
            await channels.close()


async def _table(
    args: argparse.Namespace,
    urls: dict[str, str],
    key: str,
    model: str,
    session: aiohttp.ClientSession,
    streams: ServeClient,
    worker_address: str,
    router: router_pb2_grpc.RouterStub,
    pids: dict[str, int],
) -> None:
    print(
        f"{'mode':<10} {'c':>3} {'path':<8} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} "
        f"{'+p50 ms':>8} {'+p99 ms':>8} {'tok/s':>9} {'ev/req':>7} {'core0 ms CPU/req':>17} "
        f"{'rt ms CPU/req':>14} {'redis ms CPU/req':>17}",
        flush=True,
    )
    ratios = []
    for mode, max_tokens, stream in [("plain-16", 16, False), ("stream-64", 64, True)]:
        for concurrency in args.concurrency:
            paths: dict[str, Callable[[], Awaitable[Answer]]] = {
                "direct": _stream_one(streams, worker_address, model, max_tokens, whole=not stream),
                "router": _grpc_one(router, model, max_tokens, unary=not stream),
            }
            for path in ("mesh", "tls"):
                paths[path] = _http_one(
                    session,
                    f"{urls.get(path)}/chat/completions",
                    key,
                    model,
                    max_tokens,
                    stream,
                )
            for path in ("upstream", "litellm"):
                paths[path] = _http_one(
                    session,
                    f"{urls.get(path)}/chat/completions",
                    _LITELLM_KEY,
                    _LITELLM_MODEL,
                    max_tokens,
                    stream,
                )
            references: dict[str, Run] = {}
            for path in args.paths:
                run = await _measure(
                    concurrency, args.duration, paths[path], pids, not args.unpinned
                )
                references.setdefault(path, run)
                reference = references.get(_REFERENCE.get(path, "direct"), run)
                served_cpu_s = run.cpu_s[_SERVED_BY[path]] if path in _SERVED_BY else 0.0
                events = f"{run.events / run.requests:>7.1f}" if run.events else f"{'':>7}"
                print(
                    f"{mode:<10} {concurrency:>3} {path:<8} "
                    f"{run.requests / run.elapsed_s:>8.0f} {run.pct(0.5):>8.2f} "
                    f"{run.pct(0.99):>8.2f} {run.pct(0.5) - reference.pct(0.5):>8.2f} "
                    f"{run.pct(0.99) - reference.pct(0.99):>8.2f} "
                    f"{run.tokens / run.elapsed_s:>9.0f} {events} "
                    f"{served_cpu_s * 1000 / run.requests:>17.3f} "
                    f"{run.cpu_s[_router_of(path)] * 1000 / run.requests:>14.3f} "
                    f"{run.cpu_s['redis'] * 1000 / run.requests:>17.3f}",
                    flush=True,
                )
            if "mesh" in references and "litellm" in references:
                ratios.append((mode, concurrency, references["mesh"], references["litellm"]))
    for mode, concurrency, mesh, litellm in ratios:
        ours = sum(mesh.cpu_s[n] for n in ("gateway", "router", "redis")) / mesh.requests
        theirs = litellm.cpu_s["litellm"] / litellm.requests
        print(
            f"{mode} c={concurrency}: core-0 CPU per request, gateway + router + Redis "
            f"{ours * 1000:.3f} ms, LiteLLM {theirs * 1000:.3f} ms: {theirs / ours:.1f}x less"
        )


def _router_of(path: str) -> str:
    """The router process a path goes through."""
    return f"{_TLS}router" if path == "tls" else "router"


class _LiteLLM:
    """The zero-latency upstream and LiteLLM's proxy in front of it, as processes."""

    def __init__(self, workdir: Path, executable: str | None) -> None:
        self.upstream_port, self.proxy_port = free_port(), free_port()
        self._workdir, self._executable = workdir, executable
        self._processes: dict[str, subprocess.Popen[bytes]] = {}

    def __enter__(self) -> _LiteLLM:
        self._processes["upstream"] = subprocess.Popen(
            [
                sys.executable,
                str(Path(__file__).with_name("zero_upstream.py")),
                "--port",
                str(self.upstream_port),
            ]
        )
        self._wait(self.upstream_port, "/v1/models", "the zero-latency upstream")
        if self._executable is not None:
            config = self._workdir / "litellm.yaml"
            config.write_text(
                "model_list:\n"
                f"  - model_name: {_LITELLM_MODEL}\n"
                "    litellm_params:\n"
                f"      model: openai/{_LITELLM_MODEL}\n"
                f"      api_base: http://127.0.0.1:{self.upstream_port}/v1\n"
                "      api_key: sk-upstream\n"
            )
            log = (self._workdir / "litellm.log").open("wb")
            self._processes["litellm"] = subprocess.Popen(
                [
                    self._executable,
                    "--config",
                    str(config),
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(self.proxy_port),
                    "--num_workers",
                    "1",
                ],
                cwd=self._workdir,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "LITELLM_MASTER_KEY": _LITELLM_KEY, "LITELLM_LOG": "ERROR"},
            )
            self._wait(self.proxy_port, "/health/liveliness", "LiteLLM's proxy")
        return self

    def pids(self) -> dict[str, int]:
        return {name: process.pid for name, process in self._processes.items()}

    def _wait(self, port: int, path: str, what: str) -> None:
        deadline = time.monotonic() + _START_TIMEOUT_S
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=1):
                    return
            except OSError:
                if time.monotonic() > deadline or any(
                    p.poll() is not None for p in self._processes.values()
                ):
                    raise RuntimeError(f"{what} did not start") from None
                time.sleep(0.2)

    def __exit__(self, *exc: object) -> None:
        for process in self._processes.values():
            process.terminate()
        for process in self._processes.values():
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per measurement")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument(
        "--paths", nargs="+", choices=_PATHS, default=["direct", "mesh", "upstream", "litellm"]
    )
    parser.add_argument(
        "--gateway-processes", type=int, default=1, help="[server] processes of the mesh's gateways"
    )
    parser.add_argument(
        "--unpinned", action="store_true", help="pin nothing: every process on any core"
    )
    parser.add_argument(
        "--litellm",
        default=None,
        help="LiteLLM's executable (its own venv); needed for path litellm",
    )
    args = parser.parse_args()
    if len(os.sched_getaffinity(0)) < 2:
        print(
            "needs two cores: gateway and router on one, worker and load on the other",
            file=sys.stderr,
        )
        return 1
    if "litellm" in args.paths and args.litellm is None:
        print("path litellm needs --litellm (e.g. a venv's bin/litellm)", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory() as workdir, RedisServer(workdir=workdir) as redis_server:
        spec = simulated_mesh(
            redis_server.url,
            Path(workdir),
            {
                "INFERMESH_WORKER_ENGINE_ZERO_LATENCY": "true",
                "INFERMESH_GATEWAY_SERVER_PROCESSES": str(args.gateway_processes),
            },
        )
        litellm = args.litellm if "litellm" in args.paths else None
        with (
            Mesh(spec) as mesh,
            _tls_mesh(spec, Path(workdir), "tls" in args.paths) as tls_mesh,
            _LiteLLM(Path(workdir), litellm) as proxy,
        ):
            urls = {
                "mesh": spec.base_url,
                "upstream": f"http://127.0.0.1:{proxy.upstream_port}/v1",
                "litellm": f"http://127.0.0.1:{proxy.proxy_port}/v1",
            }
            pids = {name: mesh.pid(name) for name in ("router", "worker0", "gateway")}
            pids["redis"] = redis_server.pid
            if tls_mesh is not None:
                urls["tls"] = tls_mesh.spec.base_url
                pids.update(
                    {_TLS + name: tls_mesh.pid(name) for name in ("router", "worker0", "gateway")}
                )
            pids.update(proxy.pids())
            key = asyncio.run(create_key_at(redis_server.url, "bench"))
            pinning = (
                "unpinned"
                if args.unpinned
                else f"gateway+router+Redis (and LiteLLM) on core {_MESH_CORE}, worker (and "
                f"upstream)+load on core {_LOAD_CORE}"
            )
            print(
                f"python {sys.version.split()[0]}, {psutil.cpu_count()} cores, "
                f"{args.duration:.0f} s per point; {args.gateway_processes} gateway "
                f"process(es); {pinning}",
                flush=True,
            )
            asyncio.run(
                _bench(
                    args, urls, key, spec.router_address, f"127.0.0.1:{spec.worker_ports[0]}", pids
                )
            )
    return 0


@contextlib.contextmanager
def _tls_mesh(plain: MeshSpec, workdir: Path, wanted: bool) -> Iterator[Mesh | None]:
    """A second mesh like ``plain`` (same Redis, its own ports and registry) with every gRPC
    hop over mutual TLS; None when not ``wanted``."""
    if not wanted:
        yield None
        return
    log_dir = workdir / "tls"
    log_dir.mkdir()
    spec = dataclasses.replace(
        simulated_mesh(plain.redis_url, log_dir, plain.env), certs=workdir / "certs"
    )
    with Mesh(spec) as mesh:
        yield mesh


if __name__ == "__main__":
    sys.exit(main())
