"""The request path end to end with the official openai SDK as the client."""

from __future__ import annotations

import json
import time

import aiohttp
import anthropic
import openai
import pytest

from tests.helpers import MODEL

_GREEDY = {
    "model": MODEL,
    "temperature": 0,
    "max_tokens": 12,
    "messages": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Say hello to the mesh."},
    ],
}


@pytest.fixture
def client(mesh, api_key) -> openai.OpenAI:
    return openai.OpenAI(base_url=mesh.spec.base_url, api_key=api_key, max_retries=0, timeout=60)


def test_models_lists_the_served_model(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].owned_by


def test_chat_completion_with_usage_and_route(client, served_precision):
    raw = client.chat.completions.with_raw_response.create(**_GREEDY)
    completion = raw.parse()
    choice = completion.choices[0]
    assert completion.object == "chat.completion" and completion.model == MODEL
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert completion.usage.prompt_tokens > 0
    assert 0 < completion.usage.completion_tokens <= 12
    assert completion.usage.total_tokens == (
        completion.usage.prompt_tokens + completion.usage.completion_tokens
    )
    assert raw.headers["x-infermesh-worker"].startswith("worker-")
    # what the policy picks for this machine
    assert raw.headers["x-infermesh-precision"] == served_precision


def test_greedy_is_deterministic_and_streaming_matches(client):
    first = client.chat.completions.create(**_GREEDY)
    second = client.chat.completions.create(**_GREEDY)
    assert first.choices[0].message.content == second.choices[0].message.content

    chunks = list(
        client.chat.completions.create(
            **_GREEDY, stream=True, stream_options={"include_usage": True}
        )
    )
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == first.choices[0].message.content
    finishes = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finishes == [first.choices[0].finish_reason]
    assert all(c.usage is None for c in chunks[:-1])
    # the first request cached the prompt's whole blocks, which the second and the stream read
    assert chunks[-1].choices == [] and chunks[-1].usage == second.usage


def test_wrong_key_is_401(mesh):
    bad = openai.OpenAI(base_url=mesh.spec.base_url, api_key="sk-" + "0" * 43, max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.chat.completions.create(**_GREEDY)
    assert e.value.status_code == 401
    assert "sk-000" not in str(e.value.body)


@pytest.mark.parametrize("headers", [{}, {"Authorization": "KEY"}])
async def test_missing_key_or_bearer_is_401(mesh, api_key, headers):
    headers = {k: v.replace("KEY", api_key) for k, v in headers.items()}
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            f"{mesh.spec.base_url}/chat/completions", json=_GREEDY, headers=headers
        ) as response,
    ):
        assert response.status == 401
        text = await response.text()
    error = json.loads(text)["error"]
    assert error["type"] and error["message"] and api_key not in text


def test_unknown_model_is_404_listing_served_models(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(**{**_GREEDY, "model": "no-such-model"})
    assert e.value.code == "model_not_found"
    assert MODEL in e.value.message


def test_no_worker_is_503_without_hanging(workerless_mesh):
    mesh, api_key = workerless_mesh
    client = openai.OpenAI(base_url=mesh.spec.base_url, api_key=api_key, max_retries=0, timeout=30)
    started = time.monotonic()
    with pytest.raises(openai.APIStatusError) as e:
        client.chat.completions.create(**_GREEDY)
    assert e.value.status_code == 503
    assert e.value.response.headers.get("retry-after")
    assert time.monotonic() - started < 5


def test_legacy_completion_through_the_mesh(client):
    completion = client.completions.create(
        model=MODEL, prompt="Hello mesh", temperature=0, max_tokens=5
    )
    chunks = list(
        client.completions.create(
            model=MODEL, prompt="Hello mesh", temperature=0, max_tokens=5, stream=True
        )
    )
    assert completion.object == "text_completion" and completion.usage.completion_tokens == 5
    assert "".join(c.choices[0].text for c in chunks) == completion.choices[0].text


def test_anthropic_messages_through_the_mesh(mesh, api_key):
    request = {
        "model": MODEL,
        "max_tokens": 6,
        "messages": [{"role": "user", "content": "Hi"}],
        "extra_body": {"temperature": 0},
    }
    with anthropic.Anthropic(
        base_url=mesh.spec.base_url.removesuffix("/v1"), api_key=api_key, max_retries=0, timeout=60
    ) as client:
        message = client.messages.create(**request)
        with client.messages.stream(**request) as stream:
            streamed = stream.get_final_message()
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 6
    assert streamed.content[0].text == message.content[0].text
