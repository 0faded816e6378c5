"""Serving ``POST /v1/messages``: Anthropic's Messages API over the same mesh,
keys and limits, so Claude-style clients work with the gateway's keys
(``x-api-key`` or Bearer). Errors use Anthropic's shape (see ``gateway.errors``)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from typing import Any

from aiohttp import web

from gateway import anthropic_protocol as wire
from gateway import json_body, sse
from gateway.errors import UpstreamError
from gateway.generation import Generation, Plan, admitted_generation
from gateway.middleware import REQUEST_ID
from gateway.tools import ToolCalls
from gateway.validation import estimate_tokens, read_json


async def create_message(request: web.Request) -> web.StreamResponse:
    body = wire.parse_messages_request(await read_json(request))
    prompt = "".join(m.content for m in body.router_messages())
    plan = Plan(
        model=body.model,
        requests=[body.generate_request(request[REQUEST_ID])],
        prompt_estimates=[estimate_tokens(prompt)],
        prompt_of=[0],
        max_tokens=body.max_tokens,
        stream=body.stream,
    )

    async with admitted_generation(request, plan) as (generation, headers):
        if body.stream:
            return await sse.stream(
                request,
                headers,
                _events(body, generation),
                lambda e: sse.named_event(e.anthropic_body()),
            )
        return await _collect(body, generation, headers)


async def _collect(
    body: wire.MessagesRequest, generation: Generation, headers: dict[str, str]
) -> web.Response:
    texts, stop, calls = [], None, ToolCalls()
    async for _, chunk in generation.chunks():
        texts.append(chunk.text)
        calls.add(chunk.tool_calls)
        stop = wire.STOP_REASONS.get(chunk.finish_reason, stop)
    return json_body.json_response(
        wire.message(
            wire.message_id(),
            body.model,
            "".join(texts),
            _stop_reason(stop),
            generation.usage(),
            calls.message_field(),
        ),
        headers=headers,
    )


def _stop_reason(stop: wire.StopReason | None) -> wire.StopReason:
    if stop is None:
        raise UpstreamError("The router's stream ended without a finish reason")
    return stop


async def _events(body: wire.MessagesRequest, generation: Generation) -> AsyncIterator[bytes]:
    """The stream's events; those of one worker chunk go out as one write."""
    yield _joined(wire.stream_start(wire.message_id(), body.model))
    stop, block = None, 0  # block: the content block open now (0: the text)
    async for _, chunk in generation.chunks():
        events = [wire.text_delta(chunk.text)] if chunk.text else []
        for piece in chunk.tool_calls:
            if piece.id:
                block = piece.index + 1
                events.extend(wire.tool_use_start(block, piece.id, piece.name))
            if piece.arguments:
                events.append(wire.input_json_delta(block, piece.arguments))
        if events:
            yield _joined(events)
        stop = wire.STOP_REASONS.get(chunk.finish_reason, stop)
    yield _joined(wire.stream_end(_stop_reason(stop), generation.usage(), block))


def _joined(events: Iterable[dict[str, Any]]) -> bytes:
    return b"".join(sse.named_event(event) for event in events)
