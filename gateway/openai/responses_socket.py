"""The Responses API over WebSocket ("WebSocket mode", the openai SDK's
``client.responses.connect()``): ``GET /v1/responses`` upgraded to a WebSocket, authenticated in
the handshake as every request is (``Authorization: Bearer``; without a key the handshake is
answered 401 and no socket opens).

Each ``response.create`` message holds the fields of a ``POST /v1/responses`` body, streaming
implied, and is made on the same path (``gateway.openai.responses``, ``admitted_generation``: the
same validation, limits, usage and router path); its events come back on the socket, one message
each. Responses on one connection run one at a time: another ``response.create`` while one runs is
refused with an error event, unless it names another lane (``stream_id``, echoed on each event of
its response). ``previous_response_id`` continues a response made on this connection, stored or
not (``store: false``): the connection keeps its most recent response, and forgets the one a
continuation failed from; others come from the store. ``generate: false`` makes a response
without generating (created, then completed with no output), to be continued from. Closing the
socket cancels its running responses (settled with what they used).

A message that is not JSON, not an event this gateway knows or not a valid body is answered with
an ``error`` event (``status``, and ``error`` in OpenAI's shape); the connection stays open.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any

import orjson
from aiohttp import WSMsgType, web

from gateway.api.generation import admitted_generation
from gateway.config import CONFIG
from gateway.http.errors import (
    GatewayError,
    InvalidRequestError,
    MethodNotAllowedError,
    store_unavailable,
)
from gateway.http.json_body import dumps
from gateway.http.state import REQUEST_ID
from gateway.openai.responses import Turn, load_previous, new_turn
from gateway.openai.responses_output import Event
from gateway.openai.responses_protocol import parse_responses_request
from gateway.openai.responses_store import StoredResponse
from infermesh.redis_client import REDIS_ERRORS
from infermesh.tasks import cancel_and_wait

logger = logging.getLogger(__name__)

_ENVELOPE = ("type", "stream_id", "generate")  # a message's fields that are not the body's


async def responses_socket(request: web.Request) -> web.StreamResponse:
    socket = web.WebSocketResponse(max_msg_size=request.config_dict[CONFIG].server.max_body_bytes)
    if not socket.can_prepare(request).ok:
        raise MethodNotAllowedError(
            "GET /v1/responses is the Responses API's WebSocket: open it with a WebSocket "
            "upgrade (ws://.../v1/responses), or POST /v1/responses to create a response"
        )
    await socket.prepare(request)
    connection = _Connection(request, socket)
    try:
        async for message in socket:
            if message.type in (WSMsgType.TEXT, WSMsgType.BINARY):
                await connection.received(message.data)
    finally:
        await connection.close()
    return socket


class _Connection:
    """One socket's responses: its lanes' running responses and its most recent response."""

    def __init__(self, request: web.Request, socket: web.WebSocketResponse) -> None:
        self._request = request
        self._socket = socket
        self._lanes: dict[str | None, asyncio.Task[None]] = {}
        self._local: dict[str, StoredResponse] = {}  # the most recent response, by id
        self._send_lock = asyncio.Lock()

    async def received(self, data: str | bytes) -> None:
        try:
            event = orjson.loads(data)
        except orjson.JSONDecodeError as e:
            await self._error(InvalidRequestError(f"The message is not valid JSON: {e}"), None)
            return
        lane = event.get("stream_id") if isinstance(event, dict) else None
        problem = _envelope_problem(event)
        if problem is None and lane in self._lanes:
            problem = InvalidRequestError(
                "A response is already running on this connection"
                + (f" in lane '{lane}'" if lane else "")
                + "; send the next response.create once it has completed, or in another lane "
                "(stream_id)",
                code="response_already_in_progress",
            )
        if problem is not None:
            await self._error(problem, lane if isinstance(lane, str) else None)
            return
        task = asyncio.create_task(self._create(event, lane))
        self._lanes[lane] = task
        task.add_done_callback(lambda _: self._lanes.pop(lane, None))

    async def close(self) -> None:
        for task in list(self._lanes.values()):
            await cancel_and_wait(task)

    async def _create(self, event: dict[str, Any], lane: str | None) -> None:
        # each response its own request state (its id, its usage), over the socket's request
        request = self._request.clone()
        request[REQUEST_ID] = f"req-{uuid.uuid4().hex}"
        fields = {k: v for k, v in event.items() if k not in _ENVELOPE}
        try:
            body = parse_responses_request({**fields, "stream": True}, request.headers)
            turn = new_turn(request, body, await load_previous(request, body, self._local))
            if event.get("generate", True):
                made = await self._generate(request, turn, lane)
            else:
                await self._send(await turn.reply.warmed(), lane)
                made = True
        except asyncio.CancelledError:
            raise
        except Exception as e:
            await self._error(self._gateway_error(e), lane)
            made = False
        if made:
            self._local = {turn.reply.id: turn.reply.record}
        else:  # a continuation that failed forgets what it continued
            self._local.pop(str(fields.get("previous_response_id")), None)

    async def _generate(self, request: web.Request, turn: Turn, lane: str | None) -> bool:
        """Makes the response, its events on the socket; whether it completed."""
        async with admitted_generation(request, turn.plan) as (generation, _):
            try:
                async for events in turn.reply.event_lists(generation):
                    await self._send(events, lane)
            except GatewayError as e:  # midway: the response fails, as a stream's does
                await self._send([turn.reply.failed_event(e)], lane)
                return False
        return True

    def _gateway_error(self, error: Exception) -> GatewayError:
        if isinstance(error, GatewayError):
            return error
        if isinstance(error, REDIS_ERRORS):
            logger.warning("key and limit store unavailable: %s", type(error).__name__)
            return store_unavailable(self._request.config_dict[CONFIG].redis.retry_after_s)
        logger.exception("unhandled error in a Responses WebSocket's response.create")
        return GatewayError("The gateway failed to handle the response.create")

    async def _error(self, error: GatewayError, lane: str | None) -> None:
        detail: dict[str, Any] = {
            "type": error.type,
            "code": error.code,
            "message": error.message,
            "param": error.param,
        }
        if error.retry_after_s is not None:
            detail["headers"] = {"retry-after": str(error.retry_after_s)}
        await self._send([{"type": "error", "status": error.status, "error": detail}], lane)

    async def _send(self, events: list[Event], lane: str | None) -> None:
        async with self._send_lock:
            if self._socket.closed:  # the client left: close() cancels what still runs
                return
            for event in events:
                message = {**event, "stream_id": lane} if lane is not None else event
                await self._socket.send_str(dumps(message).decode())


def _envelope_problem(event: Any) -> InvalidRequestError | None:
    """What is wrong with a message's envelope, if anything."""
    if not isinstance(event, dict):
        return InvalidRequestError("A message must be a JSON object")
    if event.get("type") != "response.create":
        return InvalidRequestError(
            f"Unknown event type {event.get('type')!r}; this socket takes 'response.create'",
            param="type",
        )
    if not isinstance(event.get("stream_id", ""), str):
        return InvalidRequestError("'stream_id' must be a string", param="stream_id")
    if not isinstance(event.get("generate", True), bool):
        return InvalidRequestError("'generate' must be a boolean", param="generate")
    if event.get("background"):
        return InvalidRequestError(
            "'background' is not supported over WebSocket", param="background"
        )
    return None
