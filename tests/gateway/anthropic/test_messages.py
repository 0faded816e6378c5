"""Anthropic's Messages API (``/v1/messages``) through the real gateway, router
and worker, with the official anthropic SDK as the client."""

from __future__ import annotations

import json
import uuid

import anthropic
import pytest

from tests.helpers import MODEL
from tests.helpers.gateway import auth

# This SDK's create() no longer names temperature; the API still takes it.
_GREEDY = {
    "model": MODEL,
    "max_tokens": 8,
    "system": "be brief",
    "extra_body": {"temperature": 0},
    "messages": [{"role": "user", "content": "hello"}],
}
_WIRE = {**{k: v for k, v in _GREEDY.items() if k != "extra_body"}, "temperature": 0}


def _client(gateway, **credentials) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(
        base_url=str(gateway.make_url("")), max_retries=0, timeout=10, **credentials
    )


async def test_message_streamed_and_not_with_x_api_key_or_bearer(served, api_key):
    async with _client(served, api_key=api_key) as client:
        message = await client.messages.create(**_GREEDY)
        async with client.messages.stream(**_GREEDY) as stream:
            events = [event.type async for event in stream]
            streamed = await stream.get_final_message()
    async with _client(served, auth_token=api_key) as client:  # Authorization: Bearer
        bearer = await client.messages.create(
            **{
                **_GREEDY,
                "messages": [{"role": "user", "content": [{"type": "text", "text": "hello"}]}],
            }
        )
    assert message.type == "message" and message.role == "assistant" and message.model == MODEL
    assert message.id.startswith("msg_") and message.content[0].type == "text"
    assert message.stop_reason == "max_tokens"
    assert message.usage.output_tokens == 8 and message.usage.input_tokens > 0
    assert streamed.content[0].text == message.content[0].text
    assert streamed.usage == message.usage and streamed.stop_reason == "max_tokens"
    assert events[:2] == ["message_start", "content_block_start"]
    assert events[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert bearer.content[0].text == message.content[0].text


async def test_wire_events_in_anthropic_framing(served, api_key):
    response = await served.post(
        "/v1/messages", headers={"x-api-key": api_key}, json={**_WIRE, "stream": True}
    )
    assert response.headers["Content-Type"].startswith("text/event-stream")
    frames = [f for f in (await response.text()).split("\n\n") if f]
    names = [f.split("\n")[0].removeprefix("event: ") for f in frames]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert set(names[3:-3]) == {"content_block_delta"}
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    events = []
    for frame in frames:
        name, data = frame.split("\n")
        events.append(json.loads(data.removeprefix("data: ")))
        assert events[-1]["type"] == name.removeprefix("event: ")
    # the prompt's count is known with the first token, before message_start goes out
    start, delta = events[0]["message"]["usage"], events[-2]["usage"]
    assert start["input_tokens"] == delta["input_tokens"] > 0


async def test_input_tokens_exclude_those_read_from_the_cache(served, api_key):
    """As Anthropic counts: the prompt is input_tokens + cache_read_input_tokens, in a message,
    in message_start and in message_delta."""
    # a prompt no other test sends, long enough to fill a few of the prefix cache's blocks
    ask = {**_WIRE, "system": f"{uuid.uuid4().hex} " + "Answer. " * 80}
    first = await served.post("/v1/messages", headers=auth(api_key), json=ask)
    cold = (await first.json())["usage"]
    assert cold["cache_read_input_tokens"] == 0 and cold["input_tokens"] > 80
    stream = {**ask, "stream": True}
    streamed = await served.post("/v1/messages", headers=auth(api_key), json=stream)
    events = [
        json.loads(line.removeprefix("data: "))
        for line in (await streamed.text()).split("\n")
        if line.startswith("data: ")
    ]
    again = await served.post("/v1/messages", headers=auth(api_key), json=ask)
    for warm in (events[0]["message"]["usage"], events[-2]["usage"], (await again.json())["usage"]):
        assert warm["cache_read_input_tokens"] > 0
        assert warm["input_tokens"] + warm["cache_read_input_tokens"] == cold["input_tokens"]
        assert warm["cache_creation_input_tokens"] == 0


@pytest.mark.parametrize(
    "credentials, body, error_class, error_type",
    [
        ({"api_key": "sk-wrong"}, _GREEDY, anthropic.AuthenticationError, "authentication_error"),
        ({}, {**_GREEDY, "max_tokens": 0}, anthropic.BadRequestError, "invalid_request_error"),
        (
            {},
            {**_GREEDY, "extra_body": {"temperature": 1.5}},
            anthropic.BadRequestError,
            "invalid_request_error",
        ),
        ({}, {**_GREEDY, "model": "nope"}, anthropic.NotFoundError, "not_found_error"),
    ],
)
async def test_errors_in_anthropic_shape(
    served, api_key, credentials, body, error_class, error_type
):
    async with _client(served, **(credentials or {"api_key": api_key})) as client:
        with pytest.raises(error_class) as caught:
            await client.messages.create(**body)
    assert caught.value.body["type"] == "error"
    assert caught.value.body["error"]["type"] == error_type
    assert caught.value.body["error"]["message"]


async def test_invalid_content_block_names_the_field(served, api_key):
    response = await served.post(
        "/v1/messages",
        headers=auth(api_key),
        json={**_WIRE, "messages": [{"role": "user", "content": [{"type": "image"}]}]},
    )
    assert response.status == 400
    error = (await response.json())["error"]
    assert error["type"] == "invalid_request_error"
    assert "messages.0.content.0.type" in error["message"]


async def test_worker_lost_mid_stream_ends_with_an_error_event(served, worker, api_key):
    response = await served.post(
        "/v1/messages",
        headers={"x-api-key": api_key},
        json={**_WIRE, "max_tokens": 1500, "stream": True},
    )
    assert response.status == 200
    await response.content.readline()
    await worker.server.stop(grace=None)
    frames = [f for f in (await response.text()).split("\n\n") if f]
    name, data = frames[-1].split("\n")
    assert name == "event: error"
    assert json.loads(data.removeprefix("data: "))["error"]["message"]
