"""The gateway's middlewares but authentication: errors to JSON, request ids, keys kept out
of URLs.

Order in the app: ``redact_query_keys`` (so no span records a key sent in the
URL), telemetry's server span, ``error_middleware`` (so every answer the span
sees is already JSON), then ``auth_middleware`` (``gateway.accounts.auth``). The admin API
(``gateway.accounts.admin``) is a sub-application with its own credential.
"""

from __future__ import annotations

import logging
import re
import uuid

from aiohttp import web
from aiohttp.abc import AbstractAccessLogger
from aiohttp.typedefs import Handler
from opentelemetry import trace

from gateway.config import CONFIG
from gateway.http.errors import (
    Dialect,
    GatewayError,
    InvalidRequestError,
    error_response,
    from_http_exception,
    store_unavailable,
)
from gateway.http.state import API_PREFIXES, MODEL, REQUEST_ID, TRACE_ID
from infermesh.redis_client import REDIS_ERRORS
from telemetry.metrics import REQUESTS

logger = logging.getLogger(__name__)

# Query parameters clients use for keys; refused so keys stay out of URLs and logs.
QUERY_KEY_NAMES = {"api_key", "api-key", "apikey", "key", "access_token", "token"}
_CLIENT_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


@web.middleware
async def redact_query_keys(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Outermost: blanks key-like query values before the trace span records the URL.

    ``auth_middleware`` still sees the parameter and refuses the request."""
    names = {name for name in request.query if name.lower() in QUERY_KEY_NAMES}
    if names:
        redacted = request.rel_url.update_query(dict.fromkeys(names, "REDACTED"))
        request = request.clone(rel_url=redacted)
    return await handler(request)


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every failure becomes an OpenAI-shaped JSON error; never HTML, never a bare 500."""
    client_id = request.headers.get("x-request-id", "")
    request[REQUEST_ID] = (
        client_id if _CLIENT_REQUEST_ID.fullmatch(client_id) else f"req-{uuid.uuid4().hex}"
    )
    context = trace.get_current_span().get_span_context()
    if context.is_valid:
        request[TRACE_ID] = format(context.trace_id, "032x")
    try:
        response = await handler(request)
        _count(request, response.status)
        return response
    except GatewayError as e:
        error = e
    except REDIS_ERRORS as e:
        logger.warning("key and limit store unavailable: %s", type(e).__name__)
        error = store_unavailable(request.config_dict[CONFIG].redis.retry_after_s)
    except web.HTTPException as e:
        if e.status < 400:  # redirects are answers, not errors
            raise
        error = from_http_exception(e, request)
    except Exception:
        logger.exception(
            "unhandled error in %s %s (request %s)",
            request.method,
            request.path,
            request[REQUEST_ID],
        )
        error = GatewayError("The gateway failed to handle the request")
    dialect = _dialect(request)
    if error.status >= 500:
        logger.warning(
            "%s %s -> %d %s (request %s)",
            request.method,
            request.path,
            error.status_in(dialect),
            error.message,
            request[REQUEST_ID],
        )
    _count(request, error.status_in(dialect))
    return error_response(error, dialect)


def _count(request: web.Request, status: int) -> None:
    if request.path.startswith(request.config_dict[API_PREFIXES]) or request.path.endswith(
        "/messages"
    ):
        REQUESTS.labels("gateway", request.get(MODEL, ""), str(status)).inc()


def _dialect(request: web.Request) -> Dialect:
    """Anthropic's routes answer errors in Anthropic's shape, and so do the routes both APIs
    share (/v1/models) when an Anthropic client asks."""
    if "/v1/messages" in request.path:
        return "anthropic"
    return "anthropic" if "/models" in request.path and is_anthropic_client(request) else "openai"


def is_anthropic_client(request: web.Request) -> bool:
    """Anthropic's SDKs (and Claude Code) send ``anthropic-version`` with every request; its
    ``x-api-key`` credential is theirs too."""
    return "anthropic-version" in request.headers or "x-api-key" in request.headers


def single_header(request: web.Request, name: str) -> str | None:
    """A credential header's value; two of them are ambiguous credentials, refused rather
    than one of them silently chosen."""
    values = request.headers.getall(name, [])
    if len(values) > 1:
        raise InvalidRequestError(
            f"The request has {len(values)} {name} headers; send one",
            code="ambiguous_credentials",
            param=name,
        )
    return values[0] if values else None


async def add_request_id(request: web.Request, response: web.StreamResponse) -> None:
    """``on_response_prepare`` hook: every answer carries ``x-request-id``, and
    ``x-trace-id``: the id to paste into Jaeger's search."""
    if REQUEST_ID in request:
        response.headers["x-request-id"] = request[REQUEST_ID]
    if TRACE_ID in request:
        response.headers["x-trace-id"] = request[TRACE_ID]


class AccessLogger(AbstractAccessLogger):
    """One line per request, with the path only: a query string may hold secrets."""

    def log(self, request: web.BaseRequest, response: web.StreamResponse, time: float) -> None:
        self.logger.info(
            "%s %s %s %d %.1fms",
            request.remote,
            request.method,
            request.path,
            response.status,
            time * 1000,
        )
