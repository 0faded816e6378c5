"""The real gateway app on a loopback port, with a real Redis; the router
address is a closed port unless a test starts a router of its own (the
``router`` and ``worker`` fixtures: real services in-process)."""
from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest
import redis.asyncio as aioredis
from aiohttp.test_utils import TestClient, TestServer

from gateway.app import CONFIG, create_app
from gateway.config import AdminSection, GatewayConfig, RedisSection, RouterSection, ServerSection
from gateway.http_server import GatewayRunner
from gateway.keys import create_key
from infermesh.ports import free_port
from tests.inprocess import running_router, running_worker

ADMIN_TOKEN = "test-admin-token-0123456789"


def make_config(redis_url: str, router_address: str | None = None, **server: Any) -> GatewayConfig:
    return GatewayConfig(
        server=ServerSection(**server),
        # generous: 200 concurrent requests share this one event loop in the limit tests
        redis=RedisSection(url=redis_url, timeout_s=3.0),
        router=RouterSection(address=router_address or f"127.0.0.1:{free_port()}"),
        admin=AdminSection(token=ADMIN_TOKEN),
    )


class GatewayTestServer(TestServer):
    """The app served as ``python -m gateway`` serves it: through ``GatewayRunner``."""

    async def _make_runner(self, **kwargs: Any) -> GatewayRunner:
        return GatewayRunner(self.app, self.app[CONFIG].server, **kwargs)


async def start_gateway(config: GatewayConfig) -> TestClient:
    client = TestClient(GatewayTestServer(create_app(config)))
    await client.start_server()
    return client


@pytest.fixture
def config(redis_server) -> GatewayConfig:
    return make_config(redis_server.url)


@pytest.fixture
async def gateway(config) -> AsyncIterator[TestClient]:
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
async def served(redis_server, router, worker) -> AsyncIterator[TestClient]:
    """A gateway in front of a real router and worker on the tiny model."""
    client = await start_gateway(make_config(redis_server.url, router.address))
    yield client
    await client.close()


@pytest.fixture
async def gateways(redis_server, router) -> AsyncIterator[list[TestClient]]:
    """Two gateway apps on separate ports sharing Redis and the router: two
    processes' worth of local state."""
    clients = [await start_gateway(make_config(redis_server.url, router.address))
               for _ in range(2)]
    yield clients
    for client in clients:
        await client.close()


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def sdk(gateway: TestClient, key: str, base_path: str = "/v1", timeout: float = 10) -> openai.AsyncOpenAI:
    """The official SDK pointed at the gateway, without retries."""
    return openai.AsyncOpenAI(base_url=str(gateway.make_url(base_path)), api_key=key,
                              max_retries=0, timeout=timeout)


def with_server(config: GatewayConfig, **server: int) -> GatewayConfig:
    return dataclasses.replace(config, server=ServerSection(**server))


CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
