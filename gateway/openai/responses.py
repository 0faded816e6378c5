"""Serving OpenAI's Responses API: ``POST /v1/responses`` on the request path chat completions
takes (``gateway.api.generation``), and the stored responses (``GET`` and ``DELETE
/v1/responses/{id}``, ``GET /v1/responses/{id}/input_items``).

A request continuing a stored response (``previous_response_id``) is preceded by that response's
whole conversation, and stays in its session (``gateway.mesh.affinity``): the session the chain's
first request named, else the first response's own id. Tools the mesh cannot offer are named in the
``x-infermesh-unsupported-tools`` header and the response's metadata.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Mapping
from typing import Annotated, Any, Literal

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

from gateway.accounts.state import API_KEY, REDIS
from gateway.accounts.usage import TokenUsage
from gateway.api.generation import Generation, Plan, ResponseFormat, respond
from gateway.config import CONFIG
from gateway.http import json_body, sse
from gateway.http.errors import GatewayError, InvalidRequestError, ResponseNotFoundError
from gateway.http.state import REQUEST_ID
from gateway.http.validation import estimate_tokens, parse_body, read_json
from gateway.mesh.affinity import session_name
from gateway.openai.chat_protocol import now_s
from gateway.openai.responses_output import (
    UNSUPPORTED_TOOLS,
    Event,
    OutputBuilder,
    ResponseShell,
    Status,
    new_id,
)
from gateway.openai.responses_protocol import (
    ResponsesRequest,
    items_of,
    parse_responses_request,
    router_messages,
    stored_items,
)
from gateway.openai.responses_store import ResponseStore, StoredResponse
from infermesh.pb import common_pb2


class InputItemsQuery(BaseModel):
    """The query of ``GET /v1/responses/{id}/input_items``: strings, so not strict."""

    model_config = ConfigDict(extra="ignore")
    limit: Annotated[int, Field(ge=1, le=100)] = 20
    order: Literal["asc", "desc"] = "desc"
    after: str | None = None  # an item id: the page starts after it


class RetrieveQuery(BaseModel):
    """The query of ``GET /v1/responses/{id}``."""

    model_config = ConfigDict(extra="ignore")
    # OpenAI replays a background response's events; this gateway has none to replay
    stream: Literal[False] = False


async def create_response(request: web.Request) -> web.StreamResponse:
    body = parse_responses_request(await read_json(request), request.headers)
    turn = new_turn(request, body, await load_previous(request, body))
    reply = turn.reply
    return await respond(
        request,
        turn.plan,
        ResponseFormat(events=reply.events, failed=reply.failed, collect=reply.collect),
        turn.headers,
    )


@dataclasses.dataclass(frozen=True)
class Turn:
    """One response to make: what it asks of the router, how it is written, and the headers of
    its answer."""

    plan: Plan
    reply: Reply
    headers: dict[str, str] | None


def new_turn(request: web.Request, body: ResponsesRequest, previous: StoredResponse | None) -> Turn:
    """The response ``body`` asks for, after ``previous`` (the response it continues)."""
    context = previous.conversation() if previous else []
    items = body.items()
    messages = router_messages(body.instructions, items_of(context) + items)
    shell = ResponseShell(body, new_id("resp"), now_s())
    session = _session(request, body, previous, shell.id)
    plan = Plan(
        model=body.model,
        requests=[body.generate_request(request[REQUEST_ID], messages=messages)],
        prompt_estimates=[estimate_tokens("".join(m.content for m in messages))],
        prompt_of=[0],
        max_tokens=body.max_output_tokens,
        stream=body.stream,
        session=session or None,
    )
    record = StoredResponse(
        response={}, input=stored_items(items, new_id), context=context, session=session
    )
    store = _store(request) if body.store else None
    unoffered = body.tool_set.unoffered
    headers = {UNSUPPORTED_TOOLS: ",".join(unoffered)} if unoffered else None
    return Turn(plan, Reply(body, shell, store, request[API_KEY].id, record), headers)


def _session(
    request: web.Request, body: ResponsesRequest, previous: StoredResponse | None, own_id: str
) -> str:
    """The session the request belongs to: the one it names, its chain's, else (stored, so
    that its continuations join it) its own id; "" for none."""
    hint = body.prompt_cache_key or (previous.session if previous else None)
    return session_name(request.headers, hint) or (own_id if body.store else "")


async def load_previous(
    request: web.Request,
    body: ResponsesRequest,
    local: Mapping[str, StoredResponse] | None = None,
) -> StoredResponse | None:
    """The response ``body`` continues: from ``local`` (a connection's own), else the store;
    a 404 ``previous_response_not_found`` when neither has it."""
    if body.previous_response_id is None:
        return None
    previous = (local or {}).get(body.previous_response_id)
    if previous is None:
        previous = await _store(request).load(request[API_KEY].id, body.previous_response_id)
    if previous is None:
        raise ResponseNotFoundError(
            f"Previous response with id '{body.previous_response_id}' not found.",
            param="previous_response_id",
            code="previous_response_not_found",
        )
    return previous


class Reply:
    """One response being written: its output from the generation, as events or whole, and
    stored (when asked) before the client learns it is complete; ``record`` is what was
    stored (or would have been), once complete."""

    def __init__(
        self,
        body: ResponsesRequest,
        shell: ResponseShell,
        store: ResponseStore | None,
        kid: str,
        record: StoredResponse,
    ) -> None:
        self._shell = shell
        self._store = store  # None: not stored
        self._kid = kid
        self.record = record  # what is stored; its response once complete
        summary = body.reasoning is not None and body.reasoning.summary not in (None, "none")
        self._output = OutputBuilder(body.tool_set, body.logprobs, summary)
        self._sequence = 0
        self._incomplete = False  # cut by max_output_tokens

    @property
    def id(self) -> str:
        return self._shell.id

    async def collect(self, generation: Generation) -> dict[str, Any]:
        async for _ in self._steps(generation):
            pass
        return await self._finished(generation.usage())

    async def events(self, generation: Generation) -> AsyncIterator[bytes]:
        """The SSE stream of ``event_lists``: the events of one worker chunk in one write."""
        async for events in self.event_lists(generation):
            yield b"".join(sse.named_event(event) for event in events)

    async def event_lists(self, generation: Generation) -> AsyncIterator[list[Event]]:
        """The stream's events, numbered: created, in progress, the output's events (those of
        one worker chunk together), then completed or incomplete."""
        started = self._shell.object("in_progress", [])
        yield self._numbered(
            [
                {"type": "response.created", "response": started},
                {"type": "response.in_progress", "response": started},
            ]
        )
        async for events in self._steps(generation):
            if events:
                yield self._numbered(events)
        response = await self._finished(generation.usage())
        yield self._numbered([{"type": f"response.{response['status']}", "response": response}])

    async def warmed(self) -> list[Event]:
        """The events of a response made without generating (``generate: false``): created,
        then completed with no output; its input is kept to be continued from."""
        started = self._shell.object("in_progress", [])
        response = await self._finished(TokenUsage())
        return self._numbered(
            [
                {"type": "response.created", "response": started},
                {"type": "response.completed", "response": response},
            ]
        )

    def failed(self, error: GatewayError) -> bytes:
        """The SSE stream's last event when it fails midway."""
        return sse.named_event(self.failed_event(error))

    def failed_event(self, error: GatewayError) -> Event:
        response = self._shell.object(
            "failed", self._output.output, error=f"The response failed: {error.message}"
        )
        return self._numbered([{"type": "response.failed", "response": response}])[0]

    async def _steps(self, generation: Generation) -> AsyncIterator[list[Event]]:
        async for _, chunk in generation.by_choice():
            yield self._output.add(chunk)
            if chunk.finish_reason == common_pb2.FINISH_REASON_LENGTH:
                self._incomplete = True
        yield self._output.finish(self._incomplete)

    async def _finished(self, tokens: TokenUsage) -> dict[str, Any]:
        status: Status = "incomplete" if self._incomplete else "completed"
        response = self._shell.object(status, self._output.output, tokens)
        self.record = dataclasses.replace(self.record, response=response)
        if self._store is not None:
            await self._store.save(self._kid, self.record)
        return response

    def _numbered(self, events: list[Event]) -> list[Event]:
        out = []
        for event in events:
            out.append({**event, "sequence_number": self._sequence})
            self._sequence += 1
        return out


async def retrieve_response(request: web.Request) -> web.Response:
    parse_body(RetrieveQuery, dict(request.query))
    return json_body.json_response((await _stored(request)).response)


async def delete_response(request: web.Request) -> web.Response:
    response_id = request.match_info["response_id"]
    if not await _store(request).delete(request[API_KEY].id, response_id):
        raise _not_found(response_id)
    return web.json_response({"id": response_id, "object": "response", "deleted": True})


async def list_input_items(request: web.Request) -> web.Response:
    query = parse_body(InputItemsQuery, dict(request.query))
    items = (await _stored(request)).input
    if query.order == "desc":
        items = items[::-1]
    start = 0
    if query.after is not None:
        ids = [item["id"] for item in items]
        if query.after not in ids:
            raise InvalidRequestError(
                f"Invalid value for 'after': no input item with id '{query.after}'", param="after"
            )
        start = ids.index(query.after) + 1
    page = items[start : start + query.limit]
    return json_body.json_response(
        {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": start + query.limit < len(items),
        }
    )


async def _stored(request: web.Request) -> StoredResponse:
    response_id = request.match_info["response_id"]
    stored = await _store(request).load(request[API_KEY].id, response_id)
    if stored is None:
        raise _not_found(response_id)
    return stored


def _not_found(response_id: str) -> ResponseNotFoundError:
    return ResponseNotFoundError(f"Response with id '{response_id}' not found.")


def _store(request: web.Request) -> ResponseStore:
    return ResponseStore(
        request.app[REDIS],
        request.app[CONFIG].responses.ttl_s,
        request.config_dict[CONFIG].redis.retry_after_s,
    )
