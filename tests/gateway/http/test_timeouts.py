"""Slow and idle clients against a real gateway with short [server] timeouts: a request's
headers or body that do not arrive in time get a 408 in OpenAI's error shape and the
connection is closed; an idle keep-alive connection is closed."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient

from tests.helpers import rawhttp
from tests.helpers.gateway import make_config, start_gateway

_TIMEOUT_S = 0.5


@pytest.fixture
async def strict_gateway(redis_server) -> AsyncIterator[TestClient[web.Request, web.Application]]:
    client = await start_gateway(
        make_config(
            redis_server.url,
            header_timeout_s=_TIMEOUT_S,
            body_timeout_s=_TIMEOUT_S,
            keepalive_timeout_s=_TIMEOUT_S,
        )
    )
    yield client
    await client.close()


async def _trickle(writer: asyncio.StreamWriter, data: bytes, stop: asyncio.Event) -> None:
    """A byte every 50 ms until the data runs out or the server answered."""
    for i in range(len(data)):
        if stop.is_set() or writer.is_closing():
            return
        writer.write(data[i : i + 1])
        await asyncio.sleep(0.05)


async def _slow_exchange(
    port: int,
    sent_at_once: bytes,
    trickled: bytes,
) -> tuple[rawhttp.RawResponse, float, bytes]:
    """The response, when it came (s after connecting), and what followed it to EOF."""
    started = time.monotonic()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    answered = asyncio.Event()
    writer.write(sent_at_once)
    sender = asyncio.create_task(_trickle(writer, trickled, answered))
    try:
        response = await asyncio.wait_for(rawhttp.read_response(reader), 10)
        took = time.monotonic() - started
        answered.set()
        rest = await asyncio.wait_for(reader.read(), 15)
    finally:
        await sender
        writer.close()
    return response, took, rest


async def test_headers_a_byte_at_a_time_get_a_408_and_the_connection_closed(strict_gateway):
    response, took, rest = await _slow_exchange(
        strict_gateway.server.port,
        b"GET /health HTTP/1.1\r\nHost: x\r\n",
        b"X-Slow: " + b"a" * 200 + b"\r\n\r\n",
    )
    assert response.status == 408 and _TIMEOUT_S <= took < _TIMEOUT_S + 2
    assert response.json()["error"]["code"] == "request_timeout"
    assert rest == b""  # closed


async def test_a_body_a_byte_at_a_time_gets_a_408(strict_gateway, api_key):
    body = b'{"model": "tiny", "messages": [{"role": "user", "content": "' + b"a" * 200 + b'"}]}'
    head = rawhttp.request(
        "POST",
        "/v1/chat/completions",
        [
            ("Authorization", f"Bearer {api_key}"),
            ("Content-Type", "application/json"),
            ("Content-Length", str(len(body))),
        ],
    )
    response, took, rest = await _slow_exchange(strict_gateway.server.port, head, body)
    assert response.status == 408 and took < _TIMEOUT_S + 2
    assert "body" in response.json()["error"]["message"]
    assert rest == b""  # closed after a second of lingering, not aiohttp's 10


async def test_idle_keep_alive_and_silent_connections_are_closed(strict_gateway):
    port = strict_gateway.server.port
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    silent_reader, silent_writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await asyncio.wait_for(rawhttp.read_response(reader), 5)).status == 200
        started = time.monotonic()
        assert await asyncio.wait_for(reader.read(), 5) == b""
        assert await asyncio.wait_for(silent_reader.read(), 5) == b""
        assert time.monotonic() - started < _TIMEOUT_S + 2
    finally:
        writer.close()
        silent_writer.close()


async def test_a_prompt_client_keeps_its_connection_across_requests(strict_gateway):
    reader, writer = await asyncio.open_connection("127.0.0.1", strict_gateway.server.port)
    try:
        for _ in range(3):
            writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert (await asyncio.wait_for(rawhttp.read_response(reader), 5)).status == 200
            await asyncio.sleep(_TIMEOUT_S / 3)
    finally:
        writer.close()
