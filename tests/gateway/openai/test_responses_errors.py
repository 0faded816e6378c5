"""Bad Responses API requests: 400s naming the field, 404s in OpenAI's shape and words, and
a response store that fails closed. No router is needed: all of them are answered before one."""

from __future__ import annotations

from typing import Any

import openai
import pytest
import redis.asyncio as aioredis

from gateway.http.errors import ServiceUnavailableError
from gateway.openai.responses_store import ResponseStore
from infermesh.ports import free_port
from tests.helpers import MODEL
from tests.helpers.gateway import auth, sdk
from tests.helpers.tools import WEATHER

_FUNCTION = {"type": "function", "name": "get_weather", "parameters": WEATHER}


def _namespace(parameters: dict[str, Any]) -> dict[str, Any]:
    function = {"type": "function", "name": "f", "parameters": parameters}
    return {"type": "namespace", "name": "ns", "description": "", "tools": [function]}


@pytest.mark.parametrize(
    "change, param",
    [
        ({"input": [{"type": "computer_call_output", "call_id": "c"}]}, "input.0.type"),
        ({"input": [{"role": "critic", "content": "x"}]}, "input.0.role"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input.0.call_id"),
        (
            {"input": [{"type": "function_call_output", "call_id": "c", "output": 3}]},
            "input.0.output",
        ),
        ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}, "input"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input.0.content.0.type",
        ),
        ({"input": []}, "input"),
        ({"input": None}, "input"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"prompt": {"id": "pmpt_1"}}, "prompt"),
        ({"max_tool_calls": 2}, "max_tool_calls"),
        ({"background": True}, "background"),
        ({"include": ["output.everything"]}, "include.0"),
        ({"tools": [{"type": "teleport"}]}, "tools.0.type"),
        ({"tools": [{**_FUNCTION, "parameters": {"type": "nope"}}]}, "tools.0.parameters"),
        ({"tools": [_namespace({"type": "nope"})]}, "tools.0.tools.0.parameters"),
        ({"tools": [_FUNCTION, _FUNCTION]}, "tools"),
        ({"tools": [_FUNCTION], "tool_choice": {"type": "function", "name": "g"}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": 3}}}},
            "text.format.schema",
        ),
        ({"text": {"format": {"type": "grammar"}}}, "text.format.type"),
        ({"truncation": "sometimes"}, "truncation"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"metadata": {"k" * 65: "v"}}, "metadata"),
    ],
)
async def test_bad_requests_are_400_naming_the_field(gateway, api_key, change, param):
    body = {"model": MODEL, "input": "hi", **change}
    response = await gateway.post("/v1/responses", headers=auth(api_key), json=body)
    assert response.status == 400, await response.text()
    error = (await response.json())["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"


async def test_the_sdk_raises_the_errors_it_documents(gateway, api_key):
    async with sdk(gateway, api_key) as client:
        with pytest.raises(openai.BadRequestError) as orphan:
            await client.responses.create(
                model=MODEL,
                input=[{"type": "function_call_output", "call_id": "call_9", "output": "x"}],
            )
        with pytest.raises(openai.NotFoundError) as previous:
            await client.responses.create(model=MODEL, input="hi", previous_response_id="resp_9")
        with pytest.raises(openai.NotFoundError) as retrieved:
            await client.responses.retrieve("resp_9")
        with pytest.raises(openai.NotFoundError):
            await client.responses.delete("resp_9")
        with pytest.raises(openai.NotFoundError):
            await client.responses.input_items.list("resp_9")
    assert orphan.value.body["message"] == (
        "No tool call found for function call output with call_id call_9."
    )
    assert previous.value.body == {
        "message": "Previous response with id 'resp_9' not found.",
        "type": "invalid_request_error",
        "param": "previous_response_id",
        "code": "previous_response_not_found",
    }
    assert retrieved.value.body["message"] == "Response with id 'resp_9' not found."


@pytest.mark.parametrize(
    "path, param",
    [
        ("resp_1/input_items?limit=0", "limit"),
        ("resp_1/input_items?order=sideways", "order"),
        ("resp_1?stream=true", "stream"),
    ],
)
async def test_bad_queries_are_400(gateway, api_key, path, param):
    response = await gateway.get(f"/v1/responses/{path}", headers=auth(api_key))
    assert response.status == 400
    assert (await response.json())["error"]["param"] == param


async def test_an_unreachable_store_is_503_not_a_missing_response():
    client = aioredis.Redis(port=free_port(), socket_connect_timeout=1)
    store = ResponseStore(client, ttl_s=60, retry_after_s=2)
    try:
        with pytest.raises(ServiceUnavailableError) as failed:
            await store.load("kid", "resp_1")
    finally:
        await client.aclose()
    assert failed.value.status == 503 and failed.value.retry_after_s == 2
    assert failed.value.code == "response_store_unavailable"
