"""Errors a client gets, and the one place they become OpenAI-shaped JSON.

Handlers raise a ``GatewayError`` subclass; the error middleware turns it into
``{"error": {"message", "type", "param", "code"}}`` with its status (and
``Retry-After`` when retrying later can succeed), or into Anthropic's
``{"type": "error", "error": {"type", "message"}}`` on the Anthropic routes. gRPC
failures from the router, Redis failures and aiohttp's own HTTP exceptions are
mapped here too. Messages never carry key material.
"""

from __future__ import annotations

import re
from typing import Any, Literal

import grpc
from aiohttp import web
from pydantic import BaseModel

from infermesh.context_limit import ContextOverflow, parse_overflow

Dialect = Literal["openai", "anthropic"]

# Anthropic names its error types by status.
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "request_too_large",
    414: "invalid_request_error",
    429: "rate_limit_error",
    431: "invalid_request_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(BaseModel):
    """OpenAI's error shape: every error the gateway answers outside /v1/messages."""

    error: ErrorDetail


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicErrorBody(BaseModel):
    """Anthropic's error shape: the errors of /v1/messages."""

    type: Literal["error"]
    error: AnthropicErrorDetail


class GatewayError(Exception):
    """An error answered to the client; ``retry_after_s`` set when it is recoverable."""

    status: int = 500
    type: str = "server_error"
    code: str | None = "internal_error"
    anthropic_status: int | None = None  # Anthropic's own status for this error, when it differs

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        retry_after_s: int | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        if type is not None:
            self.type = type
        self.retry_after_s = retry_after_s
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return ErrorBody(
            error=ErrorDetail(
                message=self.message, type=self.type, param=self.param, code=self.code
            )
        ).model_dump()

    def anthropic_body(self) -> dict[str, Any]:
        status = self.status_in("anthropic")
        return AnthropicErrorBody(
            type="error",
            error=AnthropicErrorDetail(
                type=_ANTHROPIC_TYPES.get(status, "api_error"), message=self.anthropic_message()
            ),
        ).model_dump()

    def anthropic_message(self) -> str:
        """The message in Anthropic's words, where its clients act on them."""
        return self.message

    def status_in(self, dialect: Dialect) -> int:
        if dialect == "anthropic" and self.anthropic_status is not None:
            return self.anthropic_status
        return self.status

    def dialect_body(self, dialect: Dialect) -> dict[str, Any]:
        return self.anthropic_body() if dialect == "anthropic" else self.body()


class InvalidRequestError(GatewayError):
    status, type, code = 400, "invalid_request_error", None


class ContextLengthError(InvalidRequestError):
    """The prompt, or the prompt and max_tokens, do not fit the model's context: in each API's
    words, which clients act on (OpenAI's code; Anthropic's message, infermesh.context_limit)."""

    def __init__(self, overflow: ContextOverflow) -> None:
        prompt, most, context = overflow
        if most is None:
            message = (
                f"This model's maximum context length is {context} tokens. However, your "
                f"messages resulted in {prompt} tokens. Please reduce the length of the messages."
            )
        else:
            message = (
                f"This model's maximum context length is {context} tokens. However, you "
                f"requested {prompt + most} tokens ({prompt} in the messages, {most} in the "
                "completion). Please reduce the length of the messages or completion."
            )
        super().__init__(message, param="messages", code="context_length_exceeded")
        self.overflow = overflow

    def anthropic_message(self) -> str:
        return self.overflow.message()


class AuthenticationError(GatewayError):
    status, type, code = 401, "invalid_request_error", "invalid_api_key"


class PermissionDeniedError(GatewayError):
    status, type, code = 403, "invalid_request_error", "model_not_allowed"


class NotFoundError(GatewayError):
    status, type, code = 404, "invalid_request_error", "unknown_url"


class ObjectNotFoundError(GatewayError):
    """An object (a stored response, a file, a batch) this key has no such id of, in OpenAI's
    words: another key's is not found either, never forbidden."""

    status, type, code = 404, "invalid_request_error", None


class ResponseNotFoundError(ObjectNotFoundError):
    """A stored response this key has no such id of (``gateway.openai.responses``)."""


class ModelNotFoundError(GatewayError):
    status, type, code = 404, "invalid_request_error", "model_not_found"


class MethodNotAllowedError(GatewayError):
    status, type, code = 405, "invalid_request_error", "method_not_allowed"


class RequestTooLargeError(GatewayError):
    status, type, code = 413, "invalid_request_error", "request_too_large"


class RequestTimeoutError(GatewayError):
    status, type, code = 408, "invalid_request_error", "request_timeout"


class UriTooLongError(GatewayError):
    status, type, code = 414, "invalid_request_error", "uri_too_long"


class HeadersTooLargeError(GatewayError):
    status, type, code = 431, "invalid_request_error", "headers_too_large"


class RateLimitError(GatewayError):
    status, type, code = 429, "rate_limit_error", "rate_limit_exceeded"


class OverloadedError(RateLimitError):
    """The mesh is busy (a worker's queue is full), not the key over its limits: Anthropic's
    clients retry a 529 overloaded_error."""

    anthropic_status = 529


class UpstreamError(GatewayError):
    status, type, code = 502, "server_error", "upstream_error"


class ServiceUnavailableError(GatewayError):
    status, type, code = 503, "server_error", "service_unavailable"


class NoCapacityError(ServiceUnavailableError):
    """No worker can take the request now."""

    anthropic_status = 529


class ClientTooSlowError(GatewayError):
    """The client read its stream so slowly that its request's buffer overflowed."""

    status, code = 500, "client_too_slow"


class UpstreamTimeoutError(GatewayError):
    status, type, code = 504, "server_error", "timeout"


def error_response(error: GatewayError, dialect: Dialect = "openai") -> web.Response:
    headers = dict(error.headers)
    if error.retry_after_s is not None:
        headers["Retry-After"] = str(error.retry_after_s)
    return web.json_response(
        error.dialect_body(dialect), status=error.status_in(dialect), headers=headers
    )


def store_unavailable(retry_after_s: int) -> GatewayError:
    """A Redis failure: without the key and limit store nobody is admitted, and
    nobody is told their key is wrong."""
    return ServiceUnavailableError(
        "The gateway cannot check API keys and limits right now; try again shortly",
        code="auth_unavailable",
        retry_after_s=retry_after_s,
    )


def base_url(request: web.Request) -> str:
    scheme = request.headers.get("X-Forwarded-Proto", request.scheme)
    return f"{scheme}://{request.host}/v1"


# RESOURCE_EXHAUSTED details of gRPC's transport limits ("received metadata size exceeds
# hard limit", "Received message larger than max (...)").
_GRPC_SIZE_LIMIT = re.compile(r"metadata size|larger than max", re.IGNORECASE)

_KNOWN_SUFFIXES = ("/chat/completions", "/completions", "/models", "/messages", "/responses")


def from_http_exception(exc: web.HTTPException, request: web.Request) -> GatewayError:
    """Maps aiohttp's routing and body-size exceptions to gateway errors."""
    where = f"{request.method} {request.path}"
    if exc.status == 404:
        hint = ""
        for suffix in _KNOWN_SUFFIXES:
            if suffix in request.path and not request.path.startswith(f"/v1{suffix}"):
                hint = f" Did you mean /v1{suffix}?"
                break
        return NotFoundError(
            f"Unknown URL ({where}). The base URL of this API is {base_url(request)}; "
            f"clients append paths such as /chat/completions to it.{hint}"
        )
    if exc.status == 405:
        allow = exc.headers.get("Allow", "")
        return MethodNotAllowedError(
            f"Method {request.method} is not allowed on {request.path}; allowed: {allow}",
            headers={"Allow": allow},
        )
    if exc.status == 413:
        return RequestTooLargeError("Request body is too large")
    if exc.status < 500:
        return InvalidRequestError(exc.reason, code=None)
    return GatewayError(exc.reason)


def from_grpc(
    code: grpc.StatusCode,
    details: str,
    *,
    router_reachable: bool,
    retry_after_s: int,
    from_workers: bool = False,
) -> GatewayError:
    """Maps a generation's gRPC status; ``router_reachable`` tells a router's own
    UNAVAILABLE (no worker now) from a connection that failed. ``from_workers``: the status is
    the workers' the router chose (``details`` name the worker), not the router's."""
    if code == grpc.StatusCode.NOT_FOUND:
        return ModelNotFoundError(details, param="model")
    if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE):
        overflow = parse_overflow(details)
        return InvalidRequestError(details) if overflow is None else ContextLengthError(overflow)
    if code == grpc.StatusCode.FAILED_PRECONDITION:  # the router's: no worker in that precision
        return InvalidRequestError(details, param="precision")
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and _GRPC_SIZE_LIMIT.search(details):
        # gRPC's own size limits, not a busy mesh: retrying the same request cannot succeed
        return RequestTooLargeError(
            "The request (or its answer) exceeds the mesh's gRPC message or metadata size limits"
        )
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return OverloadedError(details, retry_after_s=retry_after_s)
    if code == grpc.StatusCode.UNAVAILABLE and not router_reachable:
        return ServiceUnavailableError(
            "The inference router is unreachable; try again shortly",
            code="router_unavailable",
            retry_after_s=retry_after_s,
        )
    if code == grpc.StatusCode.UNAVAILABLE:
        return NoCapacityError(
            details or "No worker can take the request now", retry_after_s=retry_after_s
        )
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return UpstreamTimeoutError("The request took longer than the gateway's deadline")
    if from_workers:
        return UpstreamError(f"{details} ({code.name})")
    return UpstreamError(f"The inference router failed ({code.name})")
