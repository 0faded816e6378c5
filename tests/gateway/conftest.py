"""The real gateway app on a loopback port, with a real Redis; the router
address is a closed port unless a test starts a router of its own (the
``router`` and ``worker`` fixtures: real services in-process)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis
from aiohttp import web
from aiohttp.test_utils import TestClient

from gateway.accounts.keys import create_key
from gateway.config import GatewayConfig
from tests.helpers.gateway import batch_config, make_config, start_gateway
from tests.helpers.inprocess import running_router, running_worker, sim_engine


@pytest.fixture
def config(redis_server) -> GatewayConfig:
    return make_config(redis_server.url)


@pytest.fixture
async def gateway(config) -> AsyncIterator[TestClient[web.Request, web.Application]]:
    client = await start_gateway(config)
    yield client
    await client.close()


@pytest.fixture
async def redis_client(redis_server) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_server.url)
    yield client
    await client.aclose()


@pytest.fixture
async def api_key(redis_client) -> str:
    return await create_key(redis_client, "test")


@pytest.fixture
async def router():
    async with running_router() as router:
        yield router


@pytest.fixture
async def worker(tiny_engine, router):
    async with running_worker(tiny_engine, router) as worker:
        yield worker


@pytest.fixture
async def served(
    redis_server, router, worker
) -> AsyncIterator[TestClient[web.Request, web.Application]]:
    """A gateway in front of a real router and worker on the tiny model."""
    client = await start_gateway(make_config(redis_server.url, router.address))
    yield client
    await client.close()


@pytest.fixture
async def gateways(
    redis_server, router
) -> AsyncIterator[list[TestClient[web.Request, web.Application]]]:
    """Two gateway apps on separate ports sharing Redis and the router: two
    processes' worth of local state."""
    clients = [await start_gateway(make_config(redis_server.url, router.address)) for _ in range(2)]
    yield clients
    for client in clients:
        await client.close()


_FILE_LIMIT_BYTES = 64 * 1024


@pytest.fixture
async def sim_served(
    redis_server, tmp_path
) -> AsyncIterator[TestClient[web.Request, web.Application]]:
    """A gateway in front of a router and one simulated worker (no latency), with small file
    limits and a quick batch runner."""
    async with (
        running_router(redis_url=redis_server.url) as router,
        running_worker(sim_engine(zero_latency=True, max_parallel=16), router),
    ):
        config = batch_config(
            redis_server.url,
            router.address,
            str(tmp_path / "files"),
            max_file_bytes=_FILE_LIMIT_BYTES,
            lease_s=2.0,
            concurrency=4,
        )
        gateway = await start_gateway(config)
        yield gateway
        await gateway.close()
