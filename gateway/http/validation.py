"""Reading and validating request bodies, shared by every endpoint.

Bodies are validated strictly (a string where a number belongs is a 400, not a
conversion); unknown top-level fields are ignored, as clients send fields this
gateway does not use. Every error names the offending field as a path into the
input (``messages.0.role``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from typing import Any, TypeVar

import orjson
from aiohttp import web
from pydantic import BaseModel, ConfigDict, ValidationError

from gateway.config import CONFIG
from gateway.http.errors import InvalidRequestError, RequestTimeoutError, RequestTooLargeError

STRICT = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)

# A \uD800-\uDFFF escape: JSON decodes an unpaired one into a str no encoder accepts.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")

M = TypeVar("M", bound=BaseModel)


async def read_json(request: web.Request) -> Any:
    """The decoded body; 413 past the size limit, 408 when it does not arrive in time, 400
    when it is not JSON or holds text no encoder accepts (an unpaired surrogate)."""
    raw = await _read(request)
    surrogates = _SURROGATE_ESCAPE.search(raw) is not None
    if not surrogates:
        with contextlib.suppress(orjson.JSONDecodeError):
            return orjson.loads(raw)  # the common case, fast; errors are worded below
    try:
        body = json.loads(raw, parse_constant=_reject_constant)
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
        raise InvalidRequestError(f"The request body is not valid JSON: {e}") from None
    except RecursionError:
        raise InvalidRequestError("The request body is nested too deeply") from None
    if surrogates:
        _reject_lone_surrogates(body)
    return body


async def _read(request: web.Request) -> bytes:
    server = request.config_dict[CONFIG].server
    limit = server.max_body_bytes
    too_large = RequestTooLargeError(f"The request body is larger than the limit of {limit} bytes")
    if request.content_length is not None and request.content_length > limit:
        raise too_large
    try:
        if request.content.is_eof():  # all here already (most bodies): nothing to time
            return await request.read()
        async with asyncio.timeout(server.body_timeout_s):
            return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise too_large from None
    except TimeoutError:
        raise RequestTimeoutError(
            f"The request body did not arrive within {server.body_timeout_s:g} s"
        ) from None
    except web.RequestPayloadError:
        raise InvalidRequestError(
            "The request body could not be read: its chunked framing or Content-Encoding is broken"
        ) from None


def _reject_lone_surrogates(body: Any) -> None:
    """A 400 naming the first string (or object key) holding an unpaired surrogate."""
    stack: list[tuple[str, Any]] = [("", body)]
    while stack:
        path, node = stack.pop()
        if isinstance(node, dict):
            for name, value in node.items():
                child = f"{path}.{name}" if path else name
                if not _encodable(name):
                    _surrogate_error(path)
                stack.append((child, value))
        elif isinstance(node, list):
            stack.extend((f"{path}.{i}" if path else str(i), v) for i, v in enumerate(node))
        elif isinstance(node, str) and not _encodable(node):
            _surrogate_error(path)


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _surrogate_error(path: str) -> None:
    where = f"'{path}'" if path else "the request body"
    raise InvalidRequestError(
        f"Invalid value for {where}: it holds an unpaired UTF-16 "
        f"surrogate escape (\\ud800-\\udfff), which is not text",
        param=path or None,
    )


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def parse_body(model: type[M], body: Any) -> M:
    """``body`` validated as ``model``; a 400 naming the first bad field otherwise."""
    if not isinstance(body, dict):
        raise InvalidRequestError("The request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise _invalid(e, body) from None
    except RecursionError:
        raise InvalidRequestError("The request body is nested too deeply") from None


def _invalid(error: ValidationError, body: dict[str, Any]) -> InvalidRequestError:
    # For a union (content, stop) pydantic reports one error per member; the
    # member that matched the input's shape went deepest or failed on more
    # than the type.
    errors = error.errors(include_url=False)
    first = _param(errors[0]["loc"], body)
    chosen = max(
        (e for e in errors if _param(e["loc"], body).startswith(first)),
        key=lambda e: (len(_param(e["loc"], body)), not e["type"].endswith("_type")),
    )
    param = _param(chosen["loc"], body)
    if chosen["type"] in ("union_tag_invalid", "union_tag_not_found"):  # a block's unknown "type"
        param += "." + chosen["ctx"]["discriminator"].strip("'")
    message = chosen["msg"].removeprefix("Value error, ")
    if chosen["type"] == "missing":
        return InvalidRequestError(f"Missing required parameter '{param}'", param=param)
    return InvalidRequestError(f"Invalid value for '{param}': {message}", param=param or None)


def _param(loc: tuple[int | str, ...], body: Any) -> str:
    """The loc as a path in the input ("messages.0.role"), without union member tags (a
    discriminated union's tag, such as 'function_call', is not a key of its object)."""
    parts: list[str] = []
    node = body
    for i, item in enumerate(loc):
        # a key the input lacks is a union member's tag, unless it is the last (a missing field)
        if isinstance(node, dict) and isinstance(item, str) and (item in node or i == len(loc) - 1):
            parts.append(item)
            node = node.get(item)
        elif isinstance(node, list) and isinstance(item, int) and item < len(node):
            parts.append(str(item))
            node = node[item]
        # else: a union member's tag such as 'str' or 'list[TextPart]'
    return ".".join(parts)


def estimate_tokens(text: str) -> int:
    """A prompt's token count before the worker tokenizes it (about 4 characters a
    token): what admission reserves, settled to the real count later."""
    return len(text) // 4 + 1


def refuse_fields(body: dict[str, Any], names: tuple[str, ...]) -> None:
    """A 400 naming the first of ``names`` the body sets: fields an endpoint does not implement,
    which ignoring would answer something other than what was asked."""
    for name in names:
        if body.get(name) is not None:
            raise InvalidRequestError(f"'{name}' is not supported by this server", param=name)
