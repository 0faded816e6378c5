"""Reasoning models end to end (#39): the tiny DeepSeek-R1 (always thinks) and V3.1 (thinks when
asked) checkpoints behind a real router and gateway, read by the official openai and anthropic
SDKs on every API, streamed and whole. Their random weights never close the thinking unprompted:
a call follows the thinking where a budget closes it. The trained chat model's thinking variant
closes it by itself: the separation is the model's, with no budget."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import anthropic
import prometheus_client
import pytest
from agents import Agent, ModelSettings, RunConfig, Runner
from agents.models.openai_provider import OpenAIProvider
from aiohttp import web
from aiohttp.test_utils import TestClient
from openai.types.shared import Reasoning

from tests.helpers import MODEL, claude_code
from tests.helpers.gateway import ADMIN_TOKEN, make_config, sdk, start_gateway
from tests.helpers.inprocess import running_router, running_worker
from worker_svc.torch_engine.engine import Engine

HI = [{"role": "user", "content": "What is 2 + 2?"}]
FUNCTION = {
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
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
async def thinker(redis_server, thinking_chat_engine):
    """The same, serving the default chat model's thinking variant."""
    async for client in _served(redis_server, thinking_chat_engine):
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


async def test_a_chat_thinking_budget_closes_the_thinking_before_an_answer_or_a_call(r1, api_key):
    budget = {"thinking_token_budget": 4}
    async with sdk(r1, api_key, timeout=60) as client:
        completion = await client.chat.completions.create(
            model=MODEL, messages=HI, max_tokens=12, temperature=0, logprobs=True, extra_body=budget
        )
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=HI,
            max_tokens=64,
            tools=[{"type": "function", "function": FUNCTION}],
            tool_choice="required",
            parallel_tool_calls=False,
            stream=True,
            extra_body=budget,
        )
        deltas = [chunk.choices[0].delta async for chunk in stream if chunk.choices]
    message = completion.choices[0].message
    assert (message.model_extra or {})["reasoning_content"] and message.content
    usage = completion.usage
    assert usage is not None and usage.completion_tokens_details is not None
    thinking = usage.completion_tokens_details.reasoning_tokens
    assert usage.completion_tokens == 12
    assert thinking == 4 + 1  # the budget's, then the closing tag it forced
    # every token of the completion, in order (logprobs carry the thinking's too, as vLLM's):
    # the thinking's are the reasoning, the rest the answer, and the two add up to the usage
    assert completion.choices[0].logprobs and completion.choices[0].logprobs.content
    tokens = [t.token for t in completion.choices[0].logprobs.content]
    assert len(tokens) == usage.completion_tokens and tokens[thinking - 1] == "</think>"
    assert "".join(tokens[: thinking - 1]) == (message.model_extra or {})["reasoning_content"]
    assert "".join(tokens[thinking:]) == message.content
    kinds = [
        "reasoning" if (d.model_extra or {}).get("reasoning_content") else "call"
        for d in deltas
        if (d.model_extra or {}).get("reasoning_content") or d.tool_calls
    ]
    assert kinds[0] == "reasoning" and kinds[-1] == "call"
    assert kinds == sorted(kinds, reverse=True)  # the thinking, then the call
    arguments = "".join(c.function.arguments or "" for d in deltas for c in d.tool_calls or ())
    assert json.loads(arguments)["city"]


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


async def test_messages_thinking_blocks_for_claude_code(r1, api_key):
    """Claude Code's shape (adaptive thinking, display omitted) streamed; the thinking shown,
    streamed and whole, its signature after its deltas; left out when disabled. (An enabled
    thinking's budget is 1,024 tokens at least, too long a wait for this random model: the chat
    test below closes the thinking with a budget.)"""
    shape = claude_code.request(MODEL, max_tokens=16)
    greedy = {"temperature": 0}  # this SDK takes no temperature argument
    ask: dict[str, Any] = {"model": MODEL, "max_tokens": 8, "messages": HI, "extra_body": greedy}
    reasoned = _reasoning_tokens()
    async with _claude(r1, api_key) as claude:
        async with claude.beta.messages.stream(**shape) as stream:
            kinds = [event.type async for event in stream]
            omitted = await stream.get_final_message()
        shown = await claude.messages.create(**ask, thinking={"type": "adaptive"})
        async with claude.messages.stream(**ask) as stream:
            deltas = [
                event.delta.type async for event in stream if event.type == "content_block_delta"
            ]
            streamed = await stream.get_final_message()
        disabled = await claude.messages.create(**ask, thinking={"type": "disabled"})
    [block] = omitted.content
    assert block.type == "thinking" and block.thinking == "" and block.signature
    assert omitted.stop_reason == "max_tokens" and omitted.usage.output_tokens == 16
    assert "thinking" not in kinds  # display omitted: no thinking deltas, only the signature
    assert [b.model_dump() for b in streamed.content] == [b.model_dump() for b in shown.content]
    [thought] = shown.content
    assert thought.type == "thinking" and thought.thinking and thought.signature
    assert set(deltas[:-1]) == {"thinking_delta"} and deltas[-1] == "signature_delta"
    assert disabled.content == [] and disabled.usage.output_tokens == 8
    # every output token is billed as output; those of the thinking are counted apart
    assert _reasoning_tokens() - reasoned == 16 + 3 * 8


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


async def test_the_trained_model_asked_to_think_closes_its_thinking_itself_and_answers(
    thinker, api_key
):
    """No budget: the model thinks a sentence, writes </think> and answers, the two apart;
    without the flag there is no thinking."""
    ask: dict[str, Any] = {"model": MODEL, "temperature": 0, "max_tokens": 96, "messages": HI}
    async with sdk(thinker, api_key, timeout=60) as client:
        thought = await client.chat.completions.create(
            **ask, extra_body={"chat_template_kwargs": {"thinking": True}}
        )
        plain = await client.chat.completions.create(**ask)
    [choice] = thought.choices
    assert choice.finish_reason == "stop"
    assert (choice.message.model_extra or {}).get("reasoning_content")
    assert choice.message.content and "think>" not in choice.message.content
    usage = thought.usage
    assert usage is not None and usage.completion_tokens_details is not None
    assert 0 < (usage.completion_tokens_details.reasoning_tokens or 0) < usage.completion_tokens
    assert plain.choices[0].finish_reason == "stop" and plain.choices[0].message.content
    assert not (plain.choices[0].message.model_extra or {}).get("reasoning_content")
    assert "think>" not in plain.choices[0].message.content


async def test_the_trained_model_on_messages_gives_a_thinking_block_then_the_answer(
    thinker, api_key
):
    async with _claude(thinker, api_key) as claude:
        message = await claude.messages.create(
            model=MODEL,
            max_tokens=2048,
            thinking={"type": "enabled", "budget_tokens": 1024},
            messages=[{"role": "user", "content": "Say hello"}],
            extra_body={"temperature": 0},
        )
    assert [block.type for block in message.content] == ["thinking", "text"]
    thinking, text = message.content
    assert thinking.type == "thinking" and thinking.thinking and thinking.signature
    assert text.type == "text" and text.text and "think>" not in text.text
    assert message.stop_reason == "end_turn"


async def test_an_agent_on_the_responses_api_reads_the_trained_models_thinking_over_two_turns(
    thinker, api_key
):
    """The Agents SDK's default model (the Responses API) with reasoning asked for: the thinking
    comes back as a reasoning item apart from the answer, and the next turn sends it back (as
    the SDK does), which the mesh accepts and leaves out of the prompt."""
    agent = Agent(
        name="thinker",
        instructions="Be brief.",
        model=MODEL,
        model_settings=ModelSettings(
            reasoning=Reasoning(effort="low"), max_tokens=96, temperature=0
        ),
    )
    async with sdk(thinker, api_key, timeout=60) as client:
        config = RunConfig(
            model_provider=OpenAIProvider(openai_client=client), tracing_disabled=True
        )
        first = await Runner.run(agent, "Say hello", run_config=config)
        again = [*first.to_input_list(), {"role": "user", "content": "Count from 1 to 5"}]
        second = await Runner.run(agent, again, run_config=config)
    for result in (first, second):
        kinds = [item.type for item in result.new_items]
        assert kinds == ["reasoning_item", "message_output_item"], kinds
        assert result.final_output and "think>" not in result.final_output
        usage = result.context_wrapper.usage
        assert 0 < usage.output_tokens_details.reasoning_tokens < usage.output_tokens
