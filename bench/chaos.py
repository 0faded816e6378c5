"""Faults under load (issue #13): a whole mesh of real processes, one fault at a time.

    .venv/bin/python bench/chaos.py [--scenario all] [--concurrency 32] [--down-s 10]
                                    [--revocations 100]

Starts a Redis that persists (append-only file, so a restart keeps the keys, as a
production Redis does), the router, three simulated workers (an L40S profile and a 16 B
model: about 37 ms a token, so streams last seconds and are cut mid-way) and a gateway
(a second one for the revocation scenario), with a stall timeout of 1 s. Closed-loop
clients stream chat completions of ``--max-tokens`` over raw HTTP (every SSE event seen)
with keys of their own, one of them with a requests-per-minute limit. Scenarios:

- ``worker-kill``: one worker SIGKILLed mid-run: requests that had no token yet must
  succeed on another worker, streams that had must end with an error event and [DONE],
  the worker must leave routing within the heartbeat TTL.
- ``worker-freeze``: one worker SIGSTOPped for ``--down-s``: no stream stays silent much
  longer than the stall timeout; the same outcomes as a kill.
- ``redis-restart``: Redis stopped for ``--down-s`` then started: 503 auth_unavailable
  while down (never 401, never admitted unmetered); seconds from its return to service.
- ``router-restart``: the router SIGKILLed for ``--down-s`` then started again: streams in
  flight complete, new requests fail fast with 503 + Retry-After; seconds to service.
- ``router-failover``: a mesh of two routers active-active (one registry in Redis) and two
  gateways, each dialing both routers (``[router] address`` a gRPC list, the first router
  leading for one gateway, the second for the other); the first router SIGKILLed mid-run:
  every request is served (one whose decision the dead router never sent is asked again of
  the other), streams in flight complete, the workers register with the survivor, whose index
  of their caches holds what each worker holds.
- ``revocation``: two gateway processes under load; seconds from the admin API's revoke
  to the first 401 on each, over ``--revocations`` keys.

After each load scenario: per key, usage recorded in Redis equals the tokens the clients
received (a simulated token is one word), and the limited key's requests-per-minute
counter equals the requests it was served (nothing the mesh failed is counted). The
tests in tests/e2e/test_faults.py run each scenario briefly and assert these outcomes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import signal
import tempfile
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")  # this process forks the services

import aiohttp
import grpc
import redis.asyncio as aioredis
from prometheus_client.parser import text_string_to_metric_families

from devtools.mesh import Mesh, MeshSpec
from devtools.redis_server import RedisServer
from gateway.accounts.keys import create_key, key_id, key_tag
from infermesh.pb import router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc
from infermesh.ports import free_port
from infermesh.probe import grpc_serving
from worker_svc.config import DEFAULT_MODEL_PATH

MODEL = "tiny-deepseek-v3"
ADMIN_TOKEN = "chaos-admin-token-0123456789"
STALL_TIMEOUT_S = 1.0
LIMITED_RPM = 100_000  # the limited key's requests per minute: it must count exactly
_FAILURE_PAUSE_S = 0.1  # a client that got an error waits this long, as a real one would
_ENV = {
    "OTEL_SDK_DISABLED": "true",
    "INFERMESH_WORKER_ENGINE_KIND": "sim",
    "INFERMESH_WORKER_ENGINE_GPU": "L40S",
    "INFERMESH_WORKER_ENGINE_TOTAL_PARAMS_B": "16",
    "INFERMESH_WORKER_ENGINE_ACTIVE_PARAMS_B": "16",
    "INFERMESH_GATEWAY_ADMIN_TOKEN": ADMIN_TOKEN,
    "INFERMESH_GATEWAY_ROUTER_STALL_TIMEOUT_S": str(STALL_TIMEOUT_S),
    "INFERMESH_ROUTER_ROUTING_STALL_TIMEOUT_S": str(STALL_TIMEOUT_S),
}


# The router-failover mesh: fewer worker slots than clients, the rest waiting in the routers'
# fair queues, so that asks wait in the router that is killed, longer than the gateway's
# connect timeout (which bounds asking again, not the wait before)
QUEUEING_ENV = {
    "INFERMESH_WORKER_PARALLEL_MAX_PARALLEL": "2",
    "INFERMESH_ROUTER_FAIR_QUEUE_ENABLED": "true",
    "INFERMESH_GATEWAY_ROUTER_CONNECT_TIMEOUT_S": "0.5",
}


@dataclasses.dataclass
class Result:
    """One streamed request as its client saw it (times: time.monotonic())."""

    key: str
    sent: float
    gateway: str = ""  # the base URL it was sent to
    ended: float = 0.0
    status: int = 0  # -1: the connection failed
    code: str = ""  # the error's code, for a status other than 200
    retry_after: str | None = None
    worker: str = ""
    first_token_at: float | None = None
    tokens: int = 0  # delivered: the simulated engine's tokens are words
    finished: bool = False  # a finish_reason came
    error_event: bool = False
    done: bool = False  # [DONE] came
    longest_silence_s: float = 0.0

    @property
    def clean(self) -> bool:
        """A 200 stream ended as a stream must: finished, or an error event; then [DONE]."""
        return self.done and (self.finished or self.error_event)


class ChaosMesh:
    """Persistent Redis, router, three simulated workers, a gateway, and keys; with
    ``routers=2``, two routers and two gateways dialing both (the second router leading for the
    second gateway)."""

    def __init__(
        self,
        workdir: Path,
        workers: int = 3,
        routers: int = 1,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.redis = RedisServer(workdir=workdir / "redis", persistent=True)
        (workdir / "redis").mkdir(parents=True)
        (workdir / "logs").mkdir()
        self.mesh = Mesh(
            MeshSpec(
                redis_url=self.redis.url,
                model_path=DEFAULT_MODEL_PATH,
                gateway_port=free_port(),
                router_port=free_port(),
                worker_ports=tuple(free_port() for _ in range(workers)),
                env={**_ENV, **(env or {})},
                log_dir=workdir / "logs",
                extra_router_ports=tuple(free_port() for _ in range(routers - 1)),
                router_env=tuple(
                    {"INFERMESH_ROUTER_METRICS_PORT": str(free_port())} for _ in range(routers)
                ),
            )
        )
        self.base_urls = [self.mesh.spec.base_url]
        self.keys: list[str] = []
        self.limited_key = ""

    @property
    def base_url(self) -> str:
        return self.mesh.spec.base_url

    def router_metrics_url(self, i: int) -> str:
        port = self.mesh.spec.router_env[i]["INFERMESH_ROUTER_METRICS_PORT"]
        return f"http://127.0.0.1:{port}/metrics"

    def worker_id(self, i: int) -> str:
        return f"worker-127.0.0.1:{self.mesh.spec.worker_ports[i]}"

    async def __aenter__(self) -> ChaosMesh:
        self.redis.start()
        try:
            await asyncio.to_thread(self.mesh.start)
            spec = self.mesh.spec
            for i in range(1, len(spec.router_ports)):
                port = free_port()
                env = {"INFERMESH_GATEWAY_ROUTER_ADDRESS": spec.router_target(first=i)}
                await asyncio.to_thread(self.mesh.add_gateway, f"gateway{i + 1}", port, env)
                self.base_urls.append(f"http://127.0.0.1:{port}/v1")
            async with aioredis.Redis.from_url(self.redis.url) as client:
                self.keys = [await create_key(client, f"chaos-{i}") for i in range(3)]
                self.limited_key = await create_key(client, "chaos-limited", rpm=LIMITED_RPM)
        except BaseException:
            await self.__aexit__()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.to_thread(self.mesh.stop)
        self.redis.stop()

    @property
    def all_keys(self) -> list[str]:
        return [*self.keys, self.limited_key]

    async def routed_workers(self, router: int = 0) -> set[str]:
        """The workers router ``router`` (0: the first) routes to."""
        address = f"127.0.0.1:{self.mesh.spec.router_ports[router]}"
        async with grpc.aio.insecure_channel(address) as channel:
            reply = await router_pb2_grpc.RouterStub(channel).ListWorkers(
                router_pb2.ListWorkersRequest(), timeout=1
            )
        return {w.worker.worker_id for w in reply.workers}

    async def wait_for_workers(self, count: int, timeout_s: float = 30.0, router: int = 0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            with contextlib.suppress(grpc.aio.AioRpcError):
                if len(await self.routed_workers(router)) >= count:
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"fewer than {count} workers registered in {timeout_s} s")
            await asyncio.sleep(0.05)


async def stream_chat(
    session: aiohttp.ClientSession,
    base_url: str,
    key: str,
    max_tokens: int,
    content: str = "Tell the chaos monkey a story.",
) -> Result:
    """One streamed chat completion, every SSE event timed."""
    result = Result(key=key, sent=time.monotonic())
    body = {
        "model": MODEL,
        "stream": True,
        "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": content}],
    }
    try:
        async with session.post(
            f"{base_url}/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
        ) as response:
            result.status = response.status
            result.worker = response.headers.get("x-infermesh-worker", "")
            result.retry_after = response.headers.get("Retry-After")
            if response.status != 200:
                result.code = (await response.json())["error"]["code"] or ""
            else:
                await _read_events(response, result)
    except aiohttp.ClientError as e:
        result.status, result.code = -1, type(e).__name__
    result.ended = time.monotonic()
    return result


async def _read_events(response: aiohttp.ClientResponse, result: Result) -> None:
    last = time.monotonic()
    async for line in response.content:
        if not line.startswith(b"data: "):
            continue
        now = time.monotonic()
        result.longest_silence_s = max(result.longest_silence_s, now - last)
        last = now
        data = line[6:].strip()
        if data == b"[DONE]":
            result.done = True
            continue
        event = json.loads(data)
        if "error" in event:
            result.error_event = True
            continue
        for choice in event["choices"]:
            words = len((choice["delta"].get("content") or "").split())
            if words and result.first_token_at is None:
                result.first_token_at = now
            result.tokens += words
            result.finished = result.finished or choice.get("finish_reason") is not None


@contextlib.asynccontextmanager
async def load(
    base_url: str, keys: Sequence[str], concurrency: int, max_tokens: int
) -> AsyncIterator[list[Result]]:
    """Closed-loop clients for the time of the block; the list fills as requests end."""
    results: list[Result] = []
    stop = asyncio.Event()
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=120)

    async def client(i: int, session: aiohttp.ClientSession) -> None:
        while not stop.is_set():
            result = await stream_chat(session, base_url, keys[i % len(keys)], max_tokens)
            results.append(result)
            if result.status != 200:
                await asyncio.sleep(_FAILURE_PAUSE_S)

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        clients = [asyncio.create_task(client(i, session)) for i in range(concurrency)]
        try:
            yield results
        finally:
            stop.set()
            await asyncio.gather(*clients)


@dataclasses.dataclass
class Accounts:
    """What Redis recorded against what the clients received, per key."""

    recorded: dict[str, tuple[int, int]]  # key -> (requests, completion tokens)
    delivered: dict[str, tuple[int, int]]
    limited_rpm_counted: int
    limited_served: int

    @property
    def consistent(self) -> bool:
        return self.recorded == self.delivered and self.limited_rpm_counted == self.limited_served


async def accounts(
    chaos: ChaosMesh,
    results: Sequence[Result],
    timeout_s: float = 15.0,
) -> Accounts:
    """Waits (up to ``timeout_s``: settlements may wait for Redis) until Redis holds the
    usage of every served request, then compares. A request the client was served is a
    200; it counts whether or not a worker failed after its first token."""
    delivered = {
        k: (
            sum(1 for r in results if r.key == k and r.status == 200),
            sum(r.tokens for r in results if r.key == k and r.status == 200),
        )
        for k in chaos.all_keys
    }
    async with aioredis.Redis.from_url(chaos.redis.url) as client:
        deadline = time.monotonic() + timeout_s
        while True:
            recorded = {}
            for k in chaos.all_keys:
                usage = await client.hgetall(f"infermesh:usage:{key_tag(key_id(k))}")
                recorded[k] = (
                    int(usage.get(b"requests", 0)),
                    int(usage.get(b"completion_tokens", 0)),
                )
            if recorded == delivered or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.1)
        buckets = await client.hgetall(f"infermesh:rl:{key_tag(key_id(chaos.limited_key))}:rpm")
    return Accounts(
        recorded, delivered, sum(int(v) for v in buckets.values()), delivered[chaos.limited_key][0]
    )


def statuses(results: Sequence[Result]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in results:
        name = str(r.status) + (f" {r.code}" if r.code else "")
        counts[name] = counts.get(name, 0) + 1
    return dict(sorted(counts.items()))


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def reset_usage(chaos: ChaosMesh) -> None:
    """Usage and counters from zero, so each scenario's accounts stand alone."""
    async with aioredis.Redis.from_url(chaos.redis.url) as client:
        for k in chaos.all_keys:
            await client.delete(
                f"infermesh:usage:{key_tag(key_id(k))}", f"infermesh:rl:{key_tag(key_id(k))}:rpm"
            )


async def worker_fault(
    chaos: ChaosMesh,
    *,
    freeze_s: float | None,
    concurrency: int,
    before_s: float,
    after_s: float,
    max_tokens: int,
) -> dict[str, object]:
    """Worker 0 SIGKILLed (``freeze_s`` None) or SIGSTOPped for ``freeze_s`` mid-run."""
    await reset_usage(chaos)
    victim = chaos.worker_id(0)
    async with load(chaos.base_url, chaos.all_keys, concurrency, max_tokens) as results:
        await asyncio.sleep(before_s)
        struck = time.monotonic()
        if freeze_s is None:
            chaos.mesh.kill("worker0")
        else:
            chaos.mesh.signal("worker0", signal.SIGSTOP)
        left_routing_s = await _seconds_until_gone(chaos, victim, 30.0)
        if freeze_s is not None:
            await asyncio.sleep(max(freeze_s - (time.monotonic() - struck), 0))
            chaos.mesh.signal("worker0", signal.SIGCONT)
        await asyncio.sleep(after_s)
    hit = [r for r in results if r.worker == victim and r.sent < struck < r.ended]
    cut = [
        r
        for r in hit
        if r.status == 200
        and r.first_token_at is not None
        and r.first_token_at < struck
        and not r.finished
    ]
    figures = {
        "requests": len(results),
        "statuses": statuses(results),
        "failed (not 200)": sum(1 for r in results if r.status != 200),
        "streams not ended cleanly": sum(1 for r in results if r.status == 200 and not r.clean),
        "in flight on the worker": len(hit),
        "cut mid-stream (error event + [DONE])": sum(1 for r in cut if r.error_event and r.done),
        "cut mid-stream, other ending": sum(1 for r in cut if not (r.error_event and r.done)),
        "left routing after s": round(left_routing_s, 2),
        "longest silence of a stream s": round(
            max((r.longest_silence_s for r in results), default=0), 2
        ),
        "accounts": await accounts(chaos, results),
    }
    if freeze_s is None:
        chaos.mesh.respawn("worker0")
    await chaos.wait_for_workers(len(chaos.mesh.spec.worker_ports))
    return figures


async def _seconds_until_gone(chaos: ChaosMesh, worker: str, timeout_s: float) -> float:
    started = time.monotonic()
    while worker in await chaos.routed_workers():
        if time.monotonic() - started > timeout_s:
            raise TimeoutError(f"{worker} still routed after {timeout_s} s")
        await asyncio.sleep(0.05)
    return time.monotonic() - started


async def outage(
    chaos: ChaosMesh,
    what: str,
    *,
    down_s: float,
    concurrency: int,
    before_s: float,
    after_s: float,
    max_tokens: int,
) -> dict[str, object]:
    """Redis (``what`` "redis") stopped, or the router ("router") SIGKILLed, for ``down_s``
    under load, then started again; the figures of the outage and of the recovery."""
    await reset_usage(chaos)
    async with load(chaos.base_url, chaos.all_keys, concurrency, max_tokens) as results:
        await asyncio.sleep(before_s)
        down_at = time.monotonic()
        if what == "redis":
            await asyncio.to_thread(chaos.redis.stop)
        else:
            chaos.mesh.kill("router")
        await asyncio.sleep(down_s)
        if what == "redis":
            await asyncio.to_thread(chaos.redis.start)
        else:
            chaos.mesh.respawn("router")
            await _until_serving(chaos.mesh.spec.router_address, 30.0)
        back_at = time.monotonic()
        await asyncio.sleep(after_s)
    in_flight = [r for r in results if r.sent < down_at < r.ended and r.status == 200]
    during = [r for r in results if down_at <= r.sent and r.ended <= back_at]
    # recovery, from when the probe saw the service back: the first request sent after the
    # fault that was served, and the end of the last one that failed (<= 0: none after)
    first_ok = min(
        (r.sent for r in results if r.sent >= down_at and r.status == 200), default=float("nan")
    )
    last_failure = max((r.ended for r in results if r.status != 200), default=back_at)
    failing = [r.ended - r.sent for r in during if r.status != 200]
    return {
        "requests": len(results),
        "statuses": statuses(results),
        "in flight at the fault": len(in_flight),
        "in flight, completed": sum(1 for r in in_flight if r.finished and r.done),
        "during the outage": statuses(during),
        "401 at any time": sum(1 for r in results if r.status == 401),
        "503 without Retry-After": sum(
            1 for r in results if r.status == 503 and r.retry_after is None
        ),
        "failure latency p50/p99/max s": [
            round(percentile(failing, q), 3) for q in (0.5, 0.99, 1.0)
        ],
        "first served request sent, s after return": round(first_ok - back_at, 2),
        "last failure ended, s after return": round(last_failure - back_at, 2),
        "streams not ended cleanly": sum(1 for r in results if r.status == 200 and not r.clean),
        "accounts": await accounts(chaos, results),
    }


async def _until_serving(address: str, timeout_s: float) -> None:
    """Probes the gRPC health service (from a thread: the clients' loop must not wait)."""
    deadline = time.monotonic() + timeout_s
    while not await asyncio.to_thread(grpc_serving, address, 0.2):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{address} not serving within {timeout_s} s")
        await asyncio.sleep(0.02)


async def router_failover(
    chaos: ChaosMesh,
    *,
    concurrency: int,
    before_s: float,
    after_s: float,
    max_tokens: int,
) -> dict[str, object]:
    """The first of two routers SIGKILLed under load through both gateways, then started again;
    what the clients saw, and the survivor's view of the workers and their caches."""
    await reset_usage(chaos)
    first, second = chaos.base_urls
    async with (
        load(first, chaos.all_keys, concurrency // 2, max_tokens) as results,
        load(second, chaos.all_keys, concurrency - concurrency // 2, max_tokens) as more,
    ):
        await asyncio.sleep(before_s)
        killed_at = time.monotonic()
        chaos.mesh.kill("router")
        await asyncio.sleep(after_s)
    results = [*results, *more]
    in_flight = [r for r in results if r.sent < killed_at < r.ended and r.status == 200]
    counted = await accounts(chaos, results)
    # prompts of several blocks each, so that every worker caches blocks the index must hold
    async with aiohttp.ClientSession() as session:
        cached = await asyncio.gather(
            *(
                stream_chat(session, first, chaos.keys[0], 4, f"{i}: " + "a story of blocks. " * 20)
                for i in range(3 * len(chaos.mesh.spec.worker_ports))
            )
        )
    figures = {
        "requests": len(results),
        "statuses": statuses(results),
        "failed (not 200)": sum(1 for r in results if r.status != 200),
        "sent after the kill": sum(1 for r in results if r.sent >= killed_at),
        "in flight at the kill": len(in_flight),
        "of them, no token yet (queued or in prefill)": sum(
            1 for r in in_flight if r.first_token_at is None or r.first_token_at > killed_at
        ),
        "in flight, completed": sum(1 for r in in_flight if r.finished and r.done),
        "streams not ended cleanly": sum(1 for r in results if r.status == 200 and not r.clean),
        "long prompts served after the load": sum(1 for r in cached if r.status == 200),
        "workers on the surviving router": len(await chaos.routed_workers(router=1)),
        "index blocks / cached blocks per worker": await _index_against_caches(chaos, router=1),
        "accounts": counted,
    }
    chaos.mesh.respawn("router")
    await _until_serving(chaos.mesh.spec.router_address, 30.0)
    return figures


async def _index_against_caches(
    chaos: ChaosMesh, router: int, timeout_s: float = 5.0
) -> dict[str, tuple[int, int]]:
    """Per worker: the blocks router ``router``'s index holds for it (its metrics) and the blocks
    the worker holds (its CacheEvents snapshot), once they agree or after ``timeout_s`` (the
    last cache events may still be on their way)."""
    deadline = time.monotonic() + timeout_s
    while True:
        held = {}
        for i, port in enumerate(chaos.mesh.spec.worker_ports):
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                call = worker_pb2_grpc.WorkerStub(channel).CacheEvents(
                    worker_pb2.CacheEventsRequest(), timeout=5
                )
                snapshot = await call.read()
                call.cancel()
            held[chaos.worker_id(i)] = len(snapshot.stored)  # one chunk: under 65,536 blocks
        async with (
            aiohttp.ClientSession() as session,
            session.get(chaos.router_metrics_url(router)) as response,
        ):
            text = await response.text()
        indexed = {
            sample.labels["worker"]: int(sample.value)
            for family in text_string_to_metric_families(text)
            if family.name == "infermesh_router_index_blocks"
            for sample in family.samples
        }
        compared = {w: (indexed.get(w, 0), n) for w, n in held.items()}
        if all(i == n for i, n in compared.values()) or time.monotonic() > deadline:
            return compared
        await asyncio.sleep(0.1)


async def revocations(
    chaos: ChaosMesh,
    count: int,
    concurrency: int,
    max_tokens: int,
) -> dict[str, object]:
    """Seconds from the admin call that revokes a key to the first 401 on each of two
    gateway processes, whose clients use the key without pause, while ``concurrency``
    other clients stream through both gateways."""
    second_port = free_port()
    await asyncio.to_thread(chaos.mesh.add_gateway, "gateway2", second_port)
    gateways = [
        f"http://127.0.0.1:{chaos.mesh.spec.gateway_port}",
        f"http://127.0.0.1:{second_port}",
    ]
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    delays: list[list[float]] = [[], []]
    async with (
        load(f"{gateways[0]}/v1", chaos.keys, concurrency // 2, max_tokens),
        load(f"{gateways[1]}/v1", chaos.keys, concurrency - concurrency // 2, max_tokens),
        aiohttp.ClientSession() as session,
    ):
        for _ in range(count):
            async with session.post(
                f"{gateways[0]}/admin/keys", json={"name": "revoked"}, headers=admin
            ) as response:
                created = await response.json()
            for base in gateways:  # warm: each gateway has authenticated (and cached) it
                await until_status(session, base, created["key"], 200)
            started = time.monotonic()
            watchers = [
                asyncio.create_task(until_status(session, base, created["key"], 401))
                for base in gateways
            ]
            async with session.post(
                f"{gateways[1]}/admin/keys/{created['id']}/revoke", headers=admin
            ) as response:
                assert response.status == 200, await response.text()
            for i, ended in enumerate(await asyncio.gather(*watchers)):
                delays[i].append(ended - started)
    return {
        f"gateway{i + 1} to 401 p50/p99/max s": [
            round(percentile(d, q), 3) for q in (0.5, 0.99, 1.0)
        ]
        for i, d in enumerate(delays)
    }


async def until_status(
    session: aiohttp.ClientSession, base: str, key: str, status: int, timeout_s: float = 10.0
) -> float:
    """Lists models with ``key`` until the answer has ``status``; returns when it did."""
    deadline = time.monotonic() + timeout_s
    while True:
        async with session.get(
            f"{base}/v1/models", headers={"Authorization": f"Bearer {key}"}
        ) as response:
            if response.status == status:
                return time.monotonic()
        if time.monotonic() > deadline:
            raise TimeoutError(f"{base} never answered {status}")


def _print(name: str, figures: dict[str, object]) -> None:
    print(f"\n== {name}")
    for label, value in figures.items():
        if isinstance(value, Accounts):
            print(
                f"  usage recorded == tokens delivered, per "
                f"key: {value.recorded == value.delivered}"
                f" (served {sum(r for r, _ in value.delivered.values())} requests, "
                f"{sum(t for _, t in value.delivered.values())} tokens)"
            )
            print(
                f"  limited key's rpm counter == requests served: {value.limited_rpm_counted} "
                f"== {value.limited_served}"
            )
        else:
            print(f"  {label}: {value}")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--scenario",
        default="all",
        choices=[
            "all",
            "worker-kill",
            "worker-freeze",
            "redis-restart",
            "router-restart",
            "router-failover",
            "revocation",
        ],
    )
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--down-s", type=float, default=10.0)
    parser.add_argument("--before-s", type=float, default=5.0)
    parser.add_argument("--after-s", type=float, default=10.0)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--revocations", type=int, default=100)
    parser.add_argument(
        "--workdir",
        type=Path,
        help="an empty directory for Redis's file and "
        "the services' logs, kept afterwards (default: a temporary one)",
    )
    args = parser.parse_args()
    if args.workdir is not None:
        await _run(args, args.workdir)
        return
    with tempfile.TemporaryDirectory(prefix="chaos-") as workdir:
        await _run(args, Path(workdir))


async def _run(args: argparse.Namespace, workdir: Path) -> None:
    def wanted(scenario: str) -> bool:
        return args.scenario in ("all", scenario)

    common = {
        "concurrency": args.concurrency,
        "before_s": args.before_s,
        "after_s": args.after_s,
        "max_tokens": args.max_tokens,
    }
    async with ChaosMesh(workdir) as chaos:
        if wanted("worker-kill"):
            _print("worker SIGKILLed", await worker_fault(chaos, freeze_s=None, **common))
        if wanted("worker-freeze"):
            _print(
                f"worker SIGSTOPped for {args.down_s:g} s",
                await worker_fault(chaos, freeze_s=args.down_s, **common),
            )
        if wanted("redis-restart"):
            _print(
                f"Redis stopped for {args.down_s:g} s",
                await outage(chaos, "redis", down_s=args.down_s, **common),
            )
        if wanted("router-restart"):
            _print(
                f"router SIGKILLed for {args.down_s:g} s",
                await outage(chaos, "router", down_s=args.down_s, **common),
            )
        if wanted("revocation"):
            _print(
                f"revocation, {args.revocations} keys, two gateways",
                await revocations(chaos, args.revocations, args.concurrency, args.max_tokens),
            )
    if wanted("router-failover"):
        async with ChaosMesh(workdir / "routers", routers=2, env=QUEUEING_ENV) as chaos:
            _print(
                "the first of two routers SIGKILLed, two gateways dialing both",
                await router_failover(chaos, **common),
            )


if __name__ == "__main__":
    asyncio.run(main())
