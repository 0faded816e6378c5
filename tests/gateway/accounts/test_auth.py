from __future__ import annotations

import time
from typing import Any

import openai
import pytest
import redis.asyncio as aioredis

from devtools.redis_server import RedisServer
from gateway.accounts.keys import create_key, disable_key, key_id
from tests.helpers.gateway import CHAT, auth, sdk


async def _error(response) -> dict[str, Any]:
    assert response.content_type == "application/json"
    return (await response.json())["error"]


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": ""},
        {"Authorization": "sk-abc"},  # no Bearer
        {"Authorization": "Token sk-abc"},
        {"Authorization": "Bearer "},
        {"Authorization": "Bearer sk-not-a-key"},
    ],
)
async def test_missing_or_malformed_or_unknown_key_is_401(gateway, headers):
    response = await gateway.post("/v1/chat/completions", json=CHAT, headers=headers)
    assert response.status == 401
    error = await _error(response)
    assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
    assert "Authorization" in error["message"] or "Incorrect API key" in error["message"]
    assert "sk-abc" not in error["message"] and "sk-not-a-key" not in error["message"]


async def test_disabled_key_is_401_through_the_sdk(gateway, redis_client):
    key = await create_key(redis_client, "revoked")
    await disable_key(redis_client, key_id(key))
    async with sdk(gateway, key) as client:
        with pytest.raises(openai.AuthenticationError) as caught:
            await client.models.list()
    assert caught.value.status_code == 401
    assert caught.value.code == "invalid_api_key"
    assert key not in caught.value.message


@pytest.mark.parametrize("query", ["api_key", "key", "API_KEY", "access_token"])
async def test_key_in_query_string_is_refused(gateway, api_key, query):
    response = await gateway.get(f"/v1/models?{query}={api_key}")
    assert response.status == 400
    error = await _error(response)
    assert "Authorization header" in error["message"] and api_key not in error["message"]
    # Refused even alongside a valid header, and on paths that do not exist.
    response = await gateway.get(f"/v1/nope?{query}=x", headers=auth(api_key))
    assert response.status == 400


async def test_redis_down_is_503_not_401_then_recovers(
    gateway, redis_server, redis_client, tmp_path
):
    key = await create_key(redis_client, "dev")  # not used yet, so not cached
    redis_server.stop()
    started = time.monotonic()
    response = await gateway.post("/v1/chat/completions", json=CHAT, headers=auth(key))
    assert time.monotonic() - started < 2
    assert response.status == 503
    assert response.headers["Retry-After"] == "1"
    assert (await _error(response))["code"] == "auth_unavailable"
    response = await gateway.post("/v1/chat/completions", json=CHAT, headers=auth("sk-wrong"))
    assert response.status == 503

    with RedisServer(port=redis_server.port, workdir=tmp_path):
        fresh = aioredis.Redis.from_url(redis_server.url)
        key = await create_key(fresh, "dev")
        await fresh.aclose()
        body = {**CHAT, "temperature": "hot"}  # admitted, then refused for the body
        response = await gateway.post("/v1/chat/completions", json=body, headers=auth(key))
        assert response.status == 400
        assert (await _error(response))["param"] == "temperature"
        response = await gateway.get("/v1/models", headers=auth("sk-wrong"))
        assert response.status == 401
