"""Serving ``POST /v1/chat/completions``: validate, generate, answer in OpenAI's format.

``n`` choices are ``n`` router calls (choice ``i`` seeded ``seed + i``); streamed,
their chunks interleave as they arrive, each tagged with its choice index.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from gateway.api.generation import (
    Answer,
    Generation,
    Plan,
    answer,
    finish_reason,
    refuse_unless_reasoning,
)
from gateway.api.tools import ToolCalls, chunk_deltas
from gateway.http import sse
from gateway.http.state import REQUEST_ID
from gateway.http.validation import estimate_tokens, read_json
from gateway.openai.chat_protocol import (
    ChatCompletionRequest,
    chat_choice,
    chat_chunk,
    chat_completion,
    completion_id,
    now_s,
    openai_usage,
    parse_chat_request,
    token_logprobs,
    usage_chunk,
)
from infermesh.names import FinishReason


async def create_chat_completion(request: web.Request) -> web.StreamResponse:
    body = parse_chat_request(await read_json(request), request.headers)
    if body.thinking and body.reasoning_effort not in (None, "none"):
        await refuse_unless_reasoning(
            request,
            body.model,
            "reasoning_effort",
            f"Unsupported parameter: 'reasoning_effort' is not supported with model "
            f"'{body.model}', which does not reason.",
        )
    messages = body.router_messages()
    plan = Plan(
        model=body.model,
        requests=[
            body.generate_request(request[REQUEST_ID], i, messages=messages) for i in range(body.n)
        ],
        prompt_estimates=[estimate_tokens("".join(m.content for m in messages))],
        prompt_of=[0] * body.n,
        max_tokens=body.token_limit(),
        stream=body.stream,
        session=body.prompt_cache_key,
    )

    return await answer(
        request,
        plan,
        Answer(
            events=lambda generation: _events(body, generation),
            failed=lambda e: sse.openai_event(e.body()),
            collect=lambda generation: _collect(body, generation),
            end=sse.OPENAI_DONE,
        ),
    )


async def _collect(body: ChatCompletionRequest, generation: Generation) -> dict[str, Any]:
    texts: list[list[str]] = [[] for _ in range(generation.choices)]
    reasoning: list[list[str]] = [[] for _ in range(generation.choices)]
    logprobs: list[list[dict[str, Any]]] = [[] for _ in range(generation.choices)]
    finishes: list[FinishReason | None] = [None] * generation.choices
    calls = [ToolCalls() for _ in range(generation.choices)]
    async for i, chunk in generation.chunks():
        texts[i].append(chunk.text)
        reasoning[i].append(chunk.reasoning_text)
        logprobs[i].extend(token_logprobs(chunk.logprobs))
        calls[i].add(chunk.tool_calls)
        finishes[i] = finish_reason(chunk) or finishes[i]
    choices = [
        chat_choice(
            i,
            "".join(texts[i]),
            finishes[i],  # type: ignore[arg-type]
            logprobs[i] if body.logprobs and logprobs[i] else None,
            calls[i].message_field(),
            "".join(reasoning[i]),
        )
        for i in range(generation.choices)
    ]
    return chat_completion(
        completion_id(), now_s(), body.model, choices, openai_usage(generation.usage())
    )


async def _events(body: ChatCompletionRequest, generation: Generation) -> AsyncIterator[bytes]:
    """The stream's chunks: role, reasoning (``reasoning_content``, DeepSeek's API), text and
    tool-call deltas, finish reason per choice, then usage if asked for. The events of one worker
    chunk go out as one write."""
    cid, created, with_usage = completion_id(), now_s(), body.include_usage

    def chunk(
        i: int,
        delta: dict[str, Any],
        finish: FinishReason | None = None,
        logprobs: list[dict[str, Any]] | None = None,
    ) -> bytes:
        return sse.openai_event(
            chat_chunk(
                cid, created, body.model, i, delta, finish, logprobs, with_usage_field=with_usage
            )
        )

    yield b"".join(
        chunk(i, {"role": "assistant", "content": ""}) for i in range(generation.choices)
    )
    async for i, item in generation.chunks():
        events: list[bytes] = []
        if item.reasoning_text:
            events.append(chunk(i, {"reasoning_content": item.reasoning_text}))
        if item.text or item.logprobs:
            logprobs = token_logprobs(item.logprobs) if body.logprobs and item.logprobs else None
            events.append(chunk(i, {"content": item.text}, logprobs=logprobs))
        if item.tool_calls:
            events.append(chunk(i, {"tool_calls": chunk_deltas(item.tool_calls)}))
        finish = finish_reason(item)
        if finish is not None:
            events.append(chunk(i, {}, finish))
        if events:
            yield b"".join(events)
    if with_usage:
        yield sse.openai_event(
            usage_chunk(cid, created, body.model, openai_usage(generation.usage()))
        )
