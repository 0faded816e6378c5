"""Serving ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``: Anthropic's Messages API
over the same mesh, keys and limits, so Claude-style clients (Claude Code among them) work with the
gateway's keys (``x-api-key`` or Bearer). Errors use Anthropic's shape (see
``gateway.http.errors``).

Claude Code's requests come as they are: ``?beta=true`` and any ``anthropic-beta`` header are
ignored (the fields those betas add are served or refused by name), ``context_management`` edits
the prompt first (gateway.anthropic.context_editing), and count_tokens counts exactly what a
message with the same prompt is billed, from the worker's own rendering and tokenizer.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from typing import Any

from aiohttp import web

from gateway.accounts.limits import mesh_failed
from gateway.accounts.state import LIMITER
from gateway.accounts.usage import TokenUsage
from gateway.anthropic import messages_protocol as wire
from gateway.anthropic.context_editing import Counter, apply_edits
from gateway.api.generation import (
    Answer,
    Generation,
    Plan,
    admit,
    answer,
    refuse_unless_reasoning,
    served_model,
)
from gateway.api.tools import ToolCalls
from gateway.http import sse
from gateway.http.errors import UpstreamError
from gateway.http.state import REQUEST_ID
from gateway.http.validation import estimate_tokens, read_json
from gateway.mesh.state import MESH


async def create_message(request: web.Request) -> web.StreamResponse:
    body = wire.parse_messages_request(await read_json(request), wire.MessagesRequest)
    body.check_budget()
    if body.thinking is not None and body.thinking.type == "enabled":
        await refuse_unless_reasoning(
            request,
            body.model,
            "thinking.type",
            f"thinking.type: 'enabled' is not supported by model '{body.model}', which does not "
            "think",
        )
    body, applied = await apply_edits(body, _counter(request, body.model))
    edits = {"applied_edits": applied} if body.context_management is not None else None
    prompt = "".join(m.content for m in body.router_messages())
    plan = Plan(
        model=body.model,
        requests=[body.generate_request(request[REQUEST_ID])],
        prompt_estimates=[estimate_tokens(prompt)],
        prompt_of=[0],
        max_tokens=body.max_tokens,
        stream=body.stream,
    )

    return await answer(
        request,
        plan,
        Answer(
            events=lambda generation: _events(body, generation, edits),
            failed=lambda e: sse.named_event(e.anthropic_body()),
            collect=lambda generation: _collect(body, generation, edits),
        ),
    )


async def count_tokens(request: web.Request) -> web.Response:
    """The prompt's input tokens, as ``create_message`` would bill them: the key's model check
    and request limits apply, no tokens are charged."""
    body = wire.parse_messages_request(await read_json(request), wire.MessagesBody)
    model = served_model(request, body.model)
    admission = await admit(request, model, 0)
    served = True
    try:
        count = _counter(request, body.model)
        edited, _ = await apply_edits(body, count)
        answer: dict[str, Any] = {"input_tokens": await count(edited)}
        if body.context_management is not None:
            original = answer["input_tokens"] if edited is body else await count(body)
            answer["context_management"] = {"original_input_tokens": original}
    except Exception as e:
        served = not mesh_failed(e)
        raise
    finally:
        request.app[LIMITER].settle_soon(admission, TokenUsage(), served=served)
    return web.json_response(answer, headers=admission.headers)


def _counter(request: web.Request, model: str) -> Counter:
    """Counts a prompt's input tokens on a worker serving ``model`` (an alias resolved)."""

    async def count(body: wire.MessagesBody) -> int:
        prompt = body.prompt_request(request[REQUEST_ID])
        prompt.model = served_model(request, model)
        return await request.app[MESH].tokenize(prompt)

    return count


async def _collect(
    body: wire.MessagesRequest, generation: Generation, edits: dict[str, Any] | None
) -> dict[str, Any]:
    texts, stop, calls, thinking = [], None, ToolCalls(), body.thinking_blocks()
    async for _, chunk in generation.chunks():
        if thinking is not None:
            thinking.add(chunk.reasoning_text)
        texts.append(chunk.text)
        calls.add(chunk.tool_calls)
        stop = wire.STOP_REASONS.get(chunk.finish_reason, stop)
    return wire.message(
        wire.message_id(),
        body.model,
        wire.content("".join(texts), calls.message_field(), thinking),
        _stop_reason(stop),
        generation.usage(),
        edits,
    )


def _stop_reason(stop: wire.StopReason | None) -> wire.StopReason:
    if stop is None:
        raise UpstreamError("The router's stream ended without a finish reason")
    return stop


async def _events(
    body: wire.MessagesRequest, generation: Generation, edits: dict[str, Any] | None
) -> AsyncIterator[bytes]:
    """The stream's events; those of one worker chunk go out as one write. ``message_start``
    waits for the first chunk, which brings the prompt's token count."""
    stop, blocks, started = None, wire.StreamBlocks(body.thinking_blocks()), False
    async for _, chunk in generation.chunks():
        events = []
        if not started:
            events = wire.stream_start(wire.message_id(), body.model, generation.usage())
            started = True
        events += blocks.thinking(chunk.reasoning_text)
        events += blocks.text(chunk.text)
        for piece in chunk.tool_calls:
            events += blocks.tool_call(piece.index, piece.id, piece.name, piece.arguments)
        if events:
            yield _joined(events)
        stop = wire.STOP_REASONS.get(chunk.finish_reason, stop)
    yield _joined([*blocks.stop(), *wire.stream_end(_stop_reason(stop), generation.usage(), edits)])


def _joined(events: Iterable[dict[str, Any]]) -> bytes:
    return b"".join(sse.named_event(event) for event in events)
