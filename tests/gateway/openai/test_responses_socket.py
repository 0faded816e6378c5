"""The Responses API over WebSocket (``client.responses.connect()`` of the official openai SDK)
through the real gateway, router, a simulated worker and Redis.

The first six tests are the OpenResponses compliance suite's WebSocket cases, written from their
documented behaviour (the public suite's WebSocket cases are not available offline here): a
response on the socket, sequential responses on one connection, a ``store: false`` continuation
from the connection's own state, ``previous_response_not_found``, the eviction of a response a
continuation failed from, and ``generate: false``. Every event is checked against the Open
Responses schemas, and parsed by the SDK."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import openai
import pytest
import websockets

from gateway.accounts.keys import create_key
from tests.helpers import MODEL
from tests.helpers.gateway import auth, make_config, sdk, start_gateway
from tests.helpers.inprocess import running_router, running_worker, sim_engine
from tests.helpers.openresponses import validate_event, validate_response

_ASK = {"model": MODEL, "max_output_tokens": 4}
_ENDS = ("response.completed", "response.incomplete", "response.failed", "error")
# The simulated worker writes up to max_output_tokens: its responses end incomplete.
_DONE = ("response.completed", "response.incomplete")


async def _response(connection, **fields: Any) -> list[dict[str, Any]]:
    """Sends one response.create; the events up to its last, each checked against the Open
    Responses schemas and parsed by the SDK."""
    await connection.response.create(**{**_ASK, **fields})
    events = []
    while True:
        raw = await connection.recv_bytes()
        event = json.loads(raw)
        assert connection.parse_event(raw).type == event["type"]
        if event["type"] != "error":
            validate_event(event)
        events.append(event)
        if event["type"] in _ENDS:
            return events


def _last(events: list[dict[str, Any]]) -> dict[str, Any]:
    assert events[-1]["type"] in _DONE, events[-1]
    response = events[-1]["response"]
    validate_response(response)
    return response


async def test_ws_basic_response(sim_served, api_key):
    async with sdk(sim_served, api_key) as client, client.responses.connect() as connection:
        events = await _response(connection, input="Say hello in exactly 3 words.")
    types = [e["type"] for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert "response.output_text.delta" in types
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    response = _last(events)
    assert response["output"][0]["type"] == "message" and response["usage"]["output_tokens"] >= 1


async def test_ws_sequential_responses_on_one_connection(sim_served, api_key):
    async with sdk(sim_served, api_key) as client, client.responses.connect() as connection:
        first = _last(await _response(connection, input="one"))
        second = _last(await _response(connection, input="two"))
        stored = await client.responses.retrieve(second["id"])
    assert first["id"] != second["id"] and stored.status == second["status"]


async def test_ws_store_false_continues_from_the_connections_own_state(sim_served, api_key):
    async with sdk(sim_served, api_key) as client:
        async with client.responses.connect() as connection:
            first = _last(await _response(connection, input="remember: blue", store=False))
            alone = _last(await _response(connection, input="what colour?", store=False))
            follow = _last(
                await _response(
                    connection,
                    input="what colour?",
                    store=False,
                    previous_response_id=alone["id"],
                )
            )
        async with client.responses.connect() as elsewhere:
            (missing,) = await _response(
                elsewhere, input="again", previous_response_id=follow["id"]
            )
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(first["id"])
    assert follow["previous_response_id"] == alone["id"]
    assert follow["usage"]["input_tokens"] > alone["usage"]["input_tokens"]
    assert missing["error"]["code"] == "previous_response_not_found", "state is the connection's"


async def test_ws_unknown_previous_response_is_not_found_and_the_socket_goes_on(
    sim_served, api_key
):
    async with sdk(sim_served, api_key) as client, client.responses.connect() as connection:
        (error,) = await _response(connection, input="hi", previous_response_id="resp_nope")
        after = _last(await _response(connection, input="still here"))
    assert error["status"] == 404
    assert error["error"]["code"] == "previous_response_not_found"
    assert error["error"]["param"] == "previous_response_id"
    assert after["status"] in ("completed", "incomplete")


async def test_ws_a_failed_continuation_evicts_the_response_it_continued(sim_served, api_key):
    async with sdk(sim_served, api_key) as client, client.responses.connect() as connection:
        first = _last(await _response(connection, input="one", store=False))
        (failed,) = await _response(
            connection, input="two", store=False, previous_response_id=first["id"], temperature=9
        )
        (evicted,) = await _response(
            connection, input="two", store=False, previous_response_id=first["id"]
        )
    assert failed["status"] == 400 and failed["error"]["param"] == "temperature"
    assert evicted["error"]["code"] == "previous_response_not_found"


async def test_ws_generate_false_warms_state_without_output(sim_served, api_key):
    context = "The project's notes, to be asked about next. " * 20
    async with sdk(sim_served, api_key) as client, client.responses.connect() as connection:
        warmed = await _response(connection, input=context, store=False, generate=False)
        response = _last(
            await _response(
                connection,
                input="go",
                store=False,
                previous_response_id=warmed[-1]["response"]["id"],
            )
        )
        bare = _last(await _response(connection, input="go", store=False))
    assert [e["type"] for e in warmed] == ["response.created", "response.completed"]
    assert warmed[-1]["response"]["status"] == "completed"
    assert warmed[-1]["response"]["output"] == []
    assert warmed[-1]["response"]["usage"]["output_tokens"] == 0
    assert response["usage"]["input_tokens"] > bare["usage"]["input_tokens"] + 20


async def test_a_second_response_create_while_one_runs_is_refused_and_lanes_run_apart(
    sim_served, api_key
):
    async with sdk(sim_served, api_key) as client, client.responses.connect() as connection:
        await connection.response.create(**_ASK, input="first")
        await connection.response.create(**_ASK, input="second")
        await connection.response.create(**_ASK, input="third", stream_id="lane-b")
        by_lane: dict[str | None, list[dict[str, Any]]] = {None: [], "lane-b": []}
        ends = 0
        while ends < 3:  # the refusal, and each lane's response
            event = json.loads(await connection.recv_bytes())
            by_lane[event.get("stream_id")].append(event)
            ends += event["type"] in _ENDS
    (refused,) = [e for e in by_lane[None] if e["type"] == "error"]
    assert refused["error"]["code"] == "response_already_in_progress"
    assert by_lane[None][-1]["type"] in _DONE and by_lane["lane-b"][-1]["type"] in _DONE
    assert {e["type"] for e in by_lane[None]} >= {"response.created", "error"}


async def test_bad_messages_get_error_events_and_the_socket_stays_open(sim_served, api_key):
    async with sim_served.ws_connect("/v1/responses", headers=auth(api_key)) as socket:
        replies = []
        for message in ("not json", '{"type": "response.cancel"}', '{"type": "response.create"}'):
            await socket.send_str(message)
            replies.append(await socket.receive_json(timeout=5))
        await socket.send_str(json.dumps({"type": "response.create", **_ASK, "input": "ok"}))
        while (event := await socket.receive_json(timeout=5))["type"] not in _ENDS:
            pass
    assert [r["type"] for r in replies] == ["error"] * 3
    assert [r["status"] for r in replies] == [400] * 3
    assert "not valid JSON" in replies[0]["error"]["message"]
    assert replies[1]["error"]["param"] == "type"
    assert replies[2]["error"]["param"] == "model"
    assert event["type"] in _DONE


async def test_a_handshake_without_a_key_is_refused(sim_served):
    url = str(sim_served.make_url("/v1/responses")).replace("http", "ws", 1)
    with pytest.raises(websockets.InvalidStatus) as refused:
        async with websockets.connect(url):
            pass
    assert refused.value.response.status_code == 401
    assert json.loads(refused.value.response.body)["error"]["code"] == "invalid_api_key"
    async with (
        aiohttp.ClientSession() as session,
        session.get(url.replace("ws", "http", 1)) as plain,
    ):
        assert plain.status == 401


async def test_closing_the_socket_cancels_its_response_and_frees_its_slot(
    redis_server, redis_client
):
    """One concurrent request for the key: a long response on a socket closed midway frees it."""
    key = await create_key(redis_client, "one-at-a-time", max_concurrent=1)
    async with (
        running_router(redis_url=redis_server.url) as router,
        running_worker(sim_engine(max_parallel=4), router),
    ):
        gateway = await start_gateway(make_config(redis_server.url, router.address))
        try:
            async with sdk(gateway, key) as client:
                async with client.responses.connect() as connection:
                    await connection.response.create(
                        model=MODEL, input="long", max_output_tokens=4000
                    )
                    while json.loads(await connection.recv_bytes())["type"] != (
                        "response.output_text.delta"
                    ):
                        pass
                started = asyncio.get_running_loop().time()
                answer = None
                while answer is None:
                    try:
                        answer = await client.responses.create(**_ASK, input="next")
                    except openai.RateLimitError:
                        await asyncio.sleep(0.05)
                waited_s = asyncio.get_running_loop().time() - started
        finally:
            await gateway.close()
    assert answer.status in ("completed", "incomplete")
    assert waited_s < 2.0, f"the closed socket's response held the key's slot for {waited_s:.1f} s"
