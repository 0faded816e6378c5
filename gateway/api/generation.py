"""One request's generation, for every endpoint: admission against the key's
limits, the mesh calls of its choices, and settlement however it ends.

Each choice (``n``, or one per prompt of a batched legacy completion) is one
router call. Every stream is read up to its first chunk before anything is
answered, so a failure before the first token (unknown model, no worker, router
down) is a plain HTTP error. Tokens are counted as they pass, so a stream the
client abandoned is still settled with what it consumed.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any

from aiohttp import web

from gateway.accounts.limits import Admission, mesh_failed
from gateway.accounts.state import API_KEY, FIRST_TOKEN_S, LIMITER, USAGE
from gateway.accounts.usage import TokenUsage
from gateway.api.wire import GPU_HEADER, PRECISION_HEADER
from gateway.config import CONFIG
from gateway.http import json_body, sse
from gateway.http.errors import (
    GatewayError,
    InvalidRequestError,
    PermissionDeniedError,
    UpstreamError,
)
from gateway.http.state import MODEL, REQUEST_ID
from gateway.mesh.affinity import affinity_key
from gateway.mesh.client import MeshClient
from gateway.mesh.state import MESH, PROMPT_TOKENS, REASONING_FORMATS
from infermesh.names import FINISH_REASON_NAMES, PRECISION_NAMES, FinishReason
from infermesh.pb import common_pb2
from telemetry import genai, metrics

Chunk = common_pb2.GenerateResponse


@dataclasses.dataclass(frozen=True)
class Plan:
    """What one HTTP request asks of the router: one ``GenerateRequest`` per choice."""

    model: str
    requests: list[common_pb2.GenerateRequest]
    prompt_estimates: list[int]  # per distinct prompt
    prompt_of: list[int]  # per request: its index into prompt_estimates
    max_tokens: int | None  # per choice; None: up to the model's context
    stream: bool  # the client reads tokens as they come (else only the whole answer)
    session: str | None = (
        None  # the session the body names (gateway.mesh.affinity); else its headers
    )

    def reserve(self, default_completion_tokens: int) -> int:
        """Tokens admission reserves: prompts plus the most each choice may write."""
        per_choice = self.max_tokens if self.max_tokens is not None else default_completion_tokens
        return sum(self.prompt_estimates) + per_choice * len(self.requests)


def finish_reason(chunk: Chunk) -> FinishReason | None:
    return FINISH_REASON_NAMES.get(chunk.finish_reason)


class Generation:
    """The router streams of one plan, read together; tracks the usage they report."""

    def __init__(self, mesh: MeshClient, plan: Plan) -> None:
        self._mesh = mesh
        self._plan = plan
        # made before admission: the router decides while admission runs
        self._calls = [mesh.call(r, stream=plan.stream) for r in plan.requests]
        self._streams = [call.chunks for call in self._calls]
        self._firsts: list[Chunk] = []
        self._counted = [0] * len(plan.requests)
        self._reasoning_counted = [0] * len(plan.requests)  # tokens of chunks of only reasoning
        self._reported: list[common_pb2.Usage | None] = [None] * len(plan.requests)
        self._finish_reasons: list[FinishReason | None] = [None] * len(plan.requests)

    @property
    def choices(self) -> int:
        return len(self._streams)

    async def start(self) -> None:
        """Reads each stream's first chunk; the first failure is raised as a GatewayError."""
        if len(self._streams) == 1:
            firsts: list[Chunk | BaseException | None] = [await anext(self._streams[0], None)]
        else:
            firsts = await asyncio.gather(
                *(anext(s, None) for s in self._streams), return_exceptions=True
            )
        for first in firsts:
            if isinstance(first, BaseException):
                raise first
            if first is None:
                raise UpstreamError("The router ended the stream before its first chunk")
        self._firsts = firsts  # type: ignore[assignment]

    def route_headers(self) -> dict[str, str]:
        """Where the first choice runs, once started."""
        route = self._calls[0].route
        if route is None:
            return {}
        headers = {"x-infermesh-worker": route.worker_id}
        if route.precision in PRECISION_NAMES:
            headers[PRECISION_HEADER] = PRECISION_NAMES[route.precision]
        if route.gpu_kind:
            headers[GPU_HEADER] = route.gpu_kind
        return headers

    async def chunks(self) -> AsyncIterator[tuple[int, Chunk]]:
        """(choice, chunk) pairs, first chunks first, then in arrival order; raises
        ``UpstreamError`` when a stream ends without a finish reason."""
        for i, first in enumerate(self._firsts):
            yield i, self._seen(i, first)
        if len(self._streams) == 1:
            async for chunk in self._streams[0]:
                yield 0, self._seen(0, chunk)
        else:
            async for i, chunk in _merged(self._streams):
                yield i, self._seen(i, chunk)
        if None in self._finish_reasons:
            raise UpstreamError("The router's stream ended without a finish reason")

    def _seen(self, i: int, chunk: Chunk) -> Chunk:
        self._counted[i] += len(chunk.token_ids)
        if chunk.reasoning_text and not chunk.text:
            self._reasoning_counted[i] += len(chunk.token_ids)
        if chunk.HasField("usage"):
            self._reported[i] = chunk.usage
        if chunk.finish_reason:
            self._finish_reasons[i] = finish_reason(chunk)
        return chunk

    @property
    def finish_reasons(self) -> list[str]:
        """How the choices ended so far ("unfinished" for one still running)."""
        return [reason or "unfinished" for reason in self._finish_reasons]

    def usage(self) -> TokenUsage:
        """Usage so far: as the worker reported it (its prompt counts come with the first
        chunk, the rest with the last), else counted from the tokens seen (the prompt then
        estimated), so an abandoned stream is charged what it used. A prompt counts once
        however many choices it had, as OpenAI counts it. Reasoning tokens are among the
        completion tokens; an unfinished choice's are those of its chunks of reasoning alone."""
        prompts = [0] * len(self._plan.prompt_estimates)
        cached = [0] * len(self._plan.prompt_estimates)
        completion = reasoning = 0
        for i, reported in enumerate(self._reported):
            group = self._plan.prompt_of[i]
            if reported is not None:
                prompts[group] = max(prompts[group], reported.prompt_tokens)
                cached[group] = max(cached[group], reported.cached_prompt_tokens)
            elif self._counted[i]:
                prompts[group] = max(prompts[group], self._plan.prompt_estimates[group])
            if reported is not None and self._finish_reasons[i] is not None:
                completion += reported.completion_tokens
                reasoning += reported.reasoning_tokens
            else:
                completion += self._counted[i]
                reasoning += self._reasoning_counted[i]
        return TokenUsage(sum(prompts), completion, sum(cached), reasoning)

    async def aclose(self) -> None:
        for call in self._calls:
            await call.chunks.aclose()  # cancels the router call if it still runs
            self._mesh.unused(call)  # a call that never started: its decision goes back


async def _merged(streams: Sequence[AsyncIterator[Chunk]]) -> AsyncIterator[tuple[int, Chunk]]:
    """The remaining chunks of several streams, as they arrive."""
    queue: asyncio.Queue[tuple[int, Chunk | None, BaseException | None]] = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[Chunk]) -> None:
        try:
            async for chunk in stream:
                await queue.put((i, chunk, None))
            await queue.put((i, None, None))
        except Exception as e:
            await queue.put((i, None, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, chunk, error = await queue.get()
            if error is not None:
                raise error
            if chunk is None:
                remaining -= 1
            else:
                yield i, chunk
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def served_model(request: web.Request, model: str) -> str:
    """The served model ``model`` names ([models] aliases), recorded as the request's model."""
    served = request.app[CONFIG].models.resolve(model)
    request[MODEL] = served
    return served


async def refuse_unless_reasoning(
    request: web.Request, model: str, param: str, message: str
) -> None:
    """A 400 (``message``, which names the model) when ``model`` is known not to reason."""
    if await request.app[REASONING_FORMATS].of(served_model(request, model)) == "":
        raise InvalidRequestError(message, param=param)


def check_model(request: web.Request, model: str | None) -> None:
    """A 403 when the request's key may not use ``model``."""
    if model is not None and not request[API_KEY].allows(model):
        raise PermissionDeniedError(f"This API key may not use model '{model}'", param="model")


async def admit(request: web.Request, model: str | None, reserve_tokens: int) -> Admission:
    """Admits the request against its key's model list and limits (403, 401, 429)."""
    check_model(request, model)
    return await request.app[LIMITER].admit(
        request[API_KEY].id, reserve_tokens, request[REQUEST_ID]
    )


@contextlib.asynccontextmanager
async def admitted_generation(
    request: web.Request, plan: Plan
) -> AsyncIterator[tuple[Generation, dict[str, str]]]:
    """Admits and starts ``plan``; the handler answers from the generation and the response
    headers it yields (admission's and the route's). Settles the key's usage however the
    request ends (as not served when the mesh failed it before its first token, see
    ``gateway.accounts.limits``). The ``{operation} {model}`` span and the latency metrics cover the
    whole generation. The plan's model may be an alias ([models] aliases): its requests ask for
    the served model it stands for."""
    model = served_model(request, plan.model)
    sampling = plan.requests[0].sampling
    started = time.monotonic()
    with genai.model_call_span(
        _operation(request),
        model,
        max_tokens=plan.max_tokens,
        temperature=sampling.temperature if sampling.HasField("temperature") else None,
        top_p=sampling.top_p if sampling.HasField("top_p") else None,
    ) as span:
        check_model(request, model)
        session = affinity_key(request[API_KEY].id, request.headers, plan.session)
        key = request[API_KEY]
        for r in plan.requests:
            r.model = model
            r.affinity_key = session
            r.tenant, r.weight, r.tier = key.tenant, key.weight, key.tier  # the router's fair queue
        prompt_tokens = request.app.get(PROMPT_TOKENS)
        if prompt_tokens is not None:  # before the route ask, which takes the prefix hashes
            await prompt_tokens.fill_choices(plan.requests, plan.prompt_of)
        generation = Generation(request.app[MESH], plan)
        try:
            admission = await request.app[LIMITER].admit(
                request[API_KEY].id,
                plan.reserve(request.app[CONFIG].limits.default_completion_reserve),
                request[REQUEST_ID],
            )
        except BaseException:
            await generation.aclose()  # refused: the router's decisions go back unused
            raise
        served = True
        try:
            try:
                await generation.start()
            except Exception as e:
                served = not mesh_failed(e)
                raise
            first_token_s = time.monotonic() - started
            request[FIRST_TOKEN_S] = first_token_s
            yield generation, {**admission.headers, **generation.route_headers()}
        finally:
            usage = generation.usage()
            request[USAGE] = usage
            request.app[LIMITER].settle_soon(admission, usage, served=served)
            with contextlib.suppress(GatewayError):
                await generation.aclose()
            genai.record_response(
                span,
                response_id=request[REQUEST_ID],
                model=model,
                finish_reasons=generation.finish_reasons,
                input_tokens=usage.prompt_tokens,
                output_tokens=usage.completion_tokens,
            )
        metrics.observe_generation(
            "gateway",
            model,
            first_token_s,
            time.monotonic() - started,
            usage.prompt_tokens,
            usage.completion_tokens,
        )
        if usage.reasoning_tokens:
            metrics.REASONING_TOKENS.labels(model).inc(usage.reasoning_tokens)
        metrics.observe_key_tokens(
            key.name, key.tier or "default", usage.prompt_tokens, usage.completion_tokens
        )


def _operation(request: web.Request) -> str:
    """The GenAI operation name of the endpoint."""
    return "text_completion" if request.path.endswith("/v1/completions") else "chat"


@dataclasses.dataclass(frozen=True)
class Answer:
    """How an endpoint answers its generation in its API's format: streamed, the events and the
    event a failure midway becomes, then ``end``; whole, the JSON body ``collect`` builds."""

    events: Callable[[Generation], AsyncIterator[bytes]]
    failed: Callable[[GatewayError], bytes]
    collect: Callable[[Generation], Awaitable[Any]]
    end: bytes = b""


async def answer(
    request: web.Request, plan: Plan, answer: Answer, headers: Mapping[str, str] | None = None
) -> web.StreamResponse:
    """What every generating endpoint ends with once it has parsed and planned: the plan admitted
    and generated (``admitted_generation``), answered streamed or whole, with ``headers`` beside
    admission's and the route's."""
    async with admitted_generation(request, plan) as (generation, admitted):
        admitted.update(headers or {})
        if plan.stream:
            return await sse.stream(
                request, admitted, answer.events(generation), answer.failed, answer.end
            )
        return json_body.json_response(await answer.collect(generation), headers=admitted)
