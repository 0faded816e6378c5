from __future__ import annotations

import openai
import pytest

from gateway.openai.chat_protocol import parse_chat_request
from infermesh.pb import common_pb2
from tests.helpers.gateway import CHAT, auth, sdk, start_gateway, with_server

_USER = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    "body, param",
    [
        ({**CHAT, "temperature": "hot"}, "temperature"),
        ({**CHAT, "temperature": 2.5}, "temperature"),
        ({**CHAT, "top_p": 0}, "top_p"),
        ({**CHAT, "max_tokens": 0}, "max_tokens"),
        ({**CHAT, "max_tokens": True}, "max_tokens"),
        ({**CHAT, "n": 0}, "n"),
        ({**CHAT, "n": 129}, "n"),
        ({**CHAT, "presence_penalty": 2.5}, "presence_penalty"),
        ({**CHAT, "frequency_penalty": "high"}, "frequency_penalty"),
        ({**CHAT, "logprobs": 1}, "logprobs"),
        ({**CHAT, "top_logprobs": 2}, "top_logprobs"),
        ({**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({**CHAT, "max_completion_tokens": -1}, "max_completion_tokens"),
        ({**CHAT, "response_format": {"type": "xml"}}, "response_format.type"),
        ({**CHAT, "max_parallel": "4"}, "max_parallel"),
        ({**CHAT, "max_parallel": 4.0}, "max_parallel"),
        ({**CHAT, "max_parallel": 0}, "max_parallel"),
        ({**CHAT, "dynamic_batch_timeout_ms": True}, "dynamic_batch_timeout_ms"),
        ({**CHAT, "priority": 11}, "priority"),
        ({**CHAT, "priority": "high"}, "priority"),
        ({**CHAT, "extra_body": {"priority": 1.5}}, "extra_body.priority"),
        (
            {**CHAT, "extra_body": {"dynamic_batch_timeout_ms": "150"}},
            "extra_body.dynamic_batch_timeout_ms",
        ),
        ({**CHAT, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({**CHAT, "stop": [1]}, "stop.0"),
        ({**CHAT, "stream": "yes"}, "stream"),
        ({**CHAT, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
        ({**CHAT, "precision": "int4"}, "precision"),
        ({**CHAT, "messages": []}, "messages"),
        ({**CHAT, "messages": [{"role": "bot", "content": "hi"}]}, "messages.0.role"),
        ({**CHAT, "messages": [*_USER, {"role": "user"}]}, "messages.1.content"),
        ({**CHAT, "messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
        (
            {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages.0.content.0.type",
        ),
        ({"messages": _USER}, "model"),
    ],
)
async def test_invalid_body_is_400_naming_the_param(gateway, api_key, body, param):
    response = await gateway.post("/v1/chat/completions", json=body, headers=auth(api_key))
    assert response.status == 400
    error = (await response.json())["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert f"'{param}'" in error["message"]


@pytest.mark.parametrize(
    "raw, message",
    [
        (b'{"model": ', "not valid JSON"),
        (b"", "not valid JSON"),
        (b'{"model": "m", "temperature": NaN}', "not valid JSON"),
        (b"\xff\xfe\xfa", "not valid JSON"),
        (b'[{"model": "m"}]', "must be a JSON object"),
        (b'"hello"', "must be a JSON object"),
    ],
)
async def test_unparseable_or_non_object_body_is_400(gateway, api_key, raw, message):
    response = await gateway.post(
        "/v1/chat/completions",
        data=raw,
        headers={**auth(api_key), "Content-Type": "application/json"},
    )
    assert response.status == 400
    assert message in (await response.json())["error"]["message"]


async def test_bad_precision_header_is_400(gateway, api_key):
    response = await gateway.post(
        "/v1/chat/completions",
        json=CHAT,
        headers={**auth(api_key), "x-infermesh-precision": "int4"},
    )
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

        response = await gateway.post("/v1/chat/completions", data=chunks(), headers=auth(api_key))
        assert response.status == 413
        assert (await response.json())["error"]["code"] == "request_too_large"
    finally:
        await gateway.close()


async def test_sdk_extra_body_batching_hints_must_be_integers(gateway, api_key):
    async with sdk(gateway, api_key) as client:
        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(
                model="tiny", messages=_USER, extra_body={"max_parallel": "4"}
            )
    assert caught.value.param == "max_parallel"


def test_fields_reach_the_router_request():
    body = parse_chat_request(
        {
            **CHAT,
            "n": 2,
            "seed": -1,
            "temperature": 0.5,
            "top_p": 0.9,
            "presence_penalty": 0.5,
            "frequency_penalty": -1.0,
            "logprobs": True,
            "top_logprobs": 3,
            "stop": "END",
            "max_tokens": 9,
            "max_completion_tokens": 7,
            "max_parallel": 4,
            "user": "u-1",
            "extra_body": {"dynamic_batch_timeout_ms": 150},
            "some_future_field": {"x": 1},
            "messages": [
                {
                    "role": "developer",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                }
            ],
        },
        {"x-infermesh-precision": "bf16"},
    )
    requests = [
        body.generate_request("req-1", i, messages=body.router_messages()) for i in range(body.n)
    ]
    first, second = requests
    assert (first.request_id, second.request_id) == ("req-1", "req-1-1")
    # a developer turn is a system turn for the worker (DeepSeek's templates drop unknown roles)
    assert first.messages[0].role == "system" and first.messages[0].content == "a\nb"
    s = first.sampling
    assert (s.max_tokens, list(s.stop), s.top_logprobs, s.logprobs) == (7, ["END"], 3, True)
    assert s.presence_penalty == 0.5 and s.frequency_penalty == -1.0
    assert abs(s.temperature - 0.5) < 1e-6 and abs(s.top_p - 0.9) < 1e-6
    assert (s.seed, second.sampling.seed) == (2**64 - 1, 0)  # each choice its own seed
    assert (first.batching.max_parallel, first.batching.dynamic_batch_timeout_ms) == (4, 150)
    assert first.precision == common_pb2.PRECISION_BF16
