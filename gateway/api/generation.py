"""One request's generation, for every endpoint, in the stages ``GENERATION_STAGES`` names in
order (address, tokenize, ask the route, admit, start), then the endpoint's answer
(``respond``) and settlement however it ends.

Each choice (``n``, or one per prompt of a batched legacy completion) is one mesh call
(``infermesh.mesh_call``). Every stream is read up to its first chunk before anything is
answered, so a failure before the first token (unknown model, no worker, router down) is a
plain HTTP error. Tokens are counted as they pass (by the mesh call), so a stream the client
abandoned is still settled with what it consumed.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any

from aiohttp import web
from opentelemetry import trace

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
from gateway.mesh.client import CALL_ERRORS, MeshClient
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
    """The mesh calls of one plan, read together: each choice's chunks pass its mesh call
    (``infermesh.mesh_call``) and then ``by_choice`` here, the API-level stream every endpoint
    shapes into its wire format."""

    def __init__(self, mesh: MeshClient, plan: Plan) -> None:
        self._mesh = mesh
        self._plan = plan
        # made before admission: the router decides while admission runs
        self._calls = [mesh.call(r, stream=plan.stream) for r in plan.requests]
        self._firsts: list[Chunk] = []

    @property
    def choices(self) -> int:
        return len(self._calls)

    async def start(self) -> None:
        """Reads each call's first chunk; the first failure is raised as a GatewayError."""
        try:
            if len(self._calls) == 1:
                firsts: list[Chunk | BaseException | None] = [
                    await anext(self._calls[0].chunks, None)
                ]
            else:
                firsts = await asyncio.gather(
                    *(anext(c.chunks, None) for c in self._calls), return_exceptions=True
                )
        except CALL_ERRORS as e:
            raise self._mesh.gateway_error(e) from None
        for first in firsts:
            if isinstance(first, CALL_ERRORS):
                raise self._mesh.gateway_error(first) from None
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

    async def by_choice(self) -> AsyncIterator[tuple[int, Chunk]]:
        """(choice, chunk) pairs, first chunks first, then in arrival order; raises a
        GatewayError when a call fails, ``UpstreamError`` when one ends without a finish
        reason."""
        try:
            for i, first in enumerate(self._firsts):
                yield i, first
            if len(self._calls) == 1:
                async for chunk in self._calls[0].chunks:
                    yield 0, chunk
            else:
                async for i, chunk in _merged([c.chunks for c in self._calls]):
                    yield i, chunk
        except CALL_ERRORS as e:
            raise self._mesh.gateway_error(e) from None
        if not all(c.finish_reason for c in self._calls):
            raise UpstreamError("The router's stream ended without a finish reason")

    @property
    def finish_reasons(self) -> list[str]:
        """How the choices ended so far ("unfinished" for one still running)."""
        return [FINISH_REASON_NAMES.get(c.finish_reason, "unfinished") for c in self._calls]

    def usage(self) -> TokenUsage:
        """Usage so far: each call's (``MeshCall.usage``: as the worker reported it, else
        counted from the tokens seen), a prompt with tokens but no report estimated, so an
        abandoned stream is charged what it used. A prompt counts once however many choices
        it had, as OpenAI counts it."""
        prompts = [0] * len(self._plan.prompt_estimates)
        cached = [0] * len(self._plan.prompt_estimates)
        completion = reasoning = 0
        for i, call in enumerate(self._calls):
            group = self._plan.prompt_of[i]
            used = call.usage()
            prompt = used.prompt_tokens
            if not prompt and used.completion_tokens:
                prompt = self._plan.prompt_estimates[group]
            prompts[group] = max(prompts[group], prompt)
            cached[group] = max(cached[group], used.cached_prompt_tokens)
            completion += used.completion_tokens
            reasoning += used.reasoning_tokens
        return TokenUsage(sum(prompts), completion, sum(cached), reasoning)

    async def aclose(self) -> None:
        for call in self._calls:
            await call.chunks.aclose()  # cancels the request if it still runs
            call.unused()  # a call that never started: its decision goes back


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
    key = request[API_KEY]
    return await request.app[LIMITER].admit(
        key.id, reserve_tokens, request[REQUEST_ID], bills=not key.batch
    )


@dataclasses.dataclass
class _Turn:
    """One request's generation as its stages fill it in."""

    request: web.Request
    plan: Plan
    model: str
    started: float
    generation: Generation | None = None
    admission: Admission | None = None
    served: bool = True  # False: the mesh failed it before its first token
    first_token_s: float = 0.0


async def _address(turn: _Turn) -> None:
    """Each request names the served model, the session (``gateway.mesh.affinity``) and the
    key's standing in the router's fair queue; a 403 when the key may not use the model."""
    request, key = turn.request, turn.request[API_KEY]
    check_model(request, turn.model)
    session = affinity_key(key.id, request.headers, turn.plan.session)
    for r in turn.plan.requests:
        r.model, r.affinity_key = turn.model, session
        r.tenant, r.weight, r.tier = key.tenant, key.weight, key.tier


async def _tokenize(turn: _Turn) -> None:
    """The prompts' token ids and prefix hashes (``infermesh.prompt_tokens``), which the
    route ask takes."""
    prompt_tokens = turn.request.app.get(PROMPT_TOKENS)
    if prompt_tokens is not None:
        await prompt_tokens.fill_choices(turn.plan.requests, turn.plan.prompt_of)


async def _ask_route(turn: _Turn) -> None:
    """One mesh call per choice; each asks the router at once, so that it decides while
    admission runs."""
    turn.generation = Generation(turn.request.app[MESH], turn.plan)


async def _admit(turn: _Turn) -> None:
    """The key's limits in Redis (401, 429); refused, the router's decisions go back unused."""
    request, key = turn.request, turn.request[API_KEY]
    turn.admission = await request.app[LIMITER].admit(
        key.id,
        turn.plan.reserve(request.app[CONFIG].limits.default_completion_reserve),
        request[REQUEST_ID],
        bills=not key.batch,
    )


async def _start(turn: _Turn) -> None:
    """Each choice's first chunk: a failure before the first token is a plain HTTP error."""
    assert turn.generation is not None, "_ask_route comes first"
    try:
        await turn.generation.start()
    except Exception as e:
        turn.served = not mesh_failed(e)
        raise
    turn.first_token_s = time.monotonic() - turn.started
    turn.request[FIRST_TOKEN_S] = turn.first_token_s


GENERATION_STAGES = (_address, _tokenize, _ask_route, _admit, _start)
"""The stages of every generating endpoint's request, in order, before the endpoint answers
(``respond``: streamed or whole) and the usage is settled (``_settle``)."""


@contextlib.asynccontextmanager
async def admitted_generation(
    request: web.Request, plan: Plan
) -> AsyncIterator[tuple[Generation, dict[str, str]]]:
    """Runs ``GENERATION_STAGES`` on ``plan``; the handler answers from the generation and the
    response headers it yields (admission's and the route's). Settles the key's usage however
    the request ends once admitted (as not served when the mesh failed it before its first
    token, see ``gateway.accounts.limits``). The ``{operation} {model}`` span and the latency
    metrics cover the whole generation. The plan's model may be an alias ([models] aliases):
    its requests ask for the served model it stands for."""
    turn = _Turn(request, plan, served_model(request, plan.model), time.monotonic())
    sampling = plan.requests[0].sampling
    with genai.model_call_span(
        _operation(request),
        turn.model,
        max_tokens=plan.max_tokens,
        temperature=sampling.temperature if sampling.HasField("temperature") else None,
        top_p=sampling.top_p if sampling.HasField("top_p") else None,
    ) as span:
        try:
            for stage in GENERATION_STAGES:
                await stage(turn)
            assert turn.generation is not None and turn.admission is not None
            yield turn.generation, {**turn.admission.headers, **turn.generation.route_headers()}
        finally:
            await _settle(turn, span)
        _observe(turn)


async def _settle(turn: _Turn, span: trace.Span) -> None:
    """Settles the admitted request's usage, ends its mesh calls (a decision never used goes
    back) and records the response on the span."""
    generation, request = turn.generation, turn.request
    if generation is None:
        return
    if turn.admission is None:  # refused: nothing to settle
        await generation.aclose()
        return
    usage = generation.usage()
    request[USAGE] = usage
    request.app[LIMITER].settle_soon(turn.admission, usage, served=turn.served)
    with contextlib.suppress(GatewayError):
        await generation.aclose()
    genai.record_response(
        span,
        response_id=request[REQUEST_ID],
        model=turn.model,
        finish_reasons=generation.finish_reasons,
        input_tokens=usage.prompt_tokens,
        output_tokens=usage.completion_tokens,
    )


def _observe(turn: _Turn) -> None:
    """The latency and token metrics of a request answered in full."""
    usage, key = turn.request[USAGE], turn.request[API_KEY]
    metrics.observe_generation(
        "gateway",
        turn.model,
        turn.first_token_s,
        time.monotonic() - turn.started,
        usage.prompt_tokens,
        usage.completion_tokens,
    )
    if usage.reasoning_tokens:
        metrics.REASONING_TOKENS.labels(turn.model).inc(usage.reasoning_tokens)
    metrics.observe_key_tokens(
        key.name, key.tier or "default", usage.prompt_tokens, usage.completion_tokens
    )


def _operation(request: web.Request) -> str:
    """The GenAI operation name of the endpoint."""
    return "text_completion" if request.path.endswith("/v1/completions") else "chat"


@dataclasses.dataclass(frozen=True)
class ResponseFormat:
    """How an endpoint answers its generation in its API's format: streamed, the events and the
    event a failure midway becomes, then ``end``; whole, the JSON body ``collect`` builds."""

    events: Callable[[Generation], AsyncIterator[bytes]]
    failed: Callable[[GatewayError], bytes]
    collect: Callable[[Generation], Awaitable[Any]]
    end: bytes = b""


async def respond(
    request: web.Request,
    plan: Plan,
    response: ResponseFormat,
    headers: Mapping[str, str] | None = None,
) -> web.StreamResponse:
    """What every generating endpoint ends with once it has parsed and planned: the plan
    generated (``admitted_generation``), answered streamed or whole in the endpoint's
    ``response`` format, with ``headers`` beside admission's and the route's."""
    async with admitted_generation(request, plan) as (generation, admitted):
        admitted.update(headers or {})
        if plan.stream:
            return await sse.stream(
                request, admitted, response.events(generation), response.failed, response.end
            )
        return json_body.json_response(await response.collect(generation), headers=admitted)
