"""OTEL_SDK_DISABLED=true leaves the instrumentations out; otherwise a gateway continues
the caller's trace and says its id."""

from __future__ import annotations

import secrets

import pytest
from aiohttp.test_utils import TestClient, TestServer

import telemetry
from gateway.app import create_app
from tests.helpers.gateway import make_config


async def _trace_header(redis_url: str) -> str | None:
    trace_id = secrets.token_hex(16)
    client = TestClient(TestServer(create_app(make_config(redis_url))))
    await client.start_server()
    try:
        response = await client.get(
            "/health", headers={"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"}
        )
        assert response.status == 200
    finally:
        await client.close()
    header = response.headers.get("x-trace-id")
    assert header in (None, trace_id)
    return header


@pytest.mark.parametrize("disabled", ["true", " TRUE "])
async def test_disabled_sdk_means_no_instrumentation(monkeypatch, redis_server, disabled):
    monkeypatch.setenv("OTEL_SDK_DISABLED", disabled)
    assert not telemetry.tracing_enabled()
    assert telemetry.grpc_server_interceptors() == telemetry.grpc_client_interceptors() == []
    assert telemetry.aiohttp_middlewares() == []
    assert await _trace_header(redis_server.url) is None


async def test_enabled_sdk_continues_the_callers_trace(monkeypatch, redis_server):
    monkeypatch.delenv("OTEL_SDK_DISABLED", raising=False)
    assert telemetry.tracing_enabled()
    assert telemetry.grpc_server_interceptors() and telemetry.grpc_client_interceptors()
    assert await _trace_header(redis_server.url) is not None
