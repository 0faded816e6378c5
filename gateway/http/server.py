"""The gateway's HTTP connections: what happens before a request reaches the app.

aiohttp's protocol answers a request its parser refuses (a header line over the limit,
a NUL in a header, a bad Content-Length, TLS bytes on the plain port...) itself, with a
text/plain 400, and logs the exception at ERROR: its message quotes the offending header
line, an API key with it. ``GatewayRequestHandler`` answers those in OpenAI's error
shape with the status that names the problem (400, 408, 414, 431) and logs only the
exception's type. It also bounds how long a client may take to send a request's
headers (``[server] header_timeout_s``: 408, then the connection is closed); idle
keep-alive connections close after ``keepalive_timeout_s`` and a body that does not
arrive within ``body_timeout_s`` is a 408 (``gateway.http.validation.read_json``).

``GatewayRunner`` is ``web.AppRunner`` with connections of that class; ``python -m gateway``
and the tests serve the app through it.
"""

from __future__ import annotations

import asyncio
import logging
import traceback
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import (
    BadHttpMessage,
    BadHttpMethod,
    BadStatusLine,
    InvalidHeader,
    InvalidURLError,
    LineTooLong,
)
from aiohttp.http_parser import RawRequestMessage
from aiohttp.streams import EMPTY_PAYLOAD, StreamReader
from aiohttp.web_protocol import RequestHandler, _ErrInfo

from gateway.config import HttpServerSection
from gateway.http.errors import (
    GatewayError,
    HeadersTooLargeError,
    InvalidRequestError,
    RequestTimeoutError,
    UpstreamTimeoutError,
    UriTooLongError,
    error_response,
)
from gateway.http.state import LOOPBACK

logger = logging.getLogger(__name__)

_LINGER_AFTER_408_S = 1.0


class HeadersTimeoutError(Exception):
    """The client did not finish sending a request's headers in time."""


class GatewayRequestHandler(RequestHandler):
    """aiohttp's connection protocol, with JSON errors, redacted logs and a header deadline."""

    def __init__(self, *args: Any, header_timeout_s: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timeout_s = header_timeout_s
        self._header_timer: asyncio.TimerHandle | None = None
        self._request_line_bytes = 0  # of the request whose headers are arriving...
        self._request_line_done = False  # ...until its first newline
        self._body: StreamReader = EMPTY_PAYLOAD  # of the last request parsed
        self._refused = False  # a malformed or late request: the connection is done

    def data_received(self, data: bytes) -> None:
        if self._refused:  # answered already; the rest of the stream is not HTTP we can use
            return
        if data and self._header_timer is None and self._body.is_eof():
            self._start_headers()
        if self._header_timer is not None and not self._request_line_done:
            newline = data.find(b"\n")
            self._request_line_done = newline >= 0
            self._request_line_bytes += newline if newline >= 0 else len(data)
        parsed = self._request_count
        super().data_received(data)
        if self._request_count != parsed:  # a request came out of the parser, or an error
            self._stop_headers()
            message, self._body = self._messages[-1]
            self._refused = not isinstance(message, RawRequestMessage)

    def _start_headers(self) -> None:
        # The idle timer would close the connection silently halfway through the headers.
        self.keep_alive(True)
        self._request_line_bytes, self._request_line_done = 0, False
        self._header_timer = self._loop.call_later(self._header_timeout_s, self._headers_late)

    def _stop_headers(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        """Queues a 408 as if the parser had produced it: answered in turn, then closed."""
        self._header_timer = None
        self._refused = True
        self._messages.append(
            (_ErrInfo(status=408, exc=HeadersTimeoutError(), message=""), EMPTY_PAYLOAD)
        )
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def connection_lost(self, exc: BaseException | None) -> None:
        self._stop_headers()
        super().connection_lost(exc)

    async def finish_response(
        self, request: web.BaseRequest, response: web.StreamResponse, start_time: float | None
    ) -> tuple[web.StreamResponse, bool]:
        if response.status == 408:
            # aiohttp goes on reading the unread body for lingering_time (10 s) before it
            # closes, so that the client reads the answer before the reset its next bytes
            # would draw; a client too slow to send its body gets a second for that only.
            self._lingering_time = min(self._lingering_time, _LINGER_AFTER_408_S)
        return await super().finish_response(request, response, start_time)

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """An OpenAI-shaped error for a request the parser refused (or one whose handler
        failed outside the app's error middleware); always closes the connection."""
        error = self._error(status, exc)
        if error.status >= 500:
            self.log_exception(
                "request from %s answered %d", request.remote, error.status, exc_info=exc
            )
        else:
            logger.warning(
                "malformed HTTP request from %s answered %d: %s",
                request.remote,
                error.status,
                type(exc).__name__,
            )
        if request.writer.output_size > 0:  # the answer has begun: only closing is left
            raise ConnectionError("the response had begun when the request failed")
        response = error_response(error)
        response.force_close()
        return response

    def log_exception(
        self, message: str, *args: Any, exc_info: BaseException | None = None, **kwargs: Any
    ) -> None:
        """aiohttp's own error logging (an unhandled exception, say), redacted."""
        log_redacted(message, *args, exc=exc_info)

    def _error(self, status: int, exc: BaseException | None) -> GatewayError:
        if isinstance(exc, HeadersTimeoutError):
            return RequestTimeoutError(
                f"The request's headers did not arrive within {self._header_timeout_s:g} s"
            )
        if isinstance(exc, LineTooLong) and self._request_line_bytes > self.max_line_size:
            return UriTooLongError(f"The request line is longer than {self.max_line_size} bytes")
        if isinstance(exc, LineTooLong):
            return HeadersTooLargeError(f"A header is longer than {self.max_field_size} bytes")
        if isinstance(exc, BadHttpMessage) and exc.message == "Too many headers received":
            return HeadersTooLargeError(f"More than {self.max_headers} headers")
        if status == 504:
            return UpstreamTimeoutError("The request took longer than the gateway's deadline")
        if status >= 500:
            return GatewayError("The gateway failed to handle the request")
        return InvalidRequestError(
            f"Malformed HTTP request: {_reason(exc)}", code="malformed_request"
        )


def log_redacted(message: str, *args: Any, exc: BaseException | None = None) -> None:
    """An error line with the exception's type and frames but not its message, which may
    quote the request (and a key with it)."""
    if exc is None:
        logger.error(message, *args)
        return
    logger.error(
        message + ": %s\n%s",
        *args,
        type(exc).__name__,
        "".join(traceback.format_tb(exc.__traceback__)),
    )


def _reason(exc: BaseException | None) -> str:
    """What was wrong, in words that never quote the request (its bytes may hold a key)."""
    if isinstance(exc, BadHttpMethod):
        if "HTTPS" in exc.message:
            return "TLS sent to the plain HTTP port"
        return "the request line does not start with an HTTP method"
    if isinstance(exc, BadStatusLine):
        return "the request line or HTTP version is not valid"
    if isinstance(exc, InvalidHeader):
        return "a header holds a character headers may not hold"
    if isinstance(exc, InvalidURLError):
        return "the URL is not valid"
    if isinstance(exc, BadHttpMessage) and exc.message.startswith("Duplicate '"):
        return exc.message  # names one of aiohttp's fixed singleton headers
    if isinstance(exc, BadHttpMessage) and ":\n\n" in exc.message:
        return exc.message.partition(":\n\n")[0]  # llhttp's fixed reason; the quote follows
    return "not a valid HTTP/1.1 request"


class _GatewayServer(web.Server):
    def __init__(self, *args: Any, header_timeout_s: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timeout_s = header_timeout_s

    def __call__(self) -> GatewayRequestHandler:
        return GatewayRequestHandler(
            self, loop=self._loop, header_timeout_s=self._header_timeout_s, **self._kwargs
        )


class GatewayRunner(web.AppRunner):
    """``web.AppRunner`` serving through ``GatewayRequestHandler`` with ``[server]``'s timeouts,
    and on this process's own socket (``gateway.http.loopback``) when the app has one."""

    def __init__(self, app: web.Application, server: HttpServerSection, **kwargs: Any) -> None:
        super().__init__(app, keepalive_timeout=server.keepalive_timeout_s, **kwargs)
        self._header_timeout_s = server.header_timeout_s

    async def setup(self) -> None:
        await super().setup()
        loopback = self.app.get(LOOPBACK)
        if loopback is not None:
            await loopback.serve(self)

    async def cleanup(self) -> None:
        try:
            await super().cleanup()
        finally:
            loopback = self.app.get(LOOPBACK)
            if loopback is not None:
                loopback.close()

    async def _make_server(self) -> web.Server:
        # aiohttp has no hook for the protocol class: the server it built, rebuilt with ours.
        built = await super()._make_server()
        return _GatewayServer(
            built.request_handler,
            request_factory=built.request_factory,
            handler_cancellation=built.handler_cancellation,
            loop=asyncio.get_running_loop(),
            header_timeout_s=self._header_timeout_s,
            **built._kwargs,
        )
