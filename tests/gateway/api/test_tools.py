"""Tool calling and structured outputs through the real gateway, router and worker on the
random-weight tiny model, with the official openai SDK: decoding is constrained, so even random
weights answer with well-formed calls whose arguments match their schema."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from devtools.tiny_model import CALL_BEGIN, CALLS_BEGIN
from infermesh.text.tokenizer import Tokenizer
from tests.helpers import MODEL
from tests.helpers.gateway import auth, sdk
from tests.helpers.tools import SCHEMAS, SLOW_TIMEOUT_S, TOOLS, WEATHER
from worker_svc.config import DEFAULT_MODEL_PATH

_ASK = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "weather in Paris?"}],
    "tools": TOOLS,
    "max_tokens": 300,
    "seed": 7,
    "parallel_tool_calls": False,
}


def _calls(message) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or ()]


def _assert_valid_calls(message) -> None:
    assert message.tool_calls
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize(
    "tool_choice, names",
    [
        ("required", {"get_weather", "get_time"}),
        ({"type": "function", "function": {"name": "get_time"}}, {"get_time"}),
    ],
)
async def test_forced_tool_call_is_valid_streamed_and_not(served, api_key, tool_choice, names):
    async with sdk(served, api_key, timeout=SLOW_TIMEOUT_S) as client:
        completion = await client.chat.completions.create(**_ASK, tool_choice=tool_choice)
        async with client.chat.completions.stream(**_ASK, tool_choice=tool_choice) as stream:
            streamed = await stream.get_final_completion()
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    _assert_valid_calls(choice.message)
    assert {name for name, _ in _calls(choice.message)} <= names
    assert len(choice.message.tool_calls) == 1  # parallel_tool_calls false
    assert streamed.choices[0].finish_reason == "tool_calls"
    assert _calls(streamed.choices[0].message) == _calls(choice.message)


def _forced_tokens(text: str) -> int:
    """The tokens of a call's output up to the end of ``text``, as the tiny model writes it."""
    tokenizer = Tokenizer(DEFAULT_MODEL_PATH)
    return len(tokenizer.hf.encode(f"{CALLS_BEGIN}{CALL_BEGIN}{text}", add_special_tokens=False))


@pytest.mark.parametrize("cut", ["name", "arguments"])
async def test_a_call_cut_by_max_tokens(served, api_key, cut):
    """Cut inside its name (the Agents SDK would raise `Tool get_wea not found`) a call is never
    returned; cut inside its arguments it is, as OpenAI returns it; the finish is length."""
    if cut == "name":
        max_tokens = _forced_tokens("function<｜tool▁sep｜>get_") + 1
    else:
        max_tokens = _forced_tokens('function<｜tool▁sep｜>get_weather\n```json\n{"city": "') + 1
    ask = {
        **_ASK,
        "max_tokens": max_tokens,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
    }
    async with sdk(served, api_key, timeout=SLOW_TIMEOUT_S) as client:
        completion = await client.chat.completions.create(**ask)
        chunks = [c async for c in await client.chat.completions.create(**ask, stream=True)]
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or ()]
    assert completion.choices[0].finish_reason == "length"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    if cut == "name":
        assert completion.choices[0].message.tool_calls is None and deltas == []
    else:
        (call,) = completion.choices[0].message.tool_calls or []
        assert call.function.name == "get_weather"
        # the grammar may spell the forced text in other tokens than encoding it gives
        assert call.function.arguments.startswith('{"city": ')
        with pytest.raises(json.JSONDecodeError):
            json.loads(call.function.arguments)  # cut
        assert [d.function.name for d in deltas if d.id] == ["get_weather"]


async def test_a_named_tool_choice_is_one_call(served, api_key):
    """instructor's TOOLS mode: a named function, parallel calls left allowed."""
    ask = {**_ASK, "parallel_tool_calls": True, "max_tokens": 600, "seed": 3}
    named = {"type": "function", "function": {"name": "get_time"}}
    async with sdk(served, api_key, timeout=SLOW_TIMEOUT_S) as client:
        completion = await client.chat.completions.create(**ask, tool_choice=named)
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert [name for name, _ in _calls(choice.message)] == ["get_time"]


async def test_parallel_calls_stream_as_indexed_deltas(served, api_key):
    ask = {
        **_ASK,
        "parallel_tool_calls": True,
        "tool_choice": "required",
        "seed": 3,
        "stream": True,
        "max_tokens": 400,
    }
    response = await served.post("/v1/chat/completions", headers=auth(api_key), json=ask)
    deltas = [
        json.loads(line.removeprefix("data: "))["choices"][0]["delta"]
        for line in (await response.text()).split("\n\n")
        if line.startswith("data: {")
    ]
    pieces = [d for delta in deltas for d in delta.get("tool_calls", ())]
    firsts = [p for p in pieces if "id" in p]
    assert [p["index"] for p in firsts] == list(range(len(firsts))) and firsts
    assert all(p["type"] == "function" and p["function"]["name"] in SCHEMAS for p in firsts)
    for first in firsts:
        arguments = "".join(
            p["function"]["arguments"] for p in pieces if p["index"] == first["index"]
        )
        jsonschema.validate(json.loads(arguments), SCHEMAS[first["function"]["name"]])


async def test_json_schema_and_json_object_outputs_validate(served, api_key):
    schema_format = {
        "type": "json_schema",
        "json_schema": {"name": "weather", "schema": WEATHER, "strict": True},
    }
    ask = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "json please"}],
        "max_tokens": 200,
        "seed": 11,
    }
    async with sdk(served, api_key, timeout=SLOW_TIMEOUT_S) as client:
        shaped = await client.chat.completions.create(**ask, response_format=schema_format)
        async with client.chat.completions.stream(**ask, response_format=schema_format) as stream:
            streamed = await stream.get_final_completion()
        obj = await client.chat.completions.create(
            **{**ask, "max_tokens": 300}, temperature=0, response_format={"type": "json_object"}
        )
    jsonschema.validate(json.loads(shaped.choices[0].message.content), WEATHER)
    assert shaped.choices[0].finish_reason == "stop"
    assert streamed.choices[0].message.content == shaped.choices[0].message.content
    if obj.choices[0].finish_reason == "stop":  # greedy random weights may fill max_tokens
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    else:
        assert obj.choices[0].message.content.startswith("{")


async def test_tool_choice_none_never_calls(served, api_key):
    async with sdk(served, api_key, timeout=SLOW_TIMEOUT_S) as client:
        for seed in range(3):
            completion = await client.chat.completions.create(
                **{**_ASK, "max_tokens": 24, "seed": seed}, tool_choice="none"
            )
            assert completion.choices[0].message.tool_calls is None
            assert completion.choices[0].finish_reason in ("stop", "length")


async def test_round_trip_call_result_next_turn(served, api_key):
    async with sdk(served, api_key, timeout=SLOW_TIMEOUT_S) as client:
        first = await client.chat.completions.create(**_ASK, tool_choice="required")
        call = first.choices[0].message.tool_calls[0]
        history = [
            *_ASK["messages"],
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": "21 degrees"},
        ]
        second = await client.chat.completions.create(
            **{**_ASK, "messages": history, "max_tokens": 8}, tool_choice="none"
        )
    assert second.choices[0].message.tool_calls is None and second.choices[0].message.content
    assert second.usage.prompt_tokens > first.usage.prompt_tokens


def _tool(name: str, parameters: dict[str, Any] | None = None) -> dict[str, Any]:
    function: dict[str, Any] = {"name": name}
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


@pytest.mark.parametrize(
    "change, param",
    [
        ({"tools": [_tool("f", {"type": "nope"})]}, "tools.0.function.parameters"),
        (  # an answer's schema must be enforceable whole (a tool's is enforced leniently)
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "x",
                        "schema": {"type": "object", "dependentSchemas": {"a": {}}},
                    },
                }
            },
            "response_format.json_schema.schema",
        ),
        (
            {"tools": [{"type": "function", "function": {"parameters": WEATHER}}]},
            "tools.0.function.name",
        ),
        ({"tools": [_tool("f"), _tool("f")]}, "tools"),
        (
            {"tools": [_tool("f")], "tool_choice": {"type": "function", "function": {"name": "g"}}},
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": 3}},
                }
            },
            "response_format.json_schema.schema",
        ),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"logit_bias": {"1": 5}}, "logit_bias"),
        ({"messages": [{"role": "tool", "content": "r"}]}, "messages.0"),
    ],
)
async def test_bad_tools_and_formats_are_400_naming_the_parameter(gateway, api_key, change, param):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **change}
    response = await gateway.post("/v1/chat/completions", headers=auth(api_key), json=body)
    assert response.status == 400
    assert (await response.json())["error"]["param"] == param
