"""Faults the network makes (issue #48), on a mesh of real processes in a private network
namespace: partitions without a reset, packet loss, a narrow link.

    .venv/bin/python bench/network_faults.py [--scenario all] [--fault-s 30] [--concurrency 32]
                                             [--json FILE]

Needs root (``tests/helpers/netfault.py``): the process moves itself into a network namespace
of its own, then starts Redis, two routers, three simulated workers and two gateways there
(bench/chaos.py's ``ChaosMesh``, a stall timeout of 1 s), and streaming clients of the
official ``openai`` SDK through both gateways, every token counted. Scenarios:

- ``worker-black-hole``: worker 0's every packet dropped mid-run for ``--fault-s``: its streams
  end with the mesh's error event within the stall timeout, the routers stop choosing it, it
  serves again after the heal without a restart;
- ``packet-loss``: 5 % of the packets of worker 0's port, then of the first router's, dropped
  for ``--fault-s`` each, against as long a run without loss: every request completes; the p99
  latency each adds;
- ``router-redis-partition``: the first router cut from Redis for ``--fault-s``: requests keep
  being served through the second, no worker leaves the second's fleet;
- ``gateway-redis-partition``: the second gateway cut from Redis for ``--fault-s``: its
  requests fail closed (503, ``Retry-After``) within ``[redis] timeout_s``, it answers
  ``/health`` meanwhile, the usage of the streams it served lands after the heal;
- ``narrow-link``: a port narrowed to 100 Mb/s with htb: the rate a bulk transfer from it gets,
  against the same transfer unnarrowed and after the heal;
- ``kv-pull-narrow-link``: a KV pull from a busy holder whose port is narrowed to 100 Mb/s, on a
  router of its own (``[routing] link_gbps = 100``) with two simulated DeepSeek-V3 workers whose
  blocks carry their bytes: the pull passes its deadline and the worker computes the rest (the
  answer the holder gave), and the router's estimate of that link learns the narrower link from
  the worker's heartbeat (``infermesh_router_link_gbps``).

Every scenario: requests, failed, hung (no end by the client's deadline), the seconds to detect
and to recover, usage recorded in Redis against the tokens the clients received (a cut stream's
tokens are delivered tokens), and API keys found in the services' logs. Prints the figures;
``--json`` writes them (tests/e2e/test_network_faults.py runs all scenarios briefly).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

# this process forks the services after it probed them over gRPC: gRPC's fork handlers could
# hang the fork (its shutdown thread running); set before grpc is first imported (bench.chaos
# sets it too, for its own runs)
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

import aiohttp
import grpc
import openai
from prometheus_client import REGISTRY

from bench.chaos import (
    MODEL,
    STALL_TIMEOUT_S,
    ChaosMesh,
    Result,
    accounts,
    percentile,
    reset_usage,
    statuses,
)
from infermesh.pb import common_pb2, router_pb2, router_pb2_grpc
from infermesh.prefix_hash import BLOCK_TOKENS, chain
from infermesh.sim_tokens import BYTES_PER_TOKEN, prompt_text, sim_token_ids
from router_svc.config import RoutingSection
from telemetry import metrics
from tests.helpers.inprocess import gateway_complete, running_router, running_worker, sim_engine
from tests.helpers.netfault import NetFaults, Service, enter_private_network
from tests.helpers.worker_client import worker_client

REDIS_TIMEOUT_S = 1.0  # the gateways' [redis] timeout_s here
# the routers' [routing] eject_cooldown_s here: a worker that failed calls and came back
# before its registry entry expired is routed to again once its cooldown ends
EJECT_COOLDOWN_S = 2.0
CLIENT_DEADLINE_S = 20.0  # a request not ended by then is hung
_POLL_S = 0.05
_BULK_BYTES = 4 * 1024 * 1024  # the narrow link's transfer: 0.34 s at 100 Mb/s
# The KV pull's prompt: 100 blocks of DeepSeek-V3's KV cache, 112 MB (9 s at 100 Mb/s, 9 ms at
# the configured 100 Gb/s); on an A100 profile slowed 125 times its prefill takes 2.5 s (the
# pull's deadline) and a decode step 0.24 s, so that a few 8 MiB messages come before it.
_PULL_TOKENS = 1600
_PULL_TIME_SCALE = 125.0
_PULL_LINK_GBPS = 100.0
_PULL_MAX_TOKENS = 2
_PULL_WAIT_S = 10.0  # for an index, a load or a heartbeat to reach the router
_ENV = {
    "INFERMESH_GATEWAY_REDIS_TIMEOUT_S": str(REDIS_TIMEOUT_S),
    "INFERMESH_ROUTER_ROUTING_EJECT_COOLDOWN_S": str(EJECT_COOLDOWN_S),
}


class Clients:
    """One ``openai.AsyncOpenAI`` per (gateway, key), streaming closed-loop."""

    def __init__(self, base_urls: Sequence[str], keys: Sequence[str]) -> None:
        self.keys = list(keys)
        self.clients = {
            (url, key): openai.AsyncOpenAI(
                base_url=url, api_key=key, max_retries=0, timeout=CLIENT_DEADLINE_S
            )
            for url in base_urls
            for key in keys
        }

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self.clients.values()))

    async def one(self, base_url: str, key: str, max_tokens: int) -> Result:
        """A streamed chat completion as the SDK gives it: tokens counted until its end."""
        result = Result(key=key, sent=time.monotonic(), gateway=base_url)
        client = self.clients[(base_url, key)]
        try:
            raw = await client.chat.completions.with_raw_response.create(
                model=MODEL,
                stream=True,
                max_tokens=max_tokens,
                messages=[{"role": "user", "content": "Tell the network a story."}],
            )
            result.status = 200
            result.worker = raw.headers.get("x-infermesh-worker", "")
            last = time.monotonic()
            async for chunk in raw.parse():
                now = time.monotonic()
                result.longest_silence_s = max(result.longest_silence_s, now - last)
                last = now
                for choice in chunk.choices:
                    words = len((choice.delta.content or "").split())
                    if words and result.first_token_at is None:
                        result.first_token_at = now
                    result.tokens += words
                    result.finished = result.finished or choice.finish_reason is not None
            result.done = True
        except openai.APIStatusError as e:
            result.status = e.status_code
            result.retry_after = e.response.headers.get("retry-after")
            result.code = (e.body or {}).get("code", "") if isinstance(e.body, dict) else ""
        except openai.APITimeoutError:
            result.status, result.code = -2, "hung"
        except openai.APIConnectionError as e:
            result.status, result.code = -1, type(e.__cause__ or e).__name__
        except openai.APIError:  # the mesh's error event: a stream cut mid-way
            result.error_event = result.done = True
        result.ended = time.monotonic()
        return result

    @contextlib.asynccontextmanager
    async def load(
        self, base_urls: Sequence[str], concurrency: int, max_tokens: int
    ) -> AsyncIterator[list[Result]]:
        """``concurrency`` closed-loop clients spread over the gateways for the block."""
        results: list[Result] = []
        stop = asyncio.Event()

        async def client(i: int) -> None:
            url, key = base_urls[i % len(base_urls)], self.keys[i % len(self.keys)]
            while not stop.is_set():
                result = await self.one(url, key, max_tokens)
                results.append(result)
                if result.status != 200:
                    await asyncio.sleep(0.1)

        tasks = [asyncio.create_task(client(i)) for i in range(concurrency)]
        try:
            yield results
        finally:
            stop.set()
            await asyncio.gather(*tasks)


class FaultMesh:
    """The ChaosMesh of two routers and two gateways, its faults by service name, its clients."""

    def __init__(self, workdir: Path) -> None:
        self.chaos = ChaosMesh(workdir, routers=2, env=_ENV)
        self.faults: NetFaults | None = None
        self.clients: Clients | None = None

    async def __aenter__(self) -> FaultMesh:
        await self.chaos.__aenter__()
        mesh = self.chaos.mesh
        spec = mesh.spec
        gateway_ports = [int(url.rsplit(":", 1)[1].split("/")[0]) for url in self.chaos.base_urls]
        services = {"redis": Service(self.chaos.redis.port)}
        for name, port in zip(spec.router_names, spec.router_ports, strict=True):
            services[name] = Service(port, mesh.pid(name))
        for i, port in enumerate(spec.worker_ports):
            services[f"worker{i}"] = Service(port, mesh.pid(f"worker{i}"))
        for i, port in enumerate(gateway_ports):
            name = "gateway" if i == 0 else f"gateway{i + 1}"
            services[name] = Service(port, mesh.pid(name))
        self.faults = NetFaults(services)
        self.clients = Clients(self.chaos.base_urls, self.chaos.all_keys)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.clients is not None:
            await self.clients.close()
        if self.faults is not None:
            self.faults.__exit__()
        await self.chaos.__aexit__()

    async def workers_seen(self, router: int) -> dict[str, bool]:
        """Worker id -> ejected, as router ``router`` lists them (empty when it cannot)."""
        address = f"127.0.0.1:{self.chaos.mesh.spec.router_ports[router]}"
        try:
            async with grpc.aio.insecure_channel(address) as channel:
                reply = await router_pb2_grpc.RouterStub(channel).ListWorkers(
                    router_pb2.ListWorkersRequest(), timeout=0.5
                )
        except grpc.aio.AioRpcError:
            return {}
        return {w.worker.worker_id: w.ejected for w in reply.workers}

    def secrets_in_logs(self) -> int:
        """How many times an API key appears in the services' logs."""
        logs = self.chaos.mesh.spec.log_dir
        assert logs is not None
        text = "".join(p.read_text(errors="replace") for p in logs.glob("*.log"))
        return sum(text.count(key) for key in self.chaos.all_keys)


async def _until(check: Callable[[], Any], timeout_s: float) -> float:
    """Seconds until ``await check()`` is true (NaN when it never was within ``timeout_s``)."""
    started = time.monotonic()
    while not await check():
        if time.monotonic() - started > timeout_s:
            return float("nan")
        await asyncio.sleep(_POLL_S)
    return time.monotonic() - started


def _common(fm: FaultMesh, results: Sequence[Result], counted: Any) -> dict[str, Any]:
    recorded = sum(t for _, t in counted.recorded.values())
    delivered = sum(t for _, t in counted.delivered.values())
    return {
        "requests": len(results),
        "failed": sum(1 for r in results if r.status != 200),
        "hung": sum(1 for r in results if r.status == -2),
        "statuses": statuses(results),
        "cut mid-stream": sum(1 for r in results if r.error_event),
        "tokens delivered": delivered,
        "usage difference (tokens)": recorded - delivered,
        "usage per key exact": counted.recorded == counted.delivered,
        "secrets in logs": fm.secrets_in_logs(),
    }


async def worker_black_hole(
    fm: FaultMesh, *, fault_s: float, concurrency: int, max_tokens: int, before_s: float = 0.5
) -> dict[str, Any]:
    """Worker 0 dropped off the network mid-run for ``fault_s``, then healed."""
    assert fm.faults is not None and fm.clients is not None
    await reset_usage(fm.chaos)
    victim = fm.chaos.worker_id(0)
    routers = range(len(fm.chaos.mesh.spec.router_ports))

    async def avoided() -> bool:
        seen = [await fm.workers_seen(r) for r in routers]
        return all(s.get(victim, True) for s in seen if s)

    async def back() -> bool:
        seen = [await fm.workers_seen(r) for r in routers]
        return all(s.get(victim) is False for s in seen)

    async with fm.clients.load(fm.chaos.base_urls, concurrency, max_tokens) as results:
        await asyncio.sleep(before_s)
        struck = time.monotonic()
        fm.faults.black_hole("worker0")
        detect_s = await _until(avoided, fault_s + 10)
        await asyncio.sleep(max(fault_s - (time.monotonic() - struck), 0))
        fm.faults.heal("worker0")
        healed = time.monotonic()
        recover_s = await _until(back, 30)

        async def served_by_it() -> bool:  # a stream's worker is known once it ended
            return any(r.worker == victim and r.sent > healed for r in results)

        await _until(served_by_it, 10)
    served_after = [r.sent - healed for r in results if r.worker == victim and r.sent > healed]
    cut = [r for r in results if r.worker == victim and r.sent < struck < r.ended]
    counted = await accounts(fm.chaos, results)
    return {
        **_common(fm, results, counted),
        "in flight on the worker": len(cut),
        "of them ended with the error event": sum(1 for r in cut if r.error_event),
        "of them ended s after the fault (max)": round(
            max((r.ended - struck for r in cut), default=0.0), 2
        ),
        "longest silence of a stream s": round(
            max((r.longest_silence_s for r in results), default=0.0), 2
        ),
        "time to detect s": round(detect_s, 2),
        "time to recover s": round(recover_s, 2),
        "first request served by it after the heal, s": round(min(served_after, default=-1), 2),
    }


async def _latencies(
    fm: FaultMesh, duration_s: float, concurrency: int, max_tokens: int
) -> list[Result]:
    assert fm.clients is not None
    async with fm.clients.load(fm.chaos.base_urls, concurrency, max_tokens) as results:
        await asyncio.sleep(duration_s)
    return list(results)


async def packet_loss(
    fm: FaultMesh, *, fault_s: float, concurrency: int, max_tokens: int, share: float = 0.05
) -> dict[str, Any]:
    """``share`` of the packets of worker 0's port, then of the first router's, dropped for
    ``fault_s`` each; the latency against a run as long without loss."""
    assert fm.faults is not None
    await reset_usage(fm.chaos)
    baseline = await _latencies(fm, fault_s, concurrency, max_tokens)
    everything = list(baseline)
    figures: dict[str, Any] = {"p99 without loss s": _p99(baseline)}
    for service in ("worker0", "router"):
        fm.faults.drop(service, share)
        try:
            lossy = await _latencies(fm, fault_s, concurrency, max_tokens)
        finally:
            fm.faults.heal(service)
        everything += lossy
        figures[f"{service}: requests"] = len(lossy)
        figures[f"{service}: failed or cut"] = sum(
            1 for r in lossy if r.status != 200 or not r.finished
        )
        figures[f"{service}: p99 s"] = _p99(lossy)
        figures[f"{service}: p99 added s"] = round(_p99(lossy) - _p99(baseline), 3)
    counted = await accounts(fm.chaos, everything)
    return {**_common(fm, everything, counted), **figures}


def _p99(results: Sequence[Result]) -> float:
    done = [r.ended - r.sent for r in results if r.status == 200]
    return round(percentile(done, 0.99), 3)


async def router_redis_partition(
    fm: FaultMesh, *, fault_s: float, concurrency: int, max_tokens: int, before_s: float = 0.5
) -> dict[str, Any]:
    """The first router cut from Redis for ``fault_s`` while both gateways serve."""
    assert fm.faults is not None and fm.clients is not None
    await reset_usage(fm.chaos)
    workers = len(fm.chaos.mesh.spec.worker_ports)
    fewest = workers
    async with fm.clients.load(fm.chaos.base_urls, concurrency, max_tokens) as results:
        await asyncio.sleep(before_s)
        struck = time.monotonic()
        fm.faults.black_hole("router", peer="redis")
        while time.monotonic() - struck < fault_s:
            seen = await fm.workers_seen(1)
            fewest = min(fewest, sum(1 for ejected in seen.values() if not ejected))
            await asyncio.sleep(0.1)
        fm.faults.heal("router")
        healed = time.monotonic()

        async def both_full() -> bool:
            seen = [await fm.workers_seen(r) for r in (0, 1)]
            return all(len(s) == workers for s in seen)

        recover_s = await _until(both_full, 30)
        await asyncio.sleep(0.5)
    during = [r for r in results if struck <= r.sent and r.ended <= healed]
    counted = await accounts(fm.chaos, results)
    return {
        **_common(fm, results, counted),
        "sent and ended during the cut": len(during),
        "of them failed": sum(1 for r in during if r.status != 200),
        "fewest workers the other router routed to": fewest,
        "time to recover s": round(recover_s, 2),
    }


async def gateway_redis_partition(
    fm: FaultMesh, *, fault_s: float, concurrency: int, max_tokens: int, before_s: float = 0.5
) -> dict[str, Any]:
    """The second gateway cut from Redis for ``fault_s`` while both serve."""
    assert fm.faults is not None and fm.clients is not None
    await reset_usage(fm.chaos)
    cut_url = fm.chaos.base_urls[1]
    health_url = cut_url.removesuffix("/v1") + "/health"
    health_s: list[float] = []
    async with (
        fm.clients.load(fm.chaos.base_urls, concurrency, max_tokens) as results,
        aiohttp.ClientSession() as session,
    ):
        await asyncio.sleep(before_s)
        struck = time.monotonic()
        fm.faults.black_hole("gateway2", peer="redis")
        while time.monotonic() - struck < fault_s:
            asked = time.monotonic()
            async with session.get(health_url) as response:
                await response.read()
            health_s.append(time.monotonic() - asked)
            await asyncio.sleep(0.1)
        fm.faults.heal("gateway2")
        healed = time.monotonic()

        async def served_again() -> bool:
            return any(
                r.gateway == cut_url and r.sent > healed and r.status == 200 for r in results
            )

        recover_s = await _until(served_again, 30)
        await asyncio.sleep(0.5)
    through_cut = [r for r in results if r.gateway == cut_url]
    refused = [r for r in through_cut if struck <= r.sent and r.ended <= healed and r.status != 200]
    in_flight = [r for r in through_cut if r.sent < struck < r.ended and r.status == 200]
    counted = await accounts(fm.chaos, results, timeout_s=30.0)
    return {
        **_common(fm, results, counted),
        "refused during the cut": len(refused),
        "of them 503 with Retry-After": sum(
            1 for r in refused if r.status == 503 and r.retry_after is not None
        ),
        "refusal latency p50/p99/max s": [
            round(percentile([r.ended - r.sent for r in refused], q), 3) for q in (0.5, 0.99, 1.0)
        ],
        "streams in flight at the cut": len(in_flight),
        "of them completed": sum(1 for r in in_flight if r.finished),
        "/health p99 s during the cut": round(percentile(health_s, 0.99), 3),
        "sent to the other gateway during the cut, served": sum(
            1
            for r in results
            if r.gateway != cut_url and struck <= r.sent <= healed and r.status == 200
        ),
        "time to detect s": round(
            min((r.ended - struck for r in refused), default=float("nan")), 2
        ),
        "time to recover s": round(recover_s, 2),
    }


async def narrow_link(
    fm: FaultMesh, *, fault_s: float, concurrency: int, max_tokens: int, mbit_per_s: float = 100.0
) -> dict[str, Any]:
    """A bulk transfer from a port narrowed to ``mbit_per_s`` with htb, against the same
    transfer unnarrowed: the rate the narrowed link carries (the link a KV pull would cross)."""
    del fault_s, concurrency, max_tokens  # one transfer each way: no load, no fault length
    payload = b"\0" * _BULK_BYTES

    async def send(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(payload)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(send, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]

    async def transfer_mbit_per_s() -> float:
        started = time.monotonic()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        received = len(await reader.read(-1))
        writer.close()
        assert received == _BULK_BYTES, received
        return _BULK_BYTES * 8 / 1e6 / (time.monotonic() - started)

    with NetFaults({"bulk": Service(port)}, cgroup_name=f"infermesh-netfault-bulk-{port}") as f:
        wide = await transfer_mbit_per_s()
        f.narrow("bulk", mbit_per_s, direction="out")
        narrow = await transfer_mbit_per_s()
        f.heal("bulk")
        healed = await transfer_mbit_per_s()
    server.close()
    await server.wait_closed()
    return {
        "narrowed to Mb/s": mbit_per_s,
        "bytes sent": _BULK_BYTES,
        "unnarrowed Mb/s": round(wide),
        "narrowed Mb/s": round(narrow, 1),
        "healed Mb/s": round(healed),
    }


def _pull_request(tag: str, tokens: int, max_tokens: int) -> common_pb2.GenerateRequest:
    """A prompt of ``tokens`` simulated tokens with its block hashes, as the gateway sends it."""
    prompt = (f"{tag} " * tokens * BYTES_PER_TOKEN)[: tokens * BYTES_PER_TOKEN]
    return common_pb2.GenerateRequest(
        request_id=f"{tag}-{time.monotonic_ns()}",
        model=MODEL,
        prompt=prompt,
        sampling=common_pb2.SamplingParams(temperature=0, max_tokens=max_tokens),
        prefix_hashes=chain(sim_token_ids(prompt_text(None, prompt))),
    )


async def kv_pull_narrow_link(
    fm: FaultMesh, *, fault_s: float, concurrency: int, max_tokens: int, mbit_per_s: float = 100.0
) -> dict[str, Any]:
    """A KV pull from a busy holder over its port narrowed to ``mbit_per_s``, on a router and two
    simulated workers of its own: the pull's outcome, the answer against the holder's, and the
    router's estimate of the link before and after the worker's next heartbeat."""
    # two requests of _PULL_MAX_TOKENS on a mesh of its own (a decode step is 0.24 s there)
    del fm, fault_s, concurrency, max_tokens
    engines = [
        sim_engine(
            "A100",
            max_parallel=1,
            model="DeepSeek-V3",
            time_scale=_PULL_TIME_SCALE,
            kv_block_bytes=True,
        )
        for _ in range(2)
    ]
    async with (
        # a busy holder's load outweighs the 2.5 s of prefill its cache saves: the other worker
        # takes the request, and is to pull the prefix
        running_router(routing=RoutingSection(link_gbps=_PULL_LINK_GBPS, load_weight=10)) as router,
        running_worker(engines[0], router, "kv-a", max_parallel=1),
        running_worker(engines[1], router, "kv-b", max_parallel=1),
    ):
        fleet = router.resources.registry.fleet
        metrics.watch_links(fleet.measured_links)
        seeded = await gateway_complete(router, _pull_request("kv", _PULL_TOKENS, _PULL_MAX_TOKENS))
        holder = fleet.get(seeded.route.worker_id)
        assert holder is not None
        taker = "kv-b" if holder.worker_id == "kv-a" else "kv-a"
        blocks = _PULL_TOKENS // BLOCK_TOKENS
        index = router.resources.index
        await _until(_now(lambda: index.blocks(holder.slot) >= blocks), _PULL_WAIT_S)
        port = int(holder.info.address.rsplit(":", 1)[1])

        def estimate() -> float | None:
            labels = {"src": holder.worker_id, "dst": taker}
            return REGISTRY.get_sample_value("infermesh_router_link_gbps", labels)

        before = estimate()
        timed_out = metrics.KV_PULLS.labels(holder.worker_id, taker, "DEADLINE_EXCEEDED")
        pulled = metrics.KV_PULL_BLOCKS.labels(holder.worker_id, taker)
        timed_out_before, pulled_before = timed_out._value.get(), pulled._value.get()
        with NetFaults({"holder": Service(port)}, cgroup_name=f"infermesh-netfault-kv-{port}") as f:
            f.narrow("holder", mbit_per_s, direction="out")
            async with worker_client() as client:
                # the holder at its max_parallel: the router has the other pull its prefix
                busy = client.generate(holder.info.address, _pull_request("busy", 20, 30_000))
                await anext(busy)
                await _until(_now(lambda: fleet.busy_now[holder.slot] >= 1), _PULL_WAIT_S)
                sent = time.monotonic()
                answer = await gateway_complete(
                    router, _pull_request("kv", _PULL_TOKENS, _PULL_MAX_TOKENS)
                )
                answered_s = time.monotonic() - sent
                learned_s = await _until(_now(lambda: estimate() is not None), _PULL_WAIT_S)
                await busy.aclose()
    return {
        "narrowed to Mb/s": mbit_per_s,
        "configured link Gb/s": _PULL_LINK_GBPS,
        "requests": 2,
        "failed": 0,  # gateway_complete raised otherwise
        "hung": 0,
        "served by the other worker": answer.route.worker_id == taker,
        "pulls past their deadline": timed_out._value.get() - timed_out_before,
        "blocks pulled before the deadline": pulled._value.get() - pulled_before,
        "of blocks": blocks,
        "answer as the holder's": answer.text == seeded.text
        and answer.usage.completion_tokens == seeded.usage.completion_tokens,
        "answer s": round(answered_s, 2),
        "router's estimate before, Gb/s": before,
        "router's estimate after, Gb/s": round(estimate() or 0.0, 4),
        "time to learn s (after the answer)": round(learned_s, 2),
    }


def _now(condition: Callable[[], bool]) -> Callable[[], Awaitable[bool]]:
    """``condition`` as _until's awaitable check."""

    async def check() -> bool:
        return condition()

    return check


class Scenario(Protocol):
    """A scenario: its figures, on a mesh it leaves as it found it."""

    def __call__(
        self, fm: FaultMesh, *, fault_s: float, concurrency: int, max_tokens: int
    ) -> Awaitable[dict[str, Any]]: ...


SCENARIOS: dict[str, Scenario] = {
    "worker-black-hole": worker_black_hole,
    "packet-loss": packet_loss,
    "router-redis-partition": router_redis_partition,
    "gateway-redis-partition": gateway_redis_partition,
    "narrow-link": narrow_link,
    "kv-pull-narrow-link": kv_pull_narrow_link,
}


async def run(
    workdir: Path, scenarios: Sequence[str], fault_s: float, concurrency: int, max_tokens: int
) -> dict[str, dict[str, Any]]:
    """Each scenario's figures, on one mesh (each heals what it broke)."""
    figures: dict[str, dict[str, Any]] = {}
    async with FaultMesh(workdir) as fm:
        for name in scenarios:
            started = time.monotonic()
            figures[name] = await SCENARIOS[name](
                fm, fault_s=fault_s, concurrency=concurrency, max_tokens=max_tokens
            )
            figures[name]["scenario s"] = round(time.monotonic() - started, 1)
            await fm.chaos.wait_for_workers(len(fm.chaos.mesh.spec.worker_ports))
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scenario", default="all", choices=["all", *SCENARIOS])
    parser.add_argument("--fault-s", type=float, default=30.0)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    enter_private_network()  # first: every thread and child after it shares the namespace
    scenarios = list(SCENARIOS) if args.scenario == "all" else [args.scenario]
    with tempfile.TemporaryDirectory(prefix="netfaults-") as workdir:
        figures = asyncio.run(
            run(Path(workdir), scenarios, args.fault_s, args.concurrency, args.max_tokens)
        )
    for name, values in figures.items():
        print(f"\n== {name} (stall timeout {STALL_TIMEOUT_S:g} s, fault {args.fault_s:g} s)")
        for label, value in values.items():
            print(f"  {label}: {value}")
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
