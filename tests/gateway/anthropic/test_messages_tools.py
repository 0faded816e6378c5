"""Anthropic tool use (``tools``, ``tool_choice``, tool_use and tool_result blocks) through the real
gateway, router and worker, with the official anthropic SDK."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import jsonschema
import pytest

from tests.helpers import MODEL
from tests.helpers.gateway import auth, prompt_tokens
from tests.helpers.tools import SCHEMAS, SLOW_TIMEOUT_S, TIME, WEATHER

TOOLS = [
    {"name": "get_weather", "description": "Weather in a city", "input_schema": WEATHER},
    {"name": "get_time", "input_schema": TIME},
]
_ASK = {
    "model": MODEL,
    "max_tokens": 300,
    "tools": TOOLS,
    "messages": [{"role": "user", "content": "weather in Paris?"}],
}


def _client(gateway, api_key) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(
        base_url=str(gateway.make_url("")), api_key=api_key, max_retries=0, timeout=SLOW_TIMEOUT_S
    )


def _uses(message) -> list[tuple[str, dict[str, Any]]]:
    return [(b.name, b.input) for b in message.content if b.type == "tool_use"]


@pytest.mark.parametrize(
    "tool_choice, names",
    [
        ({"type": "any", "disable_parallel_tool_use": True}, {"get_weather", "get_time"}),
        (
            {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
            {"get_weather"},
        ),
    ],
)
async def test_tool_use_streamed_and_not(served, api_key, tool_choice, names):
    ask = {**_ASK, "tool_choice": tool_choice, "extra_body": {"seed": 5}}
    async with _client(served, api_key) as client:
        message = await client.messages.create(**ask)
        async with client.messages.stream(**ask) as stream:
            events = [event.type async for event in stream]
            streamed = await stream.get_final_message()
    assert message.stop_reason == "tool_use" and streamed.stop_reason == "tool_use"
    uses = _uses(message)
    assert len(uses) == 1 and uses[0][0] in names
    jsonschema.validate(uses[0][1], SCHEMAS[uses[0][0]])
    assert all(b.id for b in message.content if b.type == "tool_use")
    assert "input_json" in events and events[-1] == "message_stop"
    # no empty text block before the calls (Anthropic refuses one sent back in a history)
    assert [b.type for b in message.content] == [b.type for b in streamed.content] == ["tool_use"]
    assert len(_uses(streamed)) == 1 and _uses(streamed)[0][0] in names
    assert prompt_tokens(streamed.usage) == prompt_tokens(message.usage) > 0


async def test_tool_result_round_trip(served, api_key):
    async with _client(served, api_key) as client:
        first = await client.messages.create(**_ASK, tool_choice={"type": "any"})
        use = next(b for b in first.content if b.type == "tool_use")
        second = await client.messages.create(
            **{
                **_ASK,
                "max_tokens": 8,
                "messages": [
                    *_ASK["messages"],
                    {"role": "assistant", "content": first.content},
                    {
                        "role": "user",
                        "content": [
                            {"type": "tool_result", "tool_use_id": use.id, "content": "21 degrees"},
                            {"type": "text", "text": "and tomorrow?"},
                        ],
                    },
                ],
            },
            tool_choice={"type": "none"},
        )
    assert second.stop_reason in ("end_turn", "max_tokens") and not _uses(second)
    assert prompt_tokens(second.usage) > prompt_tokens(first.usage)


async def test_output_format_answers_json_of_the_schema(served, api_key):
    ask = {
        "model": MODEL,
        "max_tokens": 300,
        "messages": [{"role": "user", "content": "weather?"}],
        "output_config": {"format": {"type": "json_schema", "schema": WEATHER}, "effort": "low"},
        "thinking": {"type": "adaptive"},
        "extra_body": {"seed": 3},
    }
    async with _client(served, api_key) as client:
        message = await client.messages.create(**ask)
        async with client.messages.stream(**ask) as stream:
            streamed = await stream.get_final_message()
    assert message.stop_reason == "end_turn" and streamed.stop_reason == "end_turn"
    for answer in (message, streamed):
        assert [b.type for b in answer.content] == ["text"]
        jsonschema.validate(json.loads(answer.content[0].text), WEATHER)


@pytest.mark.parametrize(
    "change, param",
    [
        ({"tools": [{"name": "f", "input_schema": {"type": "nope"}}]}, "tools.0.input_schema"),
        ({"tools": [{"input_schema": WEATHER}]}, "tools.0.name"),
        (
            {"tools": [{"name": "f", "input_schema": TIME}, {"name": "f", "input_schema": TIME}]},
            "tools",
        ),
        (
            {
                "tools": [{"name": "f", "input_schema": TIME}],
                "tool_choice": {"type": "tool", "name": "g"},
            },
            "tool_choice.name",
        ),
        ({"tool_choice": {"type": "any"}}, "tool_choice"),
        (
            {"output_config": {"format": {"type": "json_schema", "schema": {"type": "nope"}}}},
            "output_config.format.schema",
        ),
        (  # a model that does not think
            {"thinking": {"type": "enabled", "budget_tokens": 2048}, "max_tokens": 4096},
            "thinking.type",
        ),
        ({"output_config": {"effort": "extreme"}}, "output_config.effort"),
        (
            {"messages": [{"role": "system", "content": [{"type": "thinking", "thinking": ""}]}]},
            "thinking blocks do not belong in system turns",
        ),
        (
            {
                "context_management": {
                    "edits": [
                        {
                            "type": "clear_tool_uses_20250919",
                            "keep": {"type": "input_tokens", "value": 3},
                        }
                    ]
                }
            },
            "context_management.edits.0.keep.type",
        ),
        ({"container": "container_1"}, "container"),
        (
            {"mcp_servers": [{"type": "url", "url": "https://mcp.example", "name": "m"}]},
            "mcp_servers",
        ),
    ],
)
async def test_bad_tools_are_400_naming_the_parameter(served, api_key, change, param):
    body = {
        "model": MODEL,
        "max_tokens": 8,
        "messages": [{"role": "user", "content": "hi"}],
        **change,
    }
    response = await served.post("/v1/messages", headers=auth(api_key), json=body)
    assert response.status == 400
    assert param in (await response.json())["error"]["message"]
