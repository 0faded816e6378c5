"""OpenAI's Responses API through the real gateway, router and worker on the random-weight tiny
model, with the official openai SDK; every answer is also parsed strictly with the SDK's own
models (the SDK itself builds its objects without validating them)."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from openai.types.responses.response_item_list import ResponseItemList
from pydantic import TypeAdapter

from tests.helpers import MODEL
from tests.helpers.gateway import auth, sdk
from tests.helpers.openresponses import validate_event, validate_response
from tests.helpers.tools import SLOW_TIMEOUT_S, TIME, WEATHER
from worker_svc.config import CacheSection

_EVENTS = TypeAdapter(ResponseStreamEvent)
_GREEDY = {"model": MODEL, "temperature": 0, "max_output_tokens": 12}
_WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather in a city",
    "parameters": WEATHER,
    "strict": True,
}


def _text(response) -> str:
    return "".join(
        c.text for item in response.output if item.type == "message" for c in item.content
    )


def _calls(response) -> list[tuple[str, str, str | None]]:
    return [
        (item.name, item.arguments, item.namespace)
        for item in response.output
        if item.type == "function_call"
    ]


async def _raw_events(served, api_key, body: dict[str, Any]) -> list[dict[str, Any]]:
    response = await served.post(
        "/v1/responses", headers=auth(api_key), json={**body, "stream": True}
    )
    assert response.status == 200, await response.text()
    assert response.headers["Content-Type"].startswith("text/event-stream")
    events = []
    for frame in (await response.text()).split("\n\n"):
        if frame:
            name, data = frame.split("\n", 1)
            event = json.loads(data.removeprefix("data: "))
            assert name == f"event: {event['type']}"
            events.append(event)
    return events


async def test_create_answers_a_response_the_sdk_models_accept(served, api_key):
    ask = {**_GREEDY, "input": "Hello " * 40, "instructions": "Be brief.", "metadata": {"run": "1"}}
    async with sdk(served, api_key, timeout=SLOW_TIMEOUT_S) as client:
        raw = await client.responses.with_raw_response.create(**ask)
        again = await client.responses.create(**ask)
    validate_response(json.loads(raw.content))
    response = Response.model_validate(json.loads(raw.content))
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.status in ("completed", "incomplete") and response.model == MODEL
    assert response.instructions == "Be brief." and response.metadata == {"run": "1"}
    assert response.store is True and response.temperature == 0
    [message] = response.output
    assert message.type == "message" and message.role == "assistant" and message.content[0].text
    usage = response.usage
    assert usage.output_tokens <= 12 and usage.input_tokens > 0
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    # the same prompt again reads from the worker's prefix cache every whole block but the one
    # holding its last token (whose logits are computed)
    block = CacheSection().block_size
    assert again.usage.input_tokens == usage.input_tokens > 2 * block
    expected = (usage.input_tokens - 1) // block * block
    assert again.usage.input_tokens_details.cached_tokens == expected
    if response.status == "incomplete":
        assert response.incomplete_details.reason == "max_output_tokens"
        assert message.status == "incomplete"


@pytest.mark.parametrize(
    "shape",
    [
        # constrained, so that even random weights finish: responses.stream() assembles only a
        # response.completed (an incomplete one ends with response.incomplete)
        {"text": {"format": {"type": "json_schema", "name": "w", "schema": WEATHER}}},
        {"tools": [_WEATHER_TOOL], "tool_choice": "required", "parallel_tool_calls": False},
    ],
)
async def test_stream_assembles_into_the_created_response(served, api_key, shape):
    ask = {
        **_GREEDY,
        **shape,
        "max_output_tokens": 300,
        # long enough to fill a few of the prefix cache's blocks
        "input": [
            {"role": "developer", "content": "Answer. " * 80},
            {"role": "user", "content": "Hi"},
        ],
    }
    async with sdk(served, api_key, timeout=SLOW_TIMEOUT_S) as client:
        created = await client.responses.create(**ask)
        async with client.responses.stream(**ask) as stream:
            events = [e async for e in stream]
            streamed = await stream.get_final_response()
    assert created.status == streamed.status == "completed"
    assert _text(streamed) == _text(created)
    assert _calls(streamed) == _calls(created) and bool(_calls(created)) == ("tools" in shape)
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    arguments = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert "".join(deltas) == _text(created)
    assert "".join(arguments) == "".join(arguments for _, arguments, _ in _calls(created))
    assert streamed.usage.input_tokens == created.usage.input_tokens
    assert streamed.usage.output_tokens == created.usage.output_tokens
    # the same prompt again: its prefix is in the worker's cache
    assert streamed.usage.input_tokens_details.cached_tokens > 0


async def test_every_event_is_numbered_and_parses(served, api_key):
    body = {
        **_GREEDY,
        "input": "Hi",
        "max_output_tokens": 4,
        "include": ["message.output_text.logprobs"],
        "top_logprobs": 2,
    }
    events = await _raw_events(served, api_key, body)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    for event in events:
        _EVENTS.validate_python(event)
        validate_event(event)
    kinds = [e["type"] for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",  # four tokens of random text: cut by max_output_tokens
    ]
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert events[0]["response"]["status"] == "in_progress"
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    logprobs = [lp for e in deltas for lp in e["logprobs"]]
    assert logprobs and all(len(lp["top_logprobs"]) == 2 for lp in logprobs)
    [message] = events[-1]["response"]["output"]
    assert message["content"][0]["logprobs"] == logprobs


async def test_a_function_call_and_its_events_validate_against_open_responses(served, api_key):
    """Every field the Open Responses document requires is there, in a response that calls a
    tool with sampling penalties given (they are echoed) and in each event of its stream."""
    body = {
        **_GREEDY,
        "input": "weather in Paris?",
        "tools": [_WEATHER_TOOL],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "max_output_tokens": 300,
        "presence_penalty": 0.5,
    }
    response = await served.post("/v1/responses", headers=auth(api_key), json=body)
    answer = await response.json()
    validate_response(answer)
    assert (answer["presence_penalty"], answer["frequency_penalty"]) == (0.5, 0.0)
    events = await _raw_events(served, api_key, body)
    for event in events:
        validate_event(event)
    assert [item["type"] for item in events[-1]["response"]["output"]] == ["function_call"]


async def test_stored_response_is_retrieved_listed_and_deleted(served, api_key, redis_client):
    items = [{"role": "user", "content": f"turn {i}"} for i in range(3)]
    async with sdk(served, api_key, timeout=SLOW_TIMEOUT_S) as client:
        created = await client.responses.create(**_GREEDY, input=items)
        retrieved = await client.responses.retrieve(created.id)
        raw = await client.responses.input_items.with_raw_response.list(created.id)
        ascending = [i async for i in client.responses.input_items.list(created.id, order="asc")]
        first_page = await client.responses.input_items.list(created.id, limit=2, order="asc")
        second_page = await client.responses.input_items.list(
            created.id, limit=2, order="asc", after=first_page.data[-1].id
        )
        await client.responses.delete(created.id)
        with pytest.raises(openai.NotFoundError) as gone:
            await client.responses.retrieve(created.id)
    assert retrieved.model_dump() == created.model_dump()
    listed = ResponseItemList.model_validate(json.loads(raw.content))  # newest first by default
    assert [i.content[0].text for i in listed.data] == ["turn 2", "turn 1", "turn 0"]
    assert [i.content[0].text for i in ascending] == ["turn 0", "turn 1", "turn 2"]
    assert len(first_page.data) == 2 and first_page.has_more
    assert [i.content[0].text for i in second_page.data] == ["turn 2"] and not second_page.has_more
    assert gone.value.body["message"] == f"Response with id '{created.id}' not found."
    assert not await redis_client.keys("infermesh:response:*")


async def test_another_keys_response_is_not_found(served, api_key, redis_client):
    from gateway.accounts.keys import create_key

    other = await create_key(redis_client, "other")
    async with sdk(served, api_key) as mine, sdk(served, other) as theirs:
        created = await mine.responses.create(**{**_GREEDY, "max_output_tokens": 2}, input="Hi")
        with pytest.raises(openai.NotFoundError):
            await theirs.responses.retrieve(created.id)
        with pytest.raises(openai.NotFoundError):
            await theirs.responses.delete(created.id)
        with pytest.raises(openai.NotFoundError) as continued:
            await theirs.responses.create(**_GREEDY, input="again", previous_response_id=created.id)
        assert (await mine.responses.retrieve(created.id)).id == created.id
    assert continued.value.body["code"] == "previous_response_not_found"
    assert continued.value.body["param"] == "previous_response_id"


async def test_unstored_response_cannot_be_retrieved(served, api_key, redis_client):
    async with sdk(served, api_key) as client:
        created = await client.responses.create(**_GREEDY, input="Hi", store=False)
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(created.id)
    assert created.store is False
    assert not await redis_client.keys("infermesh:response:*")


async def test_function_tool_round_trip_with_previous_response_id(served, api_key):
    ask = {**_GREEDY, "tools": [_WEATHER_TOOL], "max_output_tokens": 300}
    async with sdk(served, api_key, timeout=SLOW_TIMEOUT_S) as client:
        first = await client.responses.create(
            **ask, input="weather in Paris?", tool_choice="required", parallel_tool_calls=False
        )
        [call] = [item for item in first.output if item.type == "function_call"]
        second = await client.responses.create(
            **{**ask, "max_output_tokens": 8},
            previous_response_id=first.id,
            input=[{"type": "function_call_output", "call_id": call.call_id, "output": "21 C"}],
            tool_choice="none",
        )
        listed = await client.responses.input_items.list(second.id)
    assert first.status == "completed" and call.name == "get_weather" and call.status == "completed"
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    assert second.previous_response_id == first.id and _text(second) and not _calls(second)
    # the first exchange is its prompt: longer than the first request's
    assert second.usage.input_tokens > first.usage.input_tokens
    assert [i.type for i in listed.data] == ["function_call_output"]  # its own input only


async def test_function_tool_round_trip_with_the_full_history(served, api_key):
    ask = {**_GREEDY, "tools": [_WEATHER_TOOL], "max_output_tokens": 300, "store": False}
    question = [{"role": "user", "content": "weather in Paris?"}]
    async with sdk(served, api_key, timeout=SLOW_TIMEOUT_S) as client:
        first = await client.responses.create(
            **ask, input=question, tool_choice="required", parallel_tool_calls=False
        )
        history = [
            *question,
            {"type": "reasoning", "id": "rs_1", "summary": []},  # another model's: dropped
            *(item.model_dump(exclude_none=True) for item in first.output),
            *(
                {"type": "function_call_output", "call_id": item.call_id, "output": "21 C"}
                for item in first.output
                if item.type == "function_call"
            ),
        ]
        second = await client.responses.create(
            **{**ask, "max_output_tokens": 8}, input=history, tool_choice="none"
        )
    assert _calls(first) and not _calls(second) and _text(second)
    assert second.usage.input_tokens > first.usage.input_tokens


async def test_json_schema_output_validates(served, api_key):
    text = {"format": {"type": "json_schema", "name": "weather", "schema": WEATHER, "strict": True}}
    ask = {**_GREEDY, "input": "json please", "max_output_tokens": 200, "text": text}
    async with sdk(served, api_key, timeout=SLOW_TIMEOUT_S) as client:
        created = await client.responses.create(**ask)
        async with client.responses.stream(**ask) as stream:
            streamed = await stream.get_final_response()
    assert created.status == "completed"
    jsonschema.validate(json.loads(_text(created)), WEATHER)
    assert _text(streamed) == _text(created)
    assert created.text.format.type == "json_schema" and created.text.format.name == "weather"


async def test_namespaced_tools_are_called_by_name_and_hosted_ones_are_named(served, api_key):
    tools = [
        {"type": "web_search", "external_web_access": False},
        {
            "type": "namespace",
            "name": "clock",
            "description": "Time tools",
            "tools": [{"type": "function", "name": "get_time", "parameters": TIME}],
        },
        {"type": "file_search", "vector_store_ids": ["vs_1"]},
    ]
    body = {
        **_GREEDY,
        "input": "time?",
        "tools": tools,
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "max_output_tokens": 300,
    }
    events = await _raw_events(served, api_key, body)
    response = await served.post("/v1/responses", headers=auth(api_key), json=body)
    answer = Response.model_validate(await response.json())
    assert response.headers["x-infermesh-unsupported-tools"] == "file_search,web_search"
    assert answer.metadata == {"infermesh_unsupported_tools": "file_search,web_search"}
    assert [t.type for t in answer.tools] == ["namespace"]  # what the model was offered
    [(name, arguments, namespace)] = _calls(answer)
    assert (name, namespace) == ("get_time", "clock")
    jsonschema.validate(json.loads(arguments), TIME)
    done = [e for e in events if e["type"] == "response.output_item.done"]
    assert [(e["item"]["name"], e["item"]["namespace"]) for e in done] == [("get_time", "clock")]


async def test_a_namespaced_call_in_the_history_is_understood(served, api_key):
    tools = [
        {
            "type": "namespace",
            "name": "clock",
            "description": "Time tools",
            "tools": [{"type": "function", "name": "get_time", "parameters": TIME}],
        }
    ]
    history = [
        {"role": "user", "content": "time?"},
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "get_time",
            "namespace": "clock",
            "arguments": '{"utc_offset":1}',
        },
        {"type": "function_call_output", "call_id": "call_1", "output": "noon"},
    ]
    async with sdk(served, api_key, timeout=SLOW_TIMEOUT_S) as client:
        answer = await client.responses.create(**_GREEDY, input=history, tools=tools, store=False)
    assert answer.status in ("completed", "incomplete")


async def test_worker_lost_mid_stream_ends_with_response_failed(served, worker, api_key):
    response = await served.post(
        "/v1/responses",
        headers=auth(api_key),
        json={"model": MODEL, "input": "Hi", "stream": True},  # runs to the context's end
    )
    assert response.status == 200
    await response.content.readline()
    await worker.server.stop(grace=None)
    events = [
        json.loads(line.removeprefix("data: "))
        for line in (await response.text()).split("\n")
        if line.startswith("data: ")
    ]
    failed = events[-1]
    assert failed["type"] == "response.failed", failed
    assert failed["response"]["status"] == "failed"
    assert failed["response"]["error"]["code"] == "server_error"
    assert failed["sequence_number"] == events[-2]["sequence_number"] + 1
    _EVENTS.validate_python(failed)
    validate_event(failed)
    retrieved = await served.get(f"/v1/responses/{failed['response']['id']}", headers=auth(api_key))
    assert retrieved.status == 404  # a failed response is not stored


async def test_a_codex_shaped_request_completes_a_turn(served, api_key):
    """The request Codex CLI sends (observed on the wire), its instructions shortened, and with
    max_output_tokens so that random weights stop soon."""
    parameters = {
        "type": "object",
        "properties": {"cmd": {"type": "string", "maxLength": 8}},
        "required": ["cmd"],
        "additionalProperties": False,
    }
    body = {
        "model": MODEL,
        "stream": True,
        "store": False,
        "input": [
            {
                "type": "message",
                "id": "msg_1",
                "role": "developer",
                "content": [{"type": "input_text", "text": "You are a coding agent."}],
            },
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "list the files"}],
            },
        ],
        "tools": [
            {
                "type": "function",
                "name": "exec_command",
                "description": "Runs a command",
                "strict": False,
                "parameters": parameters,
            },
            {
                "type": "namespace",
                "name": "multi_agent_v1",
                "description": "Sub-agents",
                "tools": [
                    {
                        "type": "function",
                        "name": "wait_agent",
                        "strict": False,
                        "parameters": {"type": "object", "properties": {}},
                    }
                ],
            },
            {"type": "web_search", "external_web_access": False},
        ],
        "tool_choice": "auto",
        "parallel_tool_calls": True,
        "reasoning": {"summary": "auto"},
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "01a2322c-597d",
        "client_metadata": {"turn_id": "t1"},
        "max_output_tokens": 16,
    }
    headers = {**auth(api_key), "session-id": "01a2322c-597d", "accept": "text/event-stream"}
    response = await served.post("/v1/responses", headers=headers, json=body)
    assert response.status == 200, await response.text()
    assert response.headers["x-infermesh-unsupported-tools"] == "web_search"
    events = [
        json.loads(line.removeprefix("data: "))
        for line in (await response.text()).split("\n")
        if line.startswith("data: ")
    ]
    for event in events:
        _EVENTS.validate_python(event)
    final = events[-1]["response"]
    assert events[-1]["type"] in ("response.completed", "response.incomplete")
    assert final["reasoning"] == {"effort": None, "summary": "auto"}
    assert {item["type"] for item in final["output"]} <= {"message", "function_call"}
    assert [t["name"] for t in final["tools"]] == ["exec_command", "multi_agent_v1"]


async def test_codex_017_hands_its_tools_over_as_an_input_item(served, api_key):
    """Codex CLI 0.17x sends no ``tools``: its tools come as an ``additional_tools`` input item
    (namespaces of function tools and a ``custom`` tool with a Lark grammar), with
    ``reasoning.context`` and ``text.verbosity``. The functions are offered as if in ``tools``
    (a required choice calls one of them), the custom tool is named as not offered, and the item
    is no chat turn."""
    wait = {
        "type": "object",
        "properties": {"ms": {"enum": [10, 20]}},  # short, so random weights finish the call
        "required": ["ms"],
        "additionalProperties": False,
    }
    body = {
        "model": MODEL,
        "store": False,
        "input": [
            {
                "type": "additional_tools",
                "id": "at_1",
                "role": "developer",
                "tools": [
                    {
                        "type": "namespace",
                        "name": "functions",
                        "description": "",
                        "tools": [
                            {
                                "type": "custom",
                                "name": "exec",
                                "description": "Runs JavaScript",
                                "format": {"type": "grammar", "syntax": "lark", "definition": "x"},
                            },
                            {
                                "type": "function",
                                "name": "wait",
                                "description": "Waits",
                                "strict": False,
                                "parameters": wait,
                            },
                        ],
                    }
                ],
            },
            {
                "type": "message",
                "role": "developer",
                "content": [{"type": "input_text", "text": "You are Codex."}],
            },
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
        ],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "reasoning": {"effort": "low", "context": "all_turns"},
        "text": {"verbosity": "low"},
        "include": ["reasoning.encrypted_content"],
        "max_output_tokens": 64,
    }
    response = await served.post("/v1/responses", headers=auth(api_key), json=body)
    assert response.status == 200, await response.text()
    assert response.headers["x-infermesh-unsupported-tools"] == "custom"
    answer = await response.json()
    (call,) = [item for item in answer["output"] if item["type"] == "function_call"]
    assert (call["namespace"], call["name"]) == ("functions", "wait")
    assert json.loads(call["arguments"])["ms"] in (10, 20)
    assert answer["reasoning"] == {"effort": "low", "summary": None}
    assert [t["name"] for t in answer["tools"]] == ["functions"]


async def test_a_bad_tool_in_an_input_item_is_named_by_its_path(served, api_key):
    body = {
        "model": MODEL,
        "input": [
            {"type": "message", "role": "user", "content": "hi"},
            {
                "type": "additional_tools",
                "tools": [{"type": "function", "name": "f", "parameters": {"type": "nope"}}],
            },
        ],
    }
    response = await served.post("/v1/responses", headers=auth(api_key), json=body)
    assert response.status == 400
    assert (await response.json())["error"]["param"].startswith("input.1.tools.0.parameters")
