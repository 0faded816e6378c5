"""Fair queueing through the gateway when the fleet is full: a real router with
[fair_queue] on, a real simulated worker of few slots, a real Redis, and the official SDK.
A key's weight and tier come from its record; the router's refusals come back as 429 / 503
with the router's Retry-After."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import openai
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient
from prometheus_client import REGISTRY

from gateway.accounts.keys import create_key
from infermesh.pb import common_pb2, router_pb2
from router_svc.config import FairQueueSection
from tests.helpers import MODEL
from tests.helpers.gateway import make_config, sdk, start_gateway
from tests.helpers.inprocess import (
    RunningRouter,
    eventually,
    running_router,
    running_worker,
    sim_engine,
)

# a V100's simulated decode: about 20 ms a token, so a request holds its slot a while
_SLOW = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 40}


@contextlib.asynccontextmanager
async def _mesh(
    redis_url: str, slots: int, queue: FairQueueSection
) -> AsyncIterator[tuple[RunningRouter, TestClient[web.Request, web.Application]]]:
    async with (
        running_router(redis_url=redis_url, fair_queue=queue) as router,
        running_worker(sim_engine("V100", max_parallel=slots), router, "w", max_parallel=slots),
    ):
        gateway = await start_gateway(make_config(redis_url, router.address))
        try:
            yield router, gateway
        finally:
            await gateway.close()


def _sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def _depth(tier: str) -> float:
    return _sample("infermesh_router_queue_depth", tier=tier)


async def test_full_queues_answer_429_and_503_with_retry_after(redis_server, redis_client):
    queue = FairQueueSection(enabled=True, max_per_tenant=1, max_total=2, max_wait_s=30)
    async with _mesh(redis_server.url, 1, queue) as (_, gateway):
        busy = await create_key(redis_client, "busy", tier="fq429")
        other = await create_key(redis_client, "other", tier="fq429")
        third = await create_key(redis_client, "third", tier="fq429")
        async with sdk(gateway, busy) as b, sdk(gateway, other) as o, sdk(gateway, third) as t:
            running = asyncio.create_task(b.chat.completions.create(**_SLOW))
            await asyncio.sleep(0.2)  # the first took the one slot
            assert not running.done() and _depth("fq429") == 0
            queued = asyncio.create_task(b.chat.completions.create(**_SLOW))
            await eventually(lambda: _depth("fq429") == 1)
            with pytest.raises(openai.RateLimitError) as own:
                await b.chat.completions.create(**_SLOW)  # its key's queue is full: 429
            assert int(own.value.response.headers["retry-after"]) >= 1
            assert own.value.code == "rate_limit_exceeded"
            queued_other = asyncio.create_task(o.chat.completions.create(**_SLOW))
            await eventually(lambda: _depth("fq429") == 2)
            with pytest.raises(openai.InternalServerError) as fleet:
                await t.chat.completions.create(**_SLOW)  # every queue is full: 503
            assert fleet.value.status_code == 503
            assert int(fleet.value.response.headers["retry-after"]) >= 1
            # what waited is served once the slot frees
            for task in (running, queued, queued_other):
                assert (await task).choices[0].finish_reason == "length"
        assert (
            _sample("infermesh_router_queue_rejected_total", tier="fq429", reason="tenant_full")
            == 1
        )
        assert (
            _sample("infermesh_router_queue_rejected_total", tier="fq429", reason="fleet_full") == 1
        )
        assert _sample("infermesh_router_queue_wait_seconds_count", tier="fq429") == 2
        assert _sample("infermesh_router_queue_wait_seconds_sum", tier="fq429") > 0


async def test_queued_requests_never_push_a_worker_past_max_parallel(redis_server, redis_client):
    queue = FairQueueSection(enabled=True, max_per_tenant=16, max_total=32, max_wait_s=30)
    async with _mesh(redis_server.url, 2, queue) as (router, gateway):
        keys = [await create_key(redis_client, f"k{i}", weight=i + 1) for i in range(2)]
        peak = 0
        sampling = True

        async def sample() -> None:
            nonlocal peak
            while sampling:
                reply = await router.stub.ListWorkers(router_pb2.ListWorkersRequest())
                for status in reply.workers:
                    peak = max(peak, status.load.running + status.load.waiting)
                await asyncio.sleep(0.02)

        sampler = asyncio.create_task(sample())
        clients = [sdk(gateway, key) for key in keys]
        try:
            body = {**_SLOW, "max_tokens": 10}
            answers = await asyncio.gather(
                *(clients[i % 2].chat.completions.create(**body) for i in range(8))
            )
        finally:
            sampling = False
            await sampler
            for client in clients:
                await client.close()
        assert all(a.choices[0].finish_reason == "length" for a in answers)
        assert peak == 2  # full while the others waited, never past its two slots


async def test_a_queued_request_whose_client_left_leaves_the_queue(redis_server, redis_client):
    queue = FairQueueSection(enabled=True, max_per_tenant=4, max_total=8, max_wait_s=30)
    async with _mesh(redis_server.url, 1, queue) as (_, gateway):
        key = await create_key(redis_client, "gone", tier="fqgone")
        async with sdk(gateway, key) as client:
            running = asyncio.create_task(client.chat.completions.create(**_SLOW))
            await asyncio.sleep(0.2)  # it took the slot
            leaving = asyncio.create_task(client.chat.completions.create(**_SLOW))
            await eventually(lambda: _depth("fqgone") == 1)
            leaving.cancel()  # the client goes away while its request waits
            with contextlib.suppress(asyncio.CancelledError):
                await leaving
            await eventually(lambda: _depth("fqgone") == 0)
            assert not running.done()  # it left the queue, not after the slot freed
            # the slot goes to the next request once the first ends, not to the one that left
            after = await client.chat.completions.create(**{**_SLOW, "max_tokens": 2})
            assert after.choices[0].finish_reason == "length"
            await running


async def test_a_higher_priority_goes_first_among_a_keys_waiting_requests(
    redis_server, redis_client
):
    queue = FairQueueSection(enabled=True, max_per_tenant=4, max_total=8, max_wait_s=30)
    async with _mesh(redis_server.url, 1, queue) as (_, gateway):
        key = await create_key(redis_client, "prio", tier="fqprio")
        ended: list[str] = []

        async def chat(client: openai.AsyncOpenAI, name: str, priority: int) -> None:
            await client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=5,
                extra_body={"priority": priority},
            )
            ended.append(name)

        async with sdk(gateway, key) as client:
            running = asyncio.create_task(client.chat.completions.create(**_SLOW))
            await asyncio.sleep(0.2)  # it took the slot
            low = asyncio.create_task(chat(client, "low", -3))
            await eventually(lambda: _depth("fqprio") == 1)
            high = asyncio.create_task(chat(client, "high", 3))
            await eventually(lambda: _depth("fqprio") == 2)
            await asyncio.gather(running, low, high)
        assert ended == ["high", "low"]


async def test_internal_callers_and_gateway_requests_together_never_pass_max_parallel(
    redis_server, api_key
):
    """The router's relay (an internal caller's Router.Generate / Complete) and the gateway's
    requests share one count per worker: together they never run more than its slots."""
    queue = FairQueueSection(enabled=True, max_per_tenant=16, max_total=32, max_wait_s=30)
    engine = sim_engine("V100", max_parallel=2)
    async with (
        running_router(redis_url=redis_server.url, fair_queue=queue) as router,
        running_worker(engine, router, "w", max_parallel=2),
    ):
        gateway = await start_gateway(make_config(redis_server.url, router.address))
        peak = 0

        async def sample() -> None:
            nonlocal peak
            while True:  # the engine's own count: what it runs and what waits for a slot
                load = engine.load()
                peak = max(peak, load.running + load.waiting)
                await asyncio.sleep(0.005)

        request = common_pb2.GenerateRequest(
            model=MODEL, prompt="hi", sampling=common_pb2.SamplingParams(max_tokens=10)
        )

        async def relayed() -> int:
            chunks = [c async for c in router.stub.Generate(request)]
            return sum(len(c.token_ids) for c in chunks)

        async def whole() -> int:
            return len((await router.stub.Complete(request)).token_ids)

        body = {**_SLOW, "max_tokens": 10}
        sampler = asyncio.create_task(sample())
        try:
            async with sdk(gateway, api_key) as client:
                answers = await asyncio.gather(
                    *(relayed() for _ in range(3)),
                    *(whole() for _ in range(2)),
                    *(client.chat.completions.create(**body) for _ in range(3)),
                )
        finally:
            sampler.cancel()
            await gateway.close()
    assert answers[:5] == [10] * 5
    assert all(a.choices[0].finish_reason == "length" for a in answers[5:])
    assert peak == 2  # full while the others waited, never past its two slots
