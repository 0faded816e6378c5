"""Input that once made the gateway answer 500 or a misleading status: deep nesting,
unpaired surrogates, non-ASCII digits, oversized names, two credentials."""

from __future__ import annotations

import asyncio

import pytest

from gateway.config import RouterSection
from gateway.http.errors import GatewayError
from gateway.mesh.client import MeshClient
from infermesh.bidi import MAX_MESSAGE_BYTES
from infermesh.pb import common_pb2
from tests.helpers import MODEL, rawhttp
from tests.helpers.gateway import ADMIN, ADMIN_TOKEN, CHAT, auth
from tests.helpers.inprocess import PLAINTEXT, register_unreachable_worker

_DEEP = "[" * 10_000 + "]" * 10_000
_MESSAGE = {"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}


async def _generate(
    client: MeshClient, request: common_pb2.GenerateRequest, *, stream: bool
) -> list[common_pb2.GenerateResponse]:
    """The chunks of one mesh call, its failure as the GatewayError the gateway answers with."""
    call = client.call(request, stream=stream)
    try:
        return [chunk async for chunk in call.chunks]
    except Exception as e:
        raise client.gateway_error(e) from None


def _nested(prefix: str) -> bytes:
    return f'{{{prefix}"x": {_DEEP}}}'.encode()


@pytest.mark.parametrize(
    "path, prefix",
    [
        ("/v1/chat/completions", '"model": "tiny", "messages": [], '),
        ("/v1/completions", '"model": "tiny", "prompt": "hi", '),
        ("/v1/messages", '"model": "tiny", "max_tokens": 8, '),
        ("/admin/keys", '"name": "deep", '),
    ],
)
async def test_a_body_nested_10000_deep_is_a_400(gateway, api_key, path, prefix):
    headers = ADMIN if path.startswith("/admin") else auth(api_key)
    response = await gateway.post(
        path, data=_nested(prefix), headers={**headers, "Content-Type": "application/json"}
    )
    assert response.status == 400, await response.text()
    assert "nested too deeply" in (await response.json())["error"]["message"]


@pytest.mark.parametrize(
    "path, body, param",
    [
        (
            "/v1/chat/completions",
            '{"model": "tiny", "messages": [{"role": "user", "content": "h\\ud800i"}]}',
            "messages.0.content",
        ),
        (
            "/v1/chat/completions",
            '{"model": "tiny", "stop": "h\\udfffi", '
            '"messages": [{"role": "user", "content": "hi"}]}',
            "stop",
        ),
        ("/v1/completions", '{"model": "tiny", "prompt": ["ok", "h\\uD800i"]}', "prompt.1"),
        (
            "/v1/messages",
            '{"model": "tiny", "max_tokens": 8, "messages": '
            '[{"role": "user", "content": [{"type": "text", "text": "\\ud83d"}]}]}',
            "messages.0.content.0.text",
        ),
    ],
)
async def test_an_unpaired_surrogate_is_a_400_naming_the_field(gateway, api_key, path, body, param):
    response = await gateway.post(
        path, data=body.encode(), headers={**auth(api_key), "Content-Type": "application/json"}
    )
    assert response.status == 400, await response.text()
    error = (await response.json())["error"]
    assert "surrogate" in error["message"] and f"'{param}'" in error["message"]
    assert error.get("param", param) == param  # Anthropic's shape has no param


async def test_a_surrogate_pair_is_text(gateway, api_key):
    """An escaped emoji is a pair, not an error: the request gets past validation (to the
    router, absent here: 503)."""
    body = '{"model": "tiny", "messages": [{"role": "user", "content": "\\ud83d\\ude00"}]}'
    response = await gateway.post(
        "/v1/chat/completions",
        data=body.encode(),
        headers={**auth(api_key), "Content-Type": "application/json"},
    )
    assert response.status == 503


async def test_usage_days_in_non_ascii_digits_is_a_400(gateway, redis_client):
    created = await gateway.post("/admin/keys", json={"name": "u"}, headers=ADMIN)
    kid = (await created.json())["id"]
    response = await gateway.get(f"/admin/keys/{kid}/usage", params={"days": "²"}, headers=ADMIN)
    assert response.status == 400
    assert (await response.json())["error"]["param"] == "days"


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/chat/completions", {**CHAT, "model": "m" * 100_000}),
        ("/v1/completions", {"model": "m" * 100_000, "prompt": "hi"}),
        ("/v1/messages", {**_MESSAGE, "model": "m" * 100_000}),
    ],
)
async def test_a_100_kb_model_name_is_a_400_naming_model(gateway, api_key, path, body):
    response = await gateway.post(path, json=body, headers=auth(api_key))
    assert response.status == 400
    error = (await response.json())["error"]
    assert "'model'" in error["message"] and len(error["message"]) < 1000


async def test_grpc_size_limits_are_not_a_rate_limit(router):
    """A request past a shared stream's message limit (a body near the gateway's own limit, its
    prompt then past gRPC's): the client is told the request is too large, not to retry."""
    await register_unreachable_worker(router)
    client = MeshClient(RouterSection(address=router.address), PLAINTEXT)
    try:
        with pytest.raises(GatewayError) as caught:
            await _generate(
                client,
                common_pb2.GenerateRequest(
                    request_id="r", model=MODEL, prompt="x" * (MAX_MESSAGE_BYTES + 1)
                ),
                stream=False,
            )
    finally:
        await client.close()
    assert caught.value.status == 413 and caught.value.retry_after_s is None


@pytest.mark.parametrize(
    "path, name, first",
    [
        ("/v1/models", "Authorization", "Bearer {key}"),
        ("/v1/models", "x-api-key", "{key}"),
        ("/admin/keys", "Authorization", "Bearer " + ADMIN_TOKEN),
    ],
)
async def test_a_second_credential_header_is_refused(gateway, api_key, path, name, first):
    response = await rawhttp.exchange(
        gateway.server.port,
        rawhttp.request(
            "GET", path, [(name, first.format(key=api_key)), (name, "Bearer sk-bogus")]
        ),
    )
    assert response.status == 400
    error = response.json()["error"]
    if name == "x-api-key":  # an Anthropic client's credential: the error in Anthropic's shape
        assert error["type"] == "invalid_request_error" and f"2 {name} headers" in error["message"]
    else:
        assert error["code"] == "ambiguous_credentials" and error["param"] == name
    assert api_key.encode() not in response.body and ADMIN_TOKEN.encode() not in response.body


async def test_a_key_that_is_not_utf8_is_a_401(gateway):
    response = await rawhttp.exchange(
        gateway.server.port,
        rawhttp.request("GET", "/v1/models", [("Authorization", "Bearer sk-\udcff\udcfe")]),
    )
    assert response.status == 401
    assert response.json()["error"]["code"] == "invalid_api_key"


async def test_a_request_past_the_message_size_limit_fails_alone_on_the_streams(router, worker):
    """A request too large for one gRPC message is a 413 of its own: sent on a stream shared with
    other requests it would end the stream, and them with it."""
    client = MeshClient(RouterSection(address=router.address), PLAINTEXT)

    async def ask(prompt: str) -> list[common_pb2.GenerateResponse]:
        return await _generate(
            client,
            common_pb2.GenerateRequest(
                request_id="r",
                model=MODEL,
                prompt=prompt,
                sampling=common_pb2.SamplingParams(max_tokens=2),
            ),
            stream=True,
        )

    try:
        huge, small = await asyncio.gather(
            ask("x" * (MAX_MESSAGE_BYTES + 1)), ask("hi"), return_exceptions=True
        )
    finally:
        await client.close()
    assert isinstance(huge, GatewayError) and huge.status == 413
    assert not isinstance(small, BaseException) and small[-1].finish_reason
