"""Claude Code against the real gateway, router and worker, through the official anthropic SDK:
its request shape streams a turn with tools, count_tokens equals the billed input, context editing
is applied server-side, model aliases answer its ``claude-...`` names, and its errors come in the
words its client acts on."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import anthropic
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient

from gateway.config import ModelsSection
from tests.helpers import MODEL, claude_code
from tests.helpers.gateway import auth, make_config, prompt_tokens, sdk, start_gateway
from tests.helpers.inprocess import running_worker
from tests.helpers.tools import SLOW_TIMEOUT_S
from worker_svc.config import DEFAULT_MODEL_PATH
from worker_svc.torch_engine.engine import Engine

ALIASES = {"claude-*": MODEL, "gpt-*": MODEL}
# a few thousand prompt tokens each, on a CPU shared with other work
pytestmark = pytest.mark.timeout(300)
_CLAUDE = "claude-opus-4-8"  # the name Claude Code asks for unless told otherwise


@pytest.fixture(scope="module")
def long_engine(worker_dtype) -> Iterator[Engine]:
    """The default model, whose context has room for Claude Code's max_tokens (32000) after its
    prompt."""
    engine = Engine.from_checkpoint(DEFAULT_MODEL_PATH, dtype=worker_dtype)
    yield engine
    asyncio.run(engine.close())


@pytest.fixture
async def claude_served(
    redis_server, router, long_engine
) -> AsyncIterator[TestClient[web.Request, web.Application]]:
    config = dataclasses.replace(
        make_config(redis_server.url, router.address), models=ModelsSection(aliases=ALIASES)
    )
    async with running_worker(long_engine, router):
        client = await start_gateway(config)
        yield client
        await client.close()


def _client(gateway, api_key: str) -> anthropic.AsyncAnthropic:
    """As Claude Code is configured: ANTHROPIC_BASE_URL and ANTHROPIC_AUTH_TOKEN (Bearer)."""
    return anthropic.AsyncAnthropic(
        base_url=str(gateway.make_url("")),
        auth_token=api_key,
        max_retries=0,
        timeout=SLOW_TIMEOUT_S,
    )


async def test_claude_codes_request_is_streamed(claude_served, api_key):
    """Its exact shape; the random model's turn (text until an end token it rarely draws) is
    read up to its first content, then abandoned as a client may."""
    async with (
        _client(claude_served, api_key) as client,
        client.beta.messages.stream(**claude_code.request(_CLAUDE, extra_body={"seed": 1})) as s,
    ):
        events = []
        async for event in s:
            events.append(event)
            if event.type == "content_block_delta":
                break
    start = events[0]
    assert start.type == "message_start" and start.message.model == _CLAUDE
    # the prompt's count arrives with message_start, as it is billed
    assert prompt_tokens(start.message.usage) > 1000
    block = next(e.content_block for e in events if e.type == "content_block_start")
    assert block.type in ("text", "tool_use")


async def test_a_named_tool_in_claude_codes_shape_is_one_call(claude_served, api_key):
    """A whole turn: the call of a tool without arguments, streamed and not; no empty text block
    before it."""
    ask = claude_code.request(
        _CLAUDE, tool_choice={"type": "tool", "name": "TaskList"}, extra_body={"seed": 2}
    )
    async with _client(claude_served, api_key) as client:
        message = await client.beta.messages.create(**ask)
        async with client.beta.messages.stream(**ask) as stream:
            events = [event.type async for event in stream]
            streamed = await stream.get_final_message()
    for answer in (message, streamed):
        assert answer.stop_reason == "tool_use" and answer.model == _CLAUDE
        assert [(b.type, b.name, b.input) for b in answer.content] == [("tool_use", "TaskList", {})]
        assert answer.context_management is not None
        assert answer.context_management.applied_edits == []
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert prompt_tokens(streamed.usage) == prompt_tokens(message.usage) > 1000


async def test_count_tokens_is_the_billed_input(claude_served, api_key):
    shape = claude_code.request(_CLAUDE)
    history = [
        *shape["messages"],
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "", "signature": "sig"},
                {"type": "text", "text": "Listing."},
                {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {"command": "ls"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_1",
                    "content": [{"type": "text", "text": "README.md\nsrc", "cache_control": {}}],
                }
            ],
        },
    ]
    counted_args = {k: v for k, v in shape.items() if k not in ("max_tokens", "metadata")}
    async with _client(claude_served, api_key) as client:
        for messages in (shape["messages"], history):
            counted = await client.beta.messages.count_tokens(
                **{**counted_args, "messages": messages}
            )
            billed = await client.beta.messages.create(
                **{**shape, "messages": messages, "max_tokens": 1}
            )
            assert counted.input_tokens == prompt_tokens(billed.usage) > 1000


def _tool_history(uses: int) -> list[dict[str, Any]]:
    """A conversation of ``uses`` Bash calls and their long results."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": "look around"}]
    for i in range(uses):
        call = {"type": "tool_use", "id": f"toolu_{i}", "name": "Bash", "input": {"command": "ls"}}
        result = {"type": "tool_result", "tool_use_id": f"toolu_{i}", "content": "file\n" * 20}
        messages += [
            {"role": "assistant", "content": [call]},
            {"role": "user", "content": [result]},
        ]
    return messages


async def test_tool_results_are_cleared_server_side(claude_served, api_key):
    clear = {
        "type": "clear_tool_uses_20250919",
        "trigger": {"type": "tool_uses", "value": 2},
        "keep": {"type": "tool_uses", "value": 1},
    }
    ask = claude_code.request(
        _CLAUDE, messages=_tool_history(4), context_management={"edits": [clear]}, max_tokens=1
    )
    count_args = {k: v for k, v in ask.items() if k not in ("max_tokens", "metadata")}
    async with _client(claude_served, api_key) as client:
        counted = await client.beta.messages.count_tokens(**count_args)
        message = await client.beta.messages.create(**ask)
        too_little = {**clear, "clear_at_least": {"type": "input_tokens", "value": 10**6}}
        untouched = await client.beta.messages.create(
            **{**ask, "context_management": {"edits": [too_little]}}
        )
    assert counted.context_management is not None
    original = counted.context_management.original_input_tokens
    assert counted.input_tokens == prompt_tokens(message.usage) < original
    assert message.context_management is not None
    (applied,) = message.context_management.applied_edits
    assert applied.type == "clear_tool_uses_20250919" and applied.cleared_tool_uses == 3
    assert applied.cleared_input_tokens == original - counted.input_tokens
    assert untouched.context_management is not None
    assert untouched.context_management.applied_edits == []
    assert prompt_tokens(untouched.usage) == original


async def test_edit_types_not_implemented_are_refused_by_name(claude_served, api_key):
    body = {
        "model": _CLAUDE,
        "max_tokens": 8,
        "messages": [{"role": "user", "content": "hi"}],
        "context_management": {"edits": [{"type": "compact_20260112"}]},
    }
    response = await claude_served.post("/v1/messages?beta=true", headers=auth(api_key), json=body)
    assert response.status == 400
    error = (await response.json())["error"]
    assert error["type"] == "invalid_request_error"
    assert "context_management.edits.0.type" in error["message"]
    assert "compact_20260112" in error["message"]


async def test_models_list_served_models_and_the_aliases_apart_in_each_apis_shape(
    claude_served, api_key
):
    async with _client(claude_served, api_key) as client:
        page = await client.models.list()
        retrieved = await client.models.retrieve(_CLAUDE)
    assert [m.id for m in page.data] == [MODEL]
    assert page.model_extra == {"aliases": ALIASES}
    assert retrieved.id == _CLAUDE and retrieved.type == "model" and MODEL in retrieved.display_name
    async with sdk(claude_served, api_key) as openai_client:
        openai_page = await openai_client.models.list()
        assert [m.id for m in openai_page.data] == [MODEL]
        raw = await claude_served.get("/v1/models", headers=auth(api_key))
        assert (await raw.json())["aliases"] == ALIASES
        chat = await openai_client.chat.completions.create(
            model="gpt-5", max_tokens=4, messages=[{"role": "user", "content": "hi"}]
        )
    assert chat.model == "gpt-5" and chat.usage is not None and chat.usage.completion_tokens == 4


@pytest.fixture
async def short_served(
    redis_server, router, tmp_path
) -> AsyncIterator[TestClient[web.Request, web.Application]]:
    """A worker whose context is 256 tokens."""
    engine = Engine.from_checkpoint(DEFAULT_MODEL_PATH, dtype="float32", max_model_len=256)
    try:
        async with running_worker(engine, router):
            client = await start_gateway(make_config(redis_server.url, router.address))
            yield client
            await client.close()
    finally:
        await engine.close()


async def test_context_overflow_in_the_words_clients_act_on(short_served, api_key):
    long = [{"role": "user", "content": "hello there " * 200}]
    short = [{"role": "user", "content": "hello"}]
    async with _client(short_served, api_key) as client:
        with pytest.raises(anthropic.BadRequestError) as too_long:
            await client.messages.create(model=MODEL, max_tokens=8, messages=long)
        with pytest.raises(anthropic.BadRequestError) as too_many:
            await client.messages.create(model=MODEL, max_tokens=32000, messages=short)
    prompt_error = too_long.value.body["error"]["message"]
    assert prompt_error.startswith("prompt is too long: ")
    assert prompt_error.endswith(" tokens > 255 maximum")
    budget_error = too_many.value.body["error"]["message"]
    assert budget_error.startswith("input length and `max_tokens` exceed context limit: ")
    assert "+ 32000 > 256, decrease input length or `max_tokens` and try again" in budget_error
    response = await short_served.post(
        "/v1/chat/completions",
        headers=auth(api_key),
        json={"model": MODEL, "max_tokens": 8, "messages": long},
    )
    error = (await response.json())["error"]
    assert response.status == 400 and error["code"] == "context_length_exceeded"
    assert "maximum context length is 256 tokens" in error["message"]


async def test_no_capacity_is_529_overloaded(redis_server, router, api_key):
    client = await start_gateway(make_config(redis_server.url, router.address))
    try:
        async with _client(client, api_key) as anthropic_client:
            with pytest.raises(anthropic.OverloadedError) as overloaded:
                await anthropic_client.messages.create(
                    model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "hi"}]
                )
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
        response = await client.post("/v1/chat/completions", headers=auth(api_key), json=body)
    finally:
        await client.close()
    assert overloaded.value.body["error"]["type"] == "overloaded_error"
    assert response.status == 503  # OpenAI's clients keep their status


async def test_each_part_of_claude_codes_shape_reaches_the_prompt(claude_served, api_key):
    """What the gateway makes of the shape, not the helper's own data: the prompt it renders
    (count_tokens, which is what is billed) grows with each part Claude Code sends: its system
    blocks with cache_control, the system turn among its messages, its tools (the one whose
    schema uses propertyNames too); none is dropped, and the whole is accepted."""
    shape = claude_code.request(_CLAUDE)
    counted = {k: v for k, v in shape.items() if k not in ("max_tokens", "metadata")}
    (odd_schema,) = [t for t in shape["tools"] if "propertyNames" in json.dumps(t)]
    parts = {
        "a cached system block": {**counted, "system": shape["system"][:-1]},
        "the system turn": {
            **counted,
            "messages": [m for m in shape["messages"] if m["role"] != "system"],
        },
        "a tool": {**counted, "tools": shape["tools"][:-1]},
        "the propertyNames tool": {
            **counted,
            "tools": [t for t in shape["tools"] if t is not odd_schema],
        },
    }
    assert "cache_control" in shape["system"][-1] and shape["tools"][-1] is not odd_schema
    async with _client(claude_served, api_key) as client:
        whole = (await client.beta.messages.count_tokens(**counted)).input_tokens
        for part, without in parts.items():
            fewer = (await client.beta.messages.count_tokens(**without)).input_tokens
            assert fewer < whole, f"{part} is not in the prompt"
