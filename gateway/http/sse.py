"""Server-sent events: encoding and the streaming response every endpoint uses.

A failure after the stream began cannot change the status any more: it becomes a
last error event (then the endpoint's end marker, OpenAI's ``[DONE]``), never a
cut connection. A client that goes away ends the response quietly; the handler's
cancellation closes the router calls.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from aiohttp import web

from gateway.http.errors import GatewayError
from gateway.http.json_body import dumps
from gateway.http.state import REQUEST_ID

logger = logging.getLogger(__name__)

_HEADERS = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}
OPENAI_DONE = b"data: [DONE]\n\n"


def openai_event(data: dict[str, Any]) -> bytes:
    return b"data: " + dumps(data) + b"\n\n"


def named_event(data: dict[str, Any]) -> bytes:
    """An event named by its ``type``, as Anthropic's and OpenAI's Responses streams frame them."""
    event: str = data["type"]
    return b"event: " + event.encode() + b"\ndata: " + dumps(data) + b"\n\n"


async def stream(
    request: web.Request,
    headers: dict[str, str],
    events: AsyncIterator[bytes],
    error_event: Callable[[GatewayError], bytes],
    end: bytes = b"",
) -> web.StreamResponse:
    """Sends ``events``; a failure midway becomes ``error_event(error)``; then ``end``."""
    response = web.StreamResponse(headers={**_HEADERS, **headers})
    await response.prepare(request)
    try:
        try:
            async for event in events:
                await response.write(event)
        except ConnectionResetError:
            raise
        except GatewayError as e:
            await response.write(error_event(e))
        except Exception:
            logger.exception("stream of request %s failed", request[REQUEST_ID])
            await response.write(error_event(GatewayError("The stream failed")))
        await response.write_eof(end)  # the end marker and the stream's end in one write
    except ConnectionResetError:
        logger.info("client closed the stream of request %s", request[REQUEST_ID])
    return response
