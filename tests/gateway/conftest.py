"""The real gateway app on a loopback port, with a real Redis; the router
address is a closed port unless a test starts a router of its own."""
from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator

import openai
import pytest
import redis.asyncio as aioredis
from aiohttp.test_utils import TestClient, TestServer

from gateway.app import create_app
from gateway.config import GatewayConfig, RedisSection, RouterSection, ServerSection
from gateway.keys import create_key
from infermesh.redis_server import free_port


def make_config(redis_url: str, router_address: str | None = None, **server: int) -> GatewayConfig:
    return GatewayConfig(
        server=ServerSection(**server),
        redis=RedisSection(url=redis_url, timeout_s=0.5),
        router=RouterSection(address=router_address or f"127.0.0.1:{free_port()}"),
    )


async def start_gateway(config: GatewayConfig) -> TestClient:
    client = TestClient(TestServer(create_app(config)))
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


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def sdk(gateway: TestClient, key: str, base_path: str = "/v1") -> openai.AsyncOpenAI:
    """The official SDK pointed at the gateway, without retries."""
    return openai.AsyncOpenAI(base_url=str(gateway.make_url(base_path)), api_key=key,
                              max_retries=0, timeout=10)


def with_server(config: GatewayConfig, **server: int) -> GatewayConfig:
    return dataclasses.replace(config, server=ServerSection(**server))


CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
