"""The Responses request as the router gets it: items become chat turns, namespaced tools one flat
name each, tools the mesh cannot offer are left out and named."""

from __future__ import annotations

from typing import Any

from gateway.openai.responses_protocol import (
    ResponsesRequest,
    flat_name,
    parse_responses_request,
    router_messages,
)
from infermesh.pb import common_pb2
from tests.helpers.tools import TIME, WEATHER


def _request(**fields: Any) -> ResponsesRequest:
    return parse_responses_request({"model": "m", **fields}, {})


def _turns(request: ResponsesRequest) -> list[tuple[str, str, list[str], str]]:
    return [
        (m.role, m.content, [c.name for c in m.tool_calls], m.tool_call_id)
        for m in router_messages(request.instructions, request.items())
    ]


def test_items_become_chat_turns():
    request = _request(
        instructions="Be brief.",
        input=[
            {"role": "developer", "content": [{"type": "input_text", "text": "Use tools."}]},
            {"role": "user", "content": "weather and time?"},
            {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "x"},
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "Checking.", "annotations": []}],
            },
            {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
            {
                "type": "function_call",
                "call_id": "c2",
                "name": "get_time",
                "namespace": "clock",
                "arguments": "{}",
            },
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            {
                "type": "function_call_output",
                "call_id": "c2",
                "output": [{"type": "input_text", "text": "noon"}],
            },
        ],
    )
    assert _turns(request) == [
        ("system", "Be brief.", [], ""),
        ("system", "Use tools.", [], ""),  # developer: a system turn
        ("user", "weather and time?", [], ""),
        ("assistant", "Checking.", ["get_weather", "clock__get_time"], ""),  # one turn
        ("tool", "sunny", [], "c1"),
        ("tool", "noon", [], "c2"),
    ]


def test_calls_without_text_open_their_own_assistant_turn():
    request = _request(
        input=[
            {"role": "user", "content": "hi"},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "1"},
            {"type": "function_call", "call_id": "c2", "name": "f", "arguments": "{}"},
        ]
    )
    assert [(role, calls) for role, _, calls, _ in _turns(request)] == [
        ("user", []),
        ("assistant", ["f"]),
        ("tool", []),
        ("assistant", ["f"]),
    ]


def test_namespaced_functions_are_offered_flat_and_hosted_tools_left_out():
    request = _request(
        input="hi",
        tools=[
            {"type": "web_search"},
            {"type": "function", "name": "get_weather", "parameters": WEATHER, "strict": True},
            {
                "type": "namespace",
                "name": "mcp__clock__",
                "description": "Clock",
                "tools": [
                    {"type": "function", "name": "get_time", "parameters": TIME},
                    {"type": "custom", "name": "free_text"},
                ],
            },
            {"type": "mcp", "server_label": "x"},
        ],
        tool_choice={"type": "function", "name": "mcp__clock__get_time"},
        parallel_tool_calls=False,
        text={"format": {"type": "json_object"}},
    )
    tools = request.tool_set
    assert tools.unoffered == ["custom", "mcp", "web_search"]
    assert tools.call_name("mcp__clock__get_time") == ("mcp__clock__", "get_time")
    assert tools.call_name("get_weather") == (None, "get_weather")
    assert [t["type"] for t in tools.echo] == ["function", "namespace"]
    generate = request.generate_request("req-1", messages=router_messages(None, request.items()))
    assert [t.name for t in generate.tools] == ["get_weather", "mcp__clock__get_time"]
    assert generate.tool_choice == common_pb2.TOOL_CHOICE_NAMED
    assert generate.tool_name == "mcp__clock__get_time"
    assert generate.single_tool_call and generate.json_schema == '{"type": "object"}'


def test_flat_names_join_as_codex_does():
    assert flat_name(None, "f") == "f"
    assert flat_name("multi_agent_v1", "spawn_agent") == "multi_agent_v1__spawn_agent"
    assert flat_name("mcp__fs__", "_read") == "mcp__fs__read"


def test_sampling_and_logprobs():
    request = _request(
        input="hi",
        temperature=0.5,
        top_p=0.9,
        max_output_tokens=7,
        include=["message.output_text.logprobs", "reasoning.encrypted_content"],
        top_logprobs=2,
    )
    sampling = request.generate_request("r", messages=[]).sampling
    assert (sampling.max_tokens, sampling.logprobs, sampling.top_logprobs) == (7, True, 2)
    assert abs(sampling.temperature - 0.5) < 1e-6 and abs(sampling.top_p - 0.9) < 1e-6
    plain = _request(input="hi", top_logprobs=2).generate_request("r", messages=[]).sampling
    assert not plain.logprobs and not plain.HasField("max_tokens")
