"""Serving ``POST /v1/completions``: raw prompts, no chat template.

Each prompt of the batch gets ``n`` router calls; ``echo`` puts the prompt in
front of its choices' text.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from gateway.api.generation import Answer, Generation, Plan, answer, finish_reason
from gateway.http import sse
from gateway.http.state import REQUEST_ID
from gateway.http.validation import estimate_tokens, read_json
from gateway.openai.chat_protocol import completion_id, now_s, openai_usage, usage_chunk
from gateway.openai.completions_protocol import (
    CompletionRequest,
    completion_choice,
    completion_logprobs,
    merge_logprobs,
    parse_completion_request,
    text_completion,
)
from infermesh.names import FinishReason


async def create_completion(request: web.Request) -> web.StreamResponse:
    body = parse_completion_request(await read_json(request), request.headers)
    prompts = body.prompts()
    choices = [(p, j) for p in range(len(prompts)) for j in range(body.n)]
    plan = Plan(
        model=body.model,
        requests=[
            body.generate_request(request[REQUEST_ID], i, prompt=prompts[p])
            for i, (p, _) in enumerate(choices)
        ],
        prompt_estimates=[estimate_tokens(p) for p in prompts],
        prompt_of=[p for p, _ in choices],
        max_tokens=body.token_limit(),
        stream=body.stream,
        session=body.prompt_cache_key,
    )
    echoes = [prompts[p] if body.echo else "" for p, _ in choices]

    return await answer(
        request,
        plan,
        Answer(
            events=lambda generation: _events(body, generation, echoes),
            failed=lambda e: sse.openai_event(e.body()),
            collect=lambda generation: _collect(body, generation, echoes),
            end=sse.OPENAI_DONE,
        ),
    )


async def _collect(
    body: CompletionRequest, generation: Generation, echoes: list[str]
) -> dict[str, Any]:
    texts = [[echo] for echo in echoes]
    offsets = [len(echo) for echo in echoes]
    logprobs = [completion_logprobs((), 0) for _ in echoes]
    finishes: list[FinishReason | None] = [None] * generation.choices
    async for i, chunk in generation.chunks():
        merge_logprobs(logprobs[i], completion_logprobs(chunk.logprobs, offsets[i]))
        texts[i].append(chunk.text)
        offsets[i] += len(chunk.text)
        finishes[i] = finish_reason(chunk) or finishes[i]
    choices = [
        completion_choice(
            i,
            "".join(texts[i]),
            finishes[i],
            logprobs[i] if body.logprobs is not None and logprobs[i]["tokens"] else None,
        )
        for i in range(generation.choices)
    ]
    return text_completion(
        completion_id("cmpl"), now_s(), body.model, choices, openai_usage(generation.usage())
    )


async def _events(
    body: CompletionRequest, generation: Generation, echoes: list[str]
) -> AsyncIterator[bytes]:
    cid, created, with_usage = completion_id("cmpl"), now_s(), body.include_usage
    offsets = [len(echo) for echo in echoes]

    def chunk(choice: dict[str, Any]) -> bytes:
        data = text_completion(cid, created, body.model, [choice], None)
        if with_usage:
            data["usage"] = None
        return sse.openai_event(data)

    for i, echo in enumerate(echoes):
        if echo:
            yield chunk(completion_choice(i, echo, None, None))
    async for i, item in generation.chunks():
        logprobs = (
            completion_logprobs(item.logprobs, offsets[i])
            if body.logprobs is not None and item.logprobs
            else None
        )
        offsets[i] += len(item.text)
        finish = finish_reason(item)
        if item.text or logprobs or finish:
            yield chunk(completion_choice(i, item.text, finish, logprobs))
    if with_usage:
        yield sse.openai_event(
            usage_chunk(
                cid, created, body.model, openai_usage(generation.usage()), kind="text_completion"
            )
        )
