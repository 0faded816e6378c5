from __future__ import annotations

import openai
import pytest

from tests.gateway.conftest import CHAT, auth, sdk, start_gateway, with_server

_USER = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("body, param", [
    ({**CHAT, "temperature": "hot"}, "temperature"),
    ({**CHAT, "temperature": 2.5}, "temperature"),
    ({**CHAT, "top_p": 0}, "top_p"),
    ({**CHAT, "max_tokens": 0}, "max_tokens"),
    ({**CHAT, "max_tokens": True}, "max_tokens"),
    ({**CHAT, "n": 2}, "n"),
    ({**CHAT, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({**CHAT, "stop": [1]}, "stop.0"),
    ({**CHAT, "stream": "yes"}, "stream"),
    ({**CHAT, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
    ({**CHAT, "precision": "int4"}, "precision"),
    ({**CHAT, "messages": []}, "messages"),
    ({**CHAT, "messages": [{"role": "bot", "content": "hi"}]}, "messages.0.role"),
    ({**CHAT, "messages": [*_USER, {"role": "user"}]}, "messages.1.content"),
    ({**CHAT, "messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    ({**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages.0.content.0.type"),
    ({"messages": _USER}, "model"),
])
async def test_invalid_body_is_400_naming_the_param(gateway, api_key, body, param):
    response = await gateway.post("/v1/chat/completions", json=body, headers=auth(api_key))
    assert response.status == 400
    error = (await response.json())["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert f"'{param}'" in error["message"]


@pytest.mark.parametrize("raw, message", [
    (b'{"model": ', "not valid JSON"),
    (b"", "not valid JSON"),
    (b'{"model": "m", "temperature": NaN}', "not valid JSON"),
    (b"\xff\xfe\xfa", "not valid JSON"),
    (b'[{"model": "m"}]', "must be a JSON object"),
    (b'"hello"', "must be a JSON object"),
])
async def test_unparseable_or_non_object_body_is_400(gateway, api_key, raw, message):
    response = await gateway.post("/v1/chat/completions", data=raw,
                                  headers={**auth(api_key), "Content-Type": "application/json"})
    assert response.status == 400
    assert message in (await response.json())["error"]["message"]


async def test_bad_precision_header_is_400(gateway, api_key):
    response = await gateway.post("/v1/chat/completions", json=CHAT,
                                  headers={**auth(api_key), "x-infermesh-precision": "int4"})
    assert response.status == 400
    assert (await response.json())["error"]["param"] == "x-infermesh-precision"


async def test_sdk_sees_param_of_a_400(gateway, api_key):
    async with sdk(gateway, api_key) as client:
        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(model="tiny", messages=_USER, temperature=5)
    assert caught.value.param == "temperature"


async def test_body_over_the_limit_is_413(config, api_key):
    gateway = await start_gateway(with_server(config, max_body_bytes=2048))
    try:
        big = {**CHAT, "messages": [{"role": "user", "content": "x" * 4096}]}
        response = await gateway.post("/v1/chat/completions", json=big, headers=auth(api_key))
        assert response.status == 413
        error = (await response.json())["error"]
        assert error["code"] == "request_too_large" and "2048 bytes" in error["message"]

        async def chunks():  # no Content-Length: the limit holds while reading
            for _ in range(4):
                yield b"x" * 1024
        response = await gateway.post("/v1/chat/completions", data=chunks(),
                                      headers=auth(api_key))
        assert response.status == 413
        assert (await response.json())["error"]["code"] == "request_too_large"
    finally:
        await gateway.close()
