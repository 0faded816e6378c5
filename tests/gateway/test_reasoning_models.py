"""Reasoning models end to end (#39): the tiny DeepSeek-R1 (always thinks) and V3.1 (thinks when
asked) checkpoints behind a real router and gateway, read by the official openai and anthropic
SDKs on every API, streamed and whole. Their random weights never close the thinking unprompted:
a call follows the thinking where a budget closes it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anthropic
import prometheus_client
import pytest
from agents import Agent, ModelSettings, RunConfig, Runner
from agents.models.openai_provider import OpenAIProvider
from aiohttp import web
from aiohttp.test_utils import TestClient

from tests.helpers import MODEL, claude_code
from tests.helpers.gateway import ADMIN_TOKEN, make_config, sdk, start_gateway
from tests.helpers.inprocess import running_router, running_worker
from worker_svc.torch_engine.engine import Engine

HI = [{"role": "user", "content": "What is 2 + 2?"}]
WEATHER_TOOL = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 8}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


def _reasoning_tokens() -> float:
    return (
        prometheus_client.REGISTRY.get_sample_value(
            "infermesh_reasoning_tokens_total", {"model": MODEL}
        )
        or 0.0
    )


def _engine(path: Path, dtype: str) -> Iterator[Engine]:
    engine = Engine.from_checkpoint(path, dtype=dtype)
    yield engine
    asyncio.run(engine.close())


@pytest.fixture(scope="module")
def r1_engine(r1_dir: Path, worker_dtype: str) -> Iterator[Engine]:
    yield from _engine(r1_dir, worker_dtype)


@pytest.fixture(scope="module")
def v31_engine(v31_dir: Path, worker_dtype: str) -> Iterator[Engine]:
    yield from _engine(v31_dir, worker_dtype)


async def _served(
    redis_server, engine: Engine
) -> AsyncIterator[TestClient[web.Request, web.Application]]:
    async with running_router() as router, running_worker(engine, router):
        client = await start_gateway(make_config(redis_server.url, router.address))
        yield client
        await client.close()


@pytest.fixture
async def r1(redis_server, r1_engine):
    """A gateway in front of a router and a worker serving the R1 checkpoint (as MODEL)."""
    async for client in _served(redis_server, r1_engine):
        yield client


@pytest.fixture
async def v31(redis_server, v31_engine):
    """The same, serving the V3.1 checkpoint."""
    async for client in _served(redis_server, v31_engine):
        yield client


def _claude(gateway, api_key) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(
        base_url=str(gateway.make_url("")), api_key=api_key, max_retries=0, timeout=60
    )


async def test_chat_carries_r1s_thinking_as_reasoning_content(r1, api_key):
    ask: dict[str, Any] = {"model": MODEL, "messages": HI, "max_tokens": 12, "temperature": 0}
    async with sdk(r1, api_key, timeout=60) as client:
        whole = await client.chat.completions.create(**ask, reasoning_effort="high")
        stream = await client.chat.completions.create(
            **ask, stream=True, stream_options={"include_usage": True}
        )
        deltas = [chunk async for chunk in stream]
    thought = (whole.choices[0].message.model_extra or {})["reasoning_content"]
    assert thought and not whole.choices[0].message.content
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage is not None and whole.usage.completion_tokens_details is not None
    assert whole.usage.completion_tokens_details.reasoning_tokens == whole.usage.completion_tokens
    streamed = "".join(
        (c.choices[0].delta.model_extra or {}).get("reasoning_content", "")
        for c in deltas
        if c.choices
    )
    assert streamed == thought
    assert not "".join(c.choices[0].delta.content or "" for c in deltas if c.choices)
    usage = deltas[-1].usage
    assert usage is not None and usage.completion_tokens_details is not None
    assert usage.completion_tokens_details.reasoning_tokens == usage.completion_tokens == 12


async def test_a_chat_thinking_budget_closes_the_thinking_and_the_usage_adds_up(r1, api_key):
    async with sdk(r1, api_key, timeout=60) as client:
        completion = await client.chat.completions.create(
            model=MODEL, messages=HI, max_tokens=12, extra_body={"thinking_token_budget": 4}
        )
    message = completion.choices[0].message
    assert (message.model_extra or {})["reasoning_content"] and message.content
    usage = completion.usage
    assert usage is not None and usage.completion_tokens_details is not None
    thinking = usage.completion_tokens_details.reasoning_tokens
    assert usage.completion_tokens == 12
    assert 4 <= thinking < usage.completion_tokens  # the rest, the answer's


async def test_an_agent_on_chat_completions_reads_the_thinking_apart(r1, api_key):
    """The Agents SDK's chat model turns reasoning_content into a reasoning item; the budget
    (its model settings' extra_body) lets the random model answer after it."""
    agent = Agent(
        name="thinker",
        instructions="Answer.",
        model=MODEL,
        model_settings=ModelSettings(max_tokens=24, extra_body={"thinking_token_budget": 8}),
    )
    async with sdk(r1, api_key, timeout=60) as client:
        result = await Runner.run(
            agent,
            "What is 2 + 2?",
            run_config=RunConfig(
                model_provider=OpenAIProvider(openai_client=client, use_responses=False),
                tracing_disabled=True,
            ),
        )
    reasoning, message = (item.raw_item for item in result.new_items)
    assert reasoning.type == "reasoning" and reasoning.summary[0].text
    assert message.type == "message" and result.final_output
    usage = result.context_wrapper.usage
    assert 8 <= usage.output_tokens_details.reasoning_tokens < usage.output_tokens == 24


async def test_v31_thinks_only_when_asked_on_chat_and_responses(v31, api_key):
    async with sdk(v31, api_key, timeout=60) as client:
        plain = await client.chat.completions.create(
            model=MODEL, messages=HI, max_tokens=8, temperature=0
        )
        thinking = await client.chat.completions.create(
            model=MODEL,
            messages=HI,
            max_tokens=8,
            temperature=0,
            extra_body={"chat_template_kwargs": {"thinking": True}},
        )
        answered = await client.responses.create(
            model=MODEL, input="What is 2 + 2?", max_output_tokens=8, reasoning={"effort": "none"}
        )
        async with client.responses.stream(
            model=MODEL,
            input="What is 2 + 2?",
            max_output_tokens=8,
            reasoning={"effort": "medium", "summary": "auto"},
        ) as stream:
            events = [event async for event in stream]
    reasoned = events[-1].response  # response.incomplete: the thinking was cut
    assert plain.choices[0].message.content and not plain.choices[0].message.model_extra
    assert plain.usage and plain.usage.completion_tokens_details
    assert plain.usage.completion_tokens_details.reasoning_tokens == 0
    assert (thinking.choices[0].message.model_extra or {}).get("reasoning_content")
    assert [item.type for item in answered.output] == ["message"]
    assert answered.usage and answered.usage.output_tokens_details.reasoning_tokens == 0
    [item] = reasoned.output
    assert item.type == "reasoning" and item.status == "incomplete"
    assert item.content and item.content[0].text and item.summary[0].text == item.content[0].text
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    assert "".join(deltas) == item.content[0].text
    assert reasoned.usage and reasoned.usage.output_tokens_details.reasoning_tokens == 8
    assert events[-1].type == "response.incomplete"


async def test_messages_thinking_blocks_for_claude_code_and_a_budget(r1, api_key):
    """Claude Code's shape (adaptive thinking, display omitted) streamed; an enabled thinking's
    budget closes the thinking, and a call follows, its arguments streamed after the thinking's
    deltas and signature."""
    shape = claude_code.request(MODEL, max_tokens=16)
    ask: dict[str, Any] = {"model": MODEL, "max_tokens": 1100, "messages": HI}
    budget = {"type": "enabled", "budget_tokens": 1024}
    reasoned = _reasoning_tokens()
    async with _claude(r1, api_key) as claude:
        async with claude.beta.messages.stream(**shape) as stream:
            kinds = [event.type async for event in stream]
            omitted = await stream.get_final_message()
        shown = await claude.messages.create(
            **{**ask, "max_tokens": 8}, thinking={"type": "adaptive"}
        )
        async with claude.messages.stream(
            **ask,
            thinking=budget,
            tools=[WEATHER_TOOL],
            tool_choice={"type": "any", "disable_parallel_tool_use": True},
        ) as stream:
            deltas = [
                event.delta.type async for event in stream if event.type == "content_block_delta"
            ]
            called = await stream.get_final_message()
        disabled = await claude.messages.create(
            **{**ask, "max_tokens": 8}, thinking={"type": "disabled"}
        )
    [block] = omitted.content
    assert block.type == "thinking" and block.thinking == "" and block.signature
    assert omitted.stop_reason == "max_tokens" and omitted.usage.output_tokens == 16
    assert "thinking" not in kinds  # display omitted: no thinking deltas, only the signature
    [thought] = shown.content
    assert thought.type == "thinking" and thought.thinking and thought.signature
    assert [b.type for b in called.content] == ["thinking", "tool_use"]
    assert called.stop_reason == "tool_use" and called.content[1].input["city"]
    signed = deltas.index("signature_delta")
    assert set(deltas[:signed]) == {"thinking_delta"} and set(deltas[signed + 1 :]) == {
        "input_json_delta"
    }
    assert all(b.type != "thinking" for b in disabled.content)
    assert disabled.usage.output_tokens == 8
    # every output token is billed; those of the budget's thinking are counted apart
    assert shown.usage.output_tokens == 8
    thinking = _reasoning_tokens() - reasoned
    assert 1024 + 8 + 16 <= thinking < called.usage.output_tokens + 8 + 16


async def test_responses_reasoning_item_and_the_console_count(r1, api_key):
    async with sdk(r1, api_key, timeout=60) as client:
        response = await client.responses.create(
            model=MODEL, input="What is 2 + 2?", max_output_tokens=6
        )
    [item] = response.output
    assert item.type == "reasoning" and item.content and item.content[0].text
    assert item.summary == []
    assert response.usage and response.usage.output_tokens_details.reasoning_tokens == 6
    signed_in = await r1.post(
        "/console/sign-in", data={"token": ADMIN_TOKEN}, allow_redirects=False
    )
    assert signed_in.status == 303
    page = await (await r1.get("/console/fleet")).text()
    assert "<td>deepseek_r1</td>" in page  # the worker's reasoning format
    served = f"{round(_reasoning_tokens()):,}"  # this process's count, which the page shows
    assert f'<tr><td>{MODEL}</td><td class="num">{served}</td></tr>' in page
