"""Chat completions through the real gateway app, a real router and a real
worker on the tiny model (in-process, on loopback ports)."""

from __future__ import annotations

import dataclasses
import json

import aiohttp
import grpc
import openai
import pytest

from devtools.tiny_model import V3_CONTEXT
from gateway.config import GatewayConfig
from gateway.http.errors import from_grpc
from gateway.mesh.state import PROMPT_TOKENS
from infermesh.config import ConfigError, MetricsSection, load_config
from infermesh.ports import free_port
from tests.helpers import MODEL
from tests.helpers.gateway import auth, make_config, sdk, start_gateway
from tests.helpers.inprocess import eventually

_MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a\nb"}]
_GREEDY = {"model": MODEL, "messages": _MESSAGES, "temperature": 0, "max_tokens": 8}


@pytest.fixture
async def gateway(redis_server, router, worker):
    client = await start_gateway(make_config(redis_server.url, router.address))
    yield client
    await client.close()


async def test_completion_in_openai_format(gateway, worker, api_key, served_precision):
    async with sdk(gateway, api_key) as client:
        raw = await client.chat.completions.with_raw_response.create(
            **_GREEDY, extra_headers={"x-infermesh-precision": served_precision}
        )
        completion = raw.parse()
        parts = await client.chat.completions.create(
            **{
                **_GREEDY,
                "messages": [
                    _MESSAGES[0],
                    {
                        "role": "user",
                        "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                    },
                ],
            }
        )
    choice = completion.choices[0]
    assert completion.object == "chat.completion" and completion.model == MODEL
    assert completion.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length" and completion.usage.completion_tokens == 8
    assert completion.usage.total_tokens == completion.usage.prompt_tokens + 8
    assert raw.headers["x-infermesh-worker"] == worker.servicer.info.worker_id
    assert raw.headers["x-infermesh-precision"] == served_precision
    assert raw.headers["x-request-id"]
    # text parts are joined with newlines: the same prompt, so the same greedy answer
    assert parts.choices[0].message.content == choice.message.content


async def test_stop_string_and_seed(gateway, api_key):
    async with sdk(gateway, api_key) as client:
        full = (
            (await client.chat.completions.create(**{**_GREEDY, "max_tokens": 24}))
            .choices[0]
            .message.content
        )
        stop = full[len(full) // 2 : len(full) // 2 + 2]
        stopped = await client.chat.completions.create(
            **{**_GREEDY, "max_tokens": 24, "stop": stop}
        )
        sampled = [
            (await client.chat.completions.create(**{**_GREEDY, "temperature": 1.0, "seed": 7}))
            .choices[0]
            .message.content
            for _ in range(2)
        ]
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].message.content == full[: full.index(stop)]
    assert sampled[0] == sampled[1]


async def test_stream_with_usage(gateway, api_key):
    async with sdk(gateway, api_key) as client:
        expected = (await client.chat.completions.create(**_GREEDY)).choices[0].message.content
    response = await gateway.post(
        "/v1/chat/completions",
        headers=auth(api_key),
        json={**_GREEDY, "stream": True, "stream_options": {"include_usage": True}},
    )
    assert response.status == 200
    assert response.headers["Content-Type"].startswith("text/event-stream")
    events = (await response.text()).split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1]) == expected
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 8
    assert len({c["id"] for c in chunks}) == 1


async def test_stream_through_the_sdk(gateway, api_key):
    async with sdk(gateway, api_key) as client:
        stream = await client.chat.completions.create(**_GREEDY, stream=True)
        chunks = [chunk async for chunk in stream]
    assert "".join(c.choices[0].delta.content or "" for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].usage is None


@pytest.mark.parametrize(
    "body, status, code, param",
    [
        ({**_GREEDY, "model": "nope"}, 404, "model_not_found", "model"),
        (
            # a word is at least a token: one more than the tiny model's context holds
            {**_GREEDY, "messages": [{"role": "user", "content": "x " * (V3_CONTEXT + 1)}]},
            400,
            "context_length_exceeded",
            "messages",
        ),
        ({**_GREEDY, "precision": "fp8"}, 400, None, "precision"),
    ],
)
async def test_router_and_worker_refusals_are_http_errors(
    gateway, api_key, body, status, code, param
):
    for stream in (False, True):
        response = await gateway.post(
            "/v1/chat/completions", headers=auth(api_key), json={**body, "stream": stream}
        )
        assert response.status == status
        error = (await response.json())["error"]
        assert (error["code"], error["param"]) == (code, param) and error["message"]


async def test_no_worker_is_503_with_retry_after(redis_server, router, api_key):
    client = await start_gateway(make_config(redis_server.url, router.address))
    try:
        response = await client.post("/v1/chat/completions", headers=auth(api_key), json=_GREEDY)
        assert response.status == 503 and response.headers["Retry-After"]
        assert "no worker" in (await response.json())["error"]["message"]
    finally:
        await client.close()


async def test_worker_lost_mid_stream_ends_with_an_error_event(gateway, worker, api_key):
    response = await gateway.post(
        "/v1/chat/completions",
        headers=auth(api_key),
        json={"model": MODEL, "messages": _MESSAGES, "stream": True},
    )  # runs to the context end
    assert response.status == 200
    await response.content.readline()
    await worker.server.stop(grace=None)
    text = await response.text()
    events = text.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""], text
    assert json.loads(events[-3].strip().removeprefix("data: "))["error"]["message"], text


async def test_client_disconnect_frees_the_sequence(gateway, worker, api_key):
    response = await gateway.post(
        "/v1/chat/completions",
        headers=auth(api_key),
        json={"model": MODEL, "messages": _MESSAGES, "stream": True},
    )
    await response.content.readline()
    assert worker.servicer.load().running == 1
    response.close()
    await eventually(lambda: worker.servicer.load().running == 0)


async def test_models(gateway, api_key):
    async with sdk(gateway, api_key) as client:
        models = [m async for m in client.models.list()]
        assert [(m.id, m.object, m.owned_by) for m in models] == [(MODEL, "model", "infermesh")]
        assert (await client.models.retrieve(MODEL)).id == MODEL
    response = await gateway.get("/v1/models/nope", headers=auth(api_key))
    assert response.status == 404
    error = (await response.json())["error"]
    assert error["code"] == "model_not_found" and MODEL in error["message"]


@pytest.mark.parametrize(
    "code, status, retry",
    [
        (grpc.StatusCode.RESOURCE_EXHAUSTED, 429, True),
        (grpc.StatusCode.INTERNAL, 502, False),
        (grpc.StatusCode.DEADLINE_EXCEEDED, 504, False),
    ],
)
def test_other_router_statuses_map_to_http(code, status, retry):
    error = from_grpc(code, "x", router_reachable=True, retry_after_s=1)
    assert error.status == status and (error.retry_after_s is not None) == retry


async def test_n_choices_streamed_and_not(gateway, api_key):
    async with sdk(gateway, api_key) as client:
        completion = await client.chat.completions.create(**_GREEDY, n=3)
        chunks = [
            c
            async for c in await client.chat.completions.create(
                **_GREEDY, n=2, stream=True, stream_options={"include_usage": True}
            )
        ]
    assert [c.index for c in completion.choices] == [0, 1, 2]
    texts = {c.message.content for c in completion.choices}
    assert len(texts) == 1  # greedy: the same answer three times
    assert completion.usage.completion_tokens == 3 * 8
    streamed = ["", ""]
    for chunk in chunks[:-1]:
        streamed[chunk.choices[0].index] += chunk.choices[0].delta.content or ""
    assert streamed == [texts.pop()] * 2
    finishes = [c.choices[0].index for c in chunks[:-1] if c.choices[0].finish_reason]
    assert sorted(finishes) == [0, 1]
    assert chunks[-1].usage.completion_tokens == 2 * 8
    assert chunks[-1].usage.prompt_tokens == completion.usage.prompt_tokens  # counted once


async def test_sampling_fields_are_accepted_end_to_end(gateway, api_key):
    async with sdk(gateway, api_key) as client:
        completion = await client.chat.completions.create(
            **{**_GREEDY, "max_tokens": 20},
            max_completion_tokens=3,
            presence_penalty=0.5,
            frequency_penalty=0.5,
            user="someone",
            response_format={"type": "text"},
            logprobs=True,
            top_logprobs=2,
            extra_body={"max_parallel": 4, "dynamic_batch_timeout_ms": 150},
        )
    choice = completion.choices[0]
    assert choice.finish_reason == "length" and completion.usage.completion_tokens == 3
    if choice.logprobs is not None:  # when the worker reports them
        assert len(choice.logprobs.content) == 3
        assert all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)


async def test_alias_base_serves_the_same_api(redis_server, router, worker, api_key):
    client = await start_gateway(make_config(redis_server.url, router.address, alias_base="/api"))
    try:
        async with sdk(client, api_key, base_path="/api") as openai_client:
            completion = await openai_client.chat.completions.create(**_GREEDY)
            assert [m.id async for m in openai_client.models.list()] == [MODEL]
        assert completion.choices[0].message.content
        response = await client.post(
            "/api/v1/chat/completions", headers=auth(api_key), json=_GREEDY
        )
        assert response.status == 404
        assert "base URL of this API is" in (await response.json())["error"]["message"]
    finally:
        await client.close()


async def test_per_key_series_are_served_on_the_metrics_port_only(
    redis_server, router, worker, api_key
):
    """Key names, tiers and token volumes are not the public port's: its /metrics has the rest
    of the process's metrics; the [metrics] side port has those too."""
    config = dataclasses.replace(
        make_config(redis_server.url, router.address),
        metrics=MetricsSection(port=free_port()),
    )
    gateway = await start_gateway(config)
    try:
        async with sdk(gateway, api_key) as client:
            await client.chat.completions.create(**_GREEDY)
        public = await (await gateway.get("/metrics")).text()
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"http://127.0.0.1:{config.metrics.port}/metrics") as response,
        ):
            side = await response.text()
    finally:
        await gateway.close()
    assert "infermesh_requests_total" in public and "infermesh_requests_total" in side
    assert "infermesh_gateway_key_tokens" not in public
    assert 'infermesh_gateway_key_tokens_total{key="test",tier="default",type="output"}' in side


async def test_a_request_at_the_body_limit_is_answered_never_a_5xx(gateway, api_key):
    """A prompt as large as the body limit lets: its route ask (the text, its token ids and
    their block hashes) is well past gRPC's default 4 MiB message, once the gateway tokenizes.
    It reaches the mesh, which answers that it is past the model's context: a clear 400."""
    limit = GatewayConfig().server.max_body_bytes
    content = "hello world " * ((limit - 1024) // len("hello world "))
    async with sdk(gateway, api_key, timeout=120) as client:
        # the gateway tokenizes once it has the model's tokenizer, which its first request loads
        await client.chat.completions.create(**_GREEDY)
        await eventually(lambda: gateway.app[PROMPT_TOKENS].renderer(MODEL) is not None)
        with pytest.raises(openai.BadRequestError) as refused:
            await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=1
            )
    assert refused.value.body["code"] == "context_length_exceeded", refused.value.body


def test_a_body_limit_whose_route_ask_could_pass_the_grpc_limit_is_a_config_error(tmp_path):
    path = tmp_path / "gateway.toml"
    path.write_text("[server]\nmax_body_bytes = 16777216\n")
    with pytest.raises(ConfigError) as error:
        load_config(GatewayConfig, path, "infermesh_gateway", environ={})
    assert f"{path}: [server]: max_body_bytes must be 1024..8388608, got 16777216" in str(
        error.value
    )
