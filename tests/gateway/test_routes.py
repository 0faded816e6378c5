from __future__ import annotations

import logging
import time

import openai
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from gateway.app import create_app
from tests.helpers.gateway import CHAT, auth, sdk


@pytest.mark.parametrize(
    "path",
    [
        "/v1/v1/chat/completions",
        "/api/v1/chat/completions",
        "/chat/completions",
        "/v1/chat/completion",
    ],
)
async def test_unknown_path_is_404_naming_the_base_url(gateway, api_key, path):
    response = await gateway.post(path, json=CHAT, headers=auth(api_key))
    assert response.status == 404
    error = (await response.json())["error"]
    assert error["code"] == "unknown_url"
    assert f"The base URL of this API is http://127.0.0.1:{gateway.port}/v1" in error["message"]
    if "chat/completions" in path:
        assert "Did you mean /v1/chat/completions?" in error["message"]


async def test_sdk_with_a_doubled_base_path_gets_a_404_it_can_read(gateway, api_key):
    async with sdk(gateway, api_key, base_path="/v1/v1") as client:
        with pytest.raises(openai.NotFoundError) as caught:
            await client.chat.completions.create(model="tiny", messages=CHAT["messages"])
    assert "base URL of this API is" in caught.value.message


async def test_wrong_method_is_405_json(gateway, api_key):
    response = await gateway.get("/v1/chat/completions", headers=auth(api_key))
    assert response.status == 405
    assert response.headers["Allow"] == "POST"
    assert (await response.json())["error"]["code"] == "method_not_allowed"


async def test_health_and_request_ids(gateway):
    response = await gateway.get("/health")
    assert response.status == 200 and await response.json() == {"status": "ok"}
    assert response.headers["x-request-id"].startswith("req-")
    response = await gateway.get("/nope", headers={"x-request-id": "trace-me-42"})
    assert response.headers["x-request-id"] == "trace-me-42"
    response = await gateway.get("/nope", headers={"x-request-id": "bad id\t"})
    assert response.headers["x-request-id"].startswith("req-")


async def test_router_unreachable_is_a_quick_503_with_retry_after(gateway, api_key):
    for method, path, body in [
        ("POST", "/v1/chat/completions", CHAT),
        ("POST", "/v1/chat/completions", {**CHAT, "stream": True}),
        ("GET", "/v1/models", None),
        ("GET", "/v1/models/tiny", None),
    ]:
        started = time.monotonic()
        response = await gateway.request(method, path, json=body, headers=auth(api_key))
        assert time.monotonic() - started < 2.5
        assert response.status == 503
        assert response.headers["Retry-After"] == "1"
        assert (await response.json())["error"]["code"] == "router_unavailable"
    async with sdk(gateway, api_key) as client:
        with pytest.raises(openai.InternalServerError) as caught:
            await client.chat.completions.create(model="tiny", messages=CHAT["messages"])
    assert caught.value.status_code == 503


async def test_unexpected_exception_is_a_logged_500_json(
    aiohttp_app_with_failing_route, api_key, caplog
):
    gateway = aiohttp_app_with_failing_route
    with caplog.at_level(logging.ERROR):
        response = await gateway.get("/v1/boom", headers=auth(api_key))
    assert response.status == 500
    assert (await response.json())["error"]["type"] == "server_error"
    assert "Traceback" in caplog.text and "RuntimeError: boom" in caplog.text
    assert api_key not in caplog.text


async def _boom(request: web.Request) -> web.Response:
    raise RuntimeError("boom")


@pytest.fixture
async def aiohttp_app_with_failing_route(config):
    app = create_app(config)
    app.router.add_get("/v1/boom", _boom)
    async with TestClient(TestServer(app)) as client:
        yield client
