"""Routing policies on a simulated mixed-GPU fleet: p50/p99 time to first token and
throughput for round_robin, least_load and balanced (the default), in one run.

    .venv/bin/python bench/router_policies.py [--requests 600] [--load 0.85] [--seed 1]

Per policy, on fresh processes: a Redis, a real router (``python -m router_svc`` with
INFERMESH_ROUTER_ROUTING_POLICY) and one process hosting 16 simulated workers as separate
gRPC servers (4 x V100, 4 x A100, 4 x H100, 4 x MI100; worker_svc/sim_engine/engine.py), which
register with the router as real workers do. This process sends the same open-loop workload
through the router each time: Poisson arrivals at ``--load`` x the fleet's estimated capacity
(from the roofline, without prefix-cache hits), prompts that mostly share one of 100 long
system prompts (2k-6k tokens), mixed prompt (to 8k tokens) and output (16-64) lengths. Targets:
balanced p99 TTFT <= 0.5 x round_robin's and throughput >= 1.2 x.

The model: 22B dense parameters, 384 KiB of KV cache per token; the 32 GB GPUs (V100, MI100)
hold it on two GPUs, the others on one. Throughput: completion tokens of the requests that
finished / the time from the first request sent to the last one done.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from types import MappingProxyType

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")  # this process forks the services

import grpc
import redis

from devtools.processes import stop_with_parent
from devtools.redis_server import RedisServer
from infermesh.pb import common_pb2, router_pb2, router_pb2_grpc
from infermesh.ports import free_port
from infermesh.probe import grpc_serving
from infermesh.tls import TlsSection
from worker_svc.config import (
    EngineSection,
    ModelSection,
    RouterSection,
    WorkerConfig,
    WorkerServerSection,
)
from worker_svc.service.main import create_server as create_worker_server
from worker_svc.service.registration import Registration
from worker_svc.sim_engine.engine import SimEngine

MODEL = "sim-22b"
FLEET = [("V100", 2), ("A100", 1), ("H100", 1), ("MI100", 2)] * 4  # (GPU profile, GPUs per worker)
POLICIES = ("round_robin", "least_load", "balanced")
_ENGINE = EngineSection(
    kind="sim", total_params_b=22.0, active_params_b=22.0, kv_bytes_per_token=393216
)
_SHARED_PREFIXES = 100
_SHARED_SHARE = 0.75  # of requests that start with one of the shared system prompts
_SYSTEM_BYTES = (8000, 24000)  # ranges, ~4 bytes a token
_QUESTION_BYTES = (200, 2000)
_UNIQUE_BYTES = (2000, 32000)
_MAX_TOKENS = (16, 65)
_REQUEST_TIMEOUT_S = 120.0


def worker_config(i: int, router_address: str) -> WorkerConfig:
    gpu, count = FLEET[i]
    return WorkerConfig(
        server=WorkerServerSection(port=0, worker_id=f"{gpu.lower()}-{i:02d}"),
        router=RouterSection(address=router_address),
        model=ModelSection(name=MODEL),
        engine=dataclasses.replace(_ENGINE, gpu=gpu, gpu_count=count),
        tls=TlsSection(plaintext=True),
    )


async def serve_fleet(router_address: str) -> None:
    """The --fleet child: 16 simulated workers until SIGTERM."""
    await serve_workers([worker_config(i, router_address) for i in range(len(FLEET))])


async def serve_workers(configs: list[WorkerConfig]) -> dict[str, SimEngine]:
    """Simulated workers, one gRPC server each, registered with their router until SIGTERM;
    returns their engines by worker id."""
    reporters, servers, engines = [], [], {}
    for config in configs:
        engine = engines[config.server.worker_id] = SimEngine.from_config(config)
        server, servicer = await create_worker_server(config, engine)
        servers.append(server)
        reporters.append(
            asyncio.create_task(Registration(config.router.address, servicer, config.tls).run())
        )
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    for task in reporters:
        task.cancel()
    await asyncio.gather(*(s.stop(grace=None) for s in servers))
    return engines


# ------------------------------------------------------------------------------ workload


@dataclasses.dataclass(frozen=True)
class Request:
    at_s: float  # arrival, from the start
    messages: tuple[tuple[str, str], ...]
    max_tokens: int


def words(rng: random.Random, n_bytes: int) -> str:
    out, size = [], 0
    while size < n_bytes:
        word = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randrange(2, 9)))
        out.append(word)
        size += len(word) + 1
    return " ".join(out)


def workload(rng: random.Random, count: int, rate_per_s: float) -> list[Request]:
    systems = [words(rng, rng.randrange(*_SYSTEM_BYTES)) for _ in range(_SHARED_PREFIXES)]
    requests, at = [], 0.0
    for _ in range(count):
        at += rng.expovariate(rate_per_s)
        if rng.random() < _SHARED_SHARE:
            messages: tuple[tuple[str, str], ...] = (
                ("system", rng.choice(systems)),
                ("user", words(rng, rng.randrange(*_QUESTION_BYTES))),
            )
        else:
            messages = (("user", words(rng, rng.randrange(*_UNIQUE_BYTES))),)
        requests.append(Request(at, messages, rng.randrange(*_MAX_TOKENS)))
    return requests


def mean_request() -> tuple[float, float]:
    """Mean prompt tokens (~4 bytes each) and completion tokens of the workload above."""
    shared = _SHARED_SHARE * (sum(_SYSTEM_BYTES) + sum(_QUESTION_BYTES)) / 2
    unique = (1 - _SHARED_SHARE) * sum(_UNIQUE_BYTES) / 2
    return (shared + unique) / 4, sum(_MAX_TOKENS) / 2


def fleet_capacity_per_s() -> float:
    """Requests/s the fleet sustains by the roofline if every prompt is prefilled in full:
    per worker, one prefill each plus a share of decode steps at a full batch."""
    prompt, completion = mean_request()
    total = 0.0
    for i in range(len(FLEET)):
        engine = SimEngine.from_config(worker_config(i, "unused:0"))
        batch = engine.max_parallel
        step = engine.roofline.decode_step_s(batch, int(batch * (prompt + completion / 2)))
        total += 1 / (engine.roofline.prefill_s(int(prompt)) + completion * step / batch)
    return total


# ------------------------------------------------------------------------------ measurement


@dataclasses.dataclass
class Outcome:
    ttft_s: float | None = None
    done_s: float | None = None
    token_ids: list[int] = dataclasses.field(default_factory=list)  # of the completion
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of the prompt, found in the worker's prefix cache
    error: str | None = None  # the gRPC status's code
    error_details: str = ""  # and its message
    worker: str = ""  # the worker the router chose
    text: str = ""
    # each token's wait after the one before; the tokens of a chunk share its wait
    itl_s: list[float] = dataclasses.field(default_factory=list)

    @property
    def tokens(self) -> int:
        return len(self.token_ids)


async def read_stream(
    call: AsyncIterator[common_pb2.GenerateResponse], outcome: Outcome, sent: float, start: float
) -> None:
    """Fills ``outcome`` from a Generate stream sent at ``sent``, in a run begun at ``start``."""
    last = sent
    try:
        async for chunk in call:
            now = time.monotonic()
            if outcome.ttft_s is None:
                outcome.ttft_s = now - sent
                outcome.worker = chunk.route.worker_id
            elif chunk.token_ids:
                outcome.itl_s += [(now - last) / len(chunk.token_ids)] * len(chunk.token_ids)
            if chunk.token_ids:
                last = now
            outcome.text += chunk.text
            outcome.token_ids += chunk.token_ids
            if chunk.HasField("usage"):
                outcome.prompt_tokens = chunk.usage.prompt_tokens
                outcome.cached_tokens = chunk.usage.cached_prompt_tokens
        outcome.done_s = time.monotonic() - start
    except grpc.aio.AioRpcError as e:
        outcome.error = e.code().name
        outcome.error_details = e.details() or ""


async def send(stub: router_pb2_grpc.RouterStub, request: Request, start: float) -> Outcome:
    await asyncio.sleep(max(0.0, start + request.at_s - time.monotonic()))
    sent = time.monotonic()
    outcome = Outcome()
    call = stub.Generate(
        common_pb2.GenerateRequest(
            model=MODEL,
            messages=[common_pb2.ChatMessage(role=r, content=c) for r, c in request.messages],
            sampling=common_pb2.SamplingParams(temperature=0, max_tokens=request.max_tokens),
        ),
        timeout=_REQUEST_TIMEOUT_S,
    )
    await read_stream(call, outcome, sent, start)
    return outcome


async def run_workload(router_address: str, requests: list[Request]) -> tuple[list[Outcome], float]:
    async with grpc.aio.insecure_channel(router_address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        start = time.monotonic()
        outcomes = await asyncio.gather(*(send(stub, r, start) for r in requests))
    return outcomes, max((o.done_s for o in outcomes if o.done_s is not None), default=float("nan"))


def spawn(args: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, *args], env={**os.environ, **env}, preexec_fn=stop_with_parent
    )


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def wait_until(ready: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not ready in time")
        time.sleep(0.2)


def registered(router_address: str) -> int:
    with grpc.insecure_channel(router_address) as channel:
        reply = router_pb2_grpc.RouterStub(channel).ListWorkers(
            router_pb2.ListWorkersRequest(), timeout=1
        )
    return len(reply.workers)


@contextlib.contextmanager
def fleet_router(
    policy: str,
    redis_url: str,
    fleet_command: Sequence[str] = (__file__, "--fleet"),
    workers: int = len(FLEET),
    router_env: Mapping[str, str] = MappingProxyType({}),
) -> Iterator[str]:
    """A fresh router (``policy``, and ``router_env``'s settings) on an emptied Redis, with the
    ``workers`` simulated workers ``fleet_command`` + the router's address serves (default: this
    file's 16) registered; yields its address."""
    redis.Redis.from_url(redis_url).flushall()
    port = free_port()
    env = {
        "OTEL_SDK_DISABLED": "true",
        "INFERMESH_LOG_LEVEL": "ERROR",
        "INFERMESH_ROUTER_TLS_PLAINTEXT": "true",
    }
    router = spawn(
        ["-m", "router_svc"],
        {
            **env,
            "INFERMESH_ROUTER_SERVER_PORT": str(port),
            "INFERMESH_ROUTER_REDIS_URL": redis_url,
            "INFERMESH_ROUTER_ROUTING_POLICY": policy,
            **router_env,
        },
    )
    fleet = None
    try:
        wait_until(lambda: grpc_serving(f"127.0.0.1:{port}"), "the router")
        fleet = spawn([*fleet_command, f"127.0.0.1:{port}"], env)
        wait_until(lambda: registered(f"127.0.0.1:{port}") == workers, "the fleet")
        yield f"127.0.0.1:{port}"
    finally:
        for proc in (fleet, router):
            if proc is not None:
                stop(proc)


def measure(policy: str, redis_url: str, requests: list[Request]) -> tuple[list[Outcome], float]:
    with fleet_router(policy, redis_url) as address:
        return asyncio.run(run_workload(address, requests))


def summarize(policy: str, outcomes: list[Outcome], makespan_s: float) -> dict[str, float]:
    ttfts = sorted(o.ttft_s for o in outcomes if o.ttft_s is not None)
    done = [o for o in outcomes if o.done_s is not None]
    q = statistics.quantiles(ttfts, n=100)
    return {
        "p50": q[49],
        "p99": q[98],
        "tokens_per_s": sum(o.tokens for o in done) / makespan_s,
        "done": len(done),
        "errors": len(outcomes) - len(done),
        "makespan": makespan_s,
        "cached": sum(o.cached_tokens for o in done) / max(sum(o.prompt_tokens for o in done), 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=600)
    parser.add_argument(
        "--load", type=float, default=0.85, help="arrival rate / estimated fleet capacity"
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--fleet", metavar="ROUTER_ADDRESS", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.fleet:
        logging.basicConfig(level=os.environ.get("INFERMESH_LOG_LEVEL", "WARNING"))
        asyncio.run(serve_fleet(args.fleet))
        return
    capacity = fleet_capacity_per_s()
    rate = args.load * capacity
    requests = workload(random.Random(args.seed), args.requests, rate)
    print(
        f"fleet: {len(FLEET)} simulated workers ({', '.join(sorted({g for g, _ in FLEET}))}), "
        f"estimated capacity {capacity:.1f} requests/s; "
        f"offered {rate:.1f}/s, {args.requests} requests",
        flush=True,
    )
    results = {}
    with tempfile.TemporaryDirectory() as workdir, RedisServer(workdir=workdir) as redis_server:
        for policy in POLICIES:
            results[policy] = summarize(policy, *measure(policy, redis_server.url, requests))
            r = results[policy]
            print(
                f"{policy:<12} TTFT p50 {r['p50'] * 1000:7.0f} ms  p99 {r['p99'] * 1000:7.0f} ms  "
                f"{r['tokens_per_s']:7.0f} tokens/s  prefix "
                f"cache {r['cached']:4.0%}  done {r['done']}  "
                f"errors {r['errors']}  makespan {r['makespan']:.1f} s",
                flush=True,
            )
    base, best = results["round_robin"], results["balanced"]
    print(
        f"balanced vs round_robin: p99 TTFT x{best['p99'] / base['p99']:.2f} (target <= 0.5), "
        f"throughput x{best['tokens_per_s'] / base['tokens_per_s']:.2f} (target >= 1.2)"
    )


if __name__ == "__main__":
    main()
