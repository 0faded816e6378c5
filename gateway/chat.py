"""Serving ``POST /v1/chat/completions``: validate, call the router, answer.

The router's stream is read up to its first chunk before anything is sent, so
a failure before the first token (unknown model, no worker, router down) is a
plain HTTP error. After that, a streamed answer reports a failure as a last
``data: {"error": ...}`` event. A client that goes away cancels the router call.
"""
from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from gateway.errors import GatewayError, InvalidRequestError, RequestTooLargeError, UpstreamError
from gateway.middleware import REQUEST_ID
from gateway.protocol import (ChatCompletionRequest, FinishReason, chat_chunk, chat_completion,
                              completion_id, now_s, parse_chat_request, usage, usage_chunk)
from gateway.router_client import PRECISION_NAMES, ROUTER, build_generate_request
from infermesh.pb import common_pb2

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = web.AppKey("max_body_bytes", int)

_FINISH_REASONS: dict[int, FinishReason] = {
    common_pb2.FINISH_REASON_STOP: "stop", common_pb2.FINISH_REASON_LENGTH: "length",
}
_SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no"}


async def create_chat_completion(request: web.Request) -> web.StreamResponse:
    body = parse_chat_request(await read_json(request), request.headers)
    generate = build_generate_request(body, request[REQUEST_ID])
    stream = request.app[ROUTER].generate(generate)
    async with contextlib.aclosing(stream):
        first = await anext(stream, None)
        if first is None:
            raise UpstreamError("The router ended the stream before its first chunk")
        headers = _route_headers(first)
        if body.stream:
            return await _stream(request, body, first, stream, headers)
        return await _collect(body, first, stream, headers)


async def read_json(request: web.Request) -> Any:
    """The decoded body; 413 past the size limit, 400 when it is not JSON."""
    limit = request.app[MAX_BODY_BYTES]
    too_large = RequestTooLargeError(f"The request body is larger than the limit of {limit} bytes")
    if request.content_length is not None and request.content_length > limit:
        raise too_large
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise too_large from None
    try:
        return json.loads(raw, parse_constant=_reject_constant)
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
        raise InvalidRequestError(f"The request body is not valid JSON: {e}") from None


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def _route_headers(first: common_pb2.GenerateResponse) -> dict[str, str]:
    if not first.HasField("route"):
        return {}
    headers = {"x-infermesh-worker": first.route.worker_id}
    if first.route.precision in PRECISION_NAMES:
        headers["x-infermesh-precision"] = PRECISION_NAMES[first.route.precision]
    return headers


def _finish_reason(last: common_pb2.GenerateResponse) -> FinishReason:
    if last.finish_reason not in _FINISH_REASONS:
        raise UpstreamError("The router's stream ended without a finish reason")
    return _FINISH_REASONS[last.finish_reason]


def _usage(last: common_pb2.GenerateResponse) -> dict[str, Any]:
    u = last.usage
    return usage(u.prompt_tokens, u.completion_tokens, u.cached_prompt_tokens)


async def _collect(body: ChatCompletionRequest, first: common_pb2.GenerateResponse,
                   stream: AsyncIterator[common_pb2.GenerateResponse],
                   headers: dict[str, str]) -> web.Response:
    texts, last = [first.text], first
    async for chunk in stream:
        texts.append(chunk.text)
        last = chunk
    completion = chat_completion(completion_id(), now_s(), body.model, "".join(texts),
                                 _finish_reason(last), _usage(last))
    return web.json_response(completion, headers=headers)


async def _stream(request: web.Request, body: ChatCompletionRequest,
                  first: common_pb2.GenerateResponse,
                  stream: AsyncIterator[common_pb2.GenerateResponse],
                  headers: dict[str, str]) -> web.StreamResponse:
    response = web.StreamResponse(headers={**_SSE_HEADERS, **headers})
    await response.prepare(request)
    try:
        try:
            async for event in _events(body, first, stream):
                await response.write(_sse(event))
        except ConnectionResetError:
            raise
        except GatewayError as e:
            await response.write(_sse(e.body()))
        except Exception:
            logger.exception("stream of request %s failed", request[REQUEST_ID])
            await response.write(_sse(GatewayError("The stream failed").body()))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
    except ConnectionResetError:
        logger.info("client closed the stream of request %s", request[REQUEST_ID])
    return response


async def _events(body: ChatCompletionRequest, first: common_pb2.GenerateResponse,
                  stream: AsyncIterator[common_pb2.GenerateResponse],
                  ) -> AsyncIterator[dict[str, Any]]:
    """The stream's chunks: role, text deltas, finish reason, then usage if asked for."""
    cid, created, usage_field = completion_id(), now_s(), body.include_usage

    def chunk(delta: dict[str, Any], finish: FinishReason | None = None) -> dict[str, Any]:
        return chat_chunk(cid, created, body.model, delta, finish, with_usage_field=usage_field)

    yield chunk({"role": "assistant", "content": ""})
    last = first
    if first.text:
        yield chunk({"content": first.text})
    async for item in stream:
        if item.text:
            yield chunk({"content": item.text})
        last = item
    yield chunk({}, _finish_reason(last))
    if usage_field:
        yield usage_chunk(cid, created, body.model, _usage(last))


def _sse(event: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"
