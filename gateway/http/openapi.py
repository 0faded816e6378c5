"""``GET /openapi.json``: an OpenAPI 3.1 document of every route the gateway serves.

Built from the app's own router, the route table's description of each handler
(``gateway.routes``; a route added past the table is left out, with a warning, and fails the
test that compares the two) and the pydantic models the handlers validate with (request bodies,
the usage query, the error shapes). The OpenAI-compatible operations carry OpenAI's operation
ids and paths as OpenAI's clients call them: the base URL ``/v1`` (or the alias) plus
``/chat/completions`` and so on.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Awaitable, Callable, Iterator, Mapping
from typing import Any

from aiohttp import web
from pydantic import BaseModel
from pydantic.json_schema import JsonSchemaMode, JsonSchemaValue, models_json_schema

from gateway.http.errors import ErrorBody

logger = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

_DOCUMENT = web.AppKey[dict[str, Any]]("openapi_document")
_REF = "#/components/schemas/{model}"
_PATH_PARAM = re.compile(r"{(\w+)}")
_JSON = "application/json"
_SSE = "text/event-stream"


@dataclasses.dataclass(frozen=True)
class Operation:
    operation_id: str
    summary: str
    tag: str
    body: type[BaseModel] | None = None
    query: type[BaseModel] | None = None
    status: int = 200
    success: str = _JSON  # the media type of the answer
    streams: bool = False  # "stream": true answers server-sent events
    security: tuple[dict[str, list[str]], ...] = ()
    errors: type[BaseModel] = ErrorBody


# This module's own slots of the app (no other module reads them): what each handler does
# (gateway.routes), and the mark of a sub-application of pages for people (the console).
_OPERATIONS = web.AppKey[dict[Handler, Operation]]("openapi_operations")
_PAGES = web.AppKey[bool]("pages")


def served_routes(app: web.Application) -> Iterator[tuple[str, str, Handler]]:
    """(method, path template, handler) of every route, sub-applications included but for
    pages (``mark_pages``); HEAD, which aiohttp adds to every GET, is left out."""
    for resource in app.router.resources():
        if isinstance(resource, web.PrefixedSubAppResource):
            if not resource.get_info()["app"].get(_PAGES, False):
                yield from served_routes(resource.get_info()["app"])
            continue
        for route in resource:
            if route.method != "HEAD":
                yield route.method, resource.canonical, route.handler


def build_document(app: web.Application, operations: dict[Handler, Operation]) -> dict[str, Any]:
    models = {m for op in operations.values() for m in (op.body, op.query, op.errors) if m}
    refs, definitions = models_json_schema([(m, "validation") for m in models], ref_template=_REF)
    paths: dict[str, dict[str, Any]] = {}
    ids: set[str] = set()
    # /v1 first: its operations get the plain ids, an alias's copies the numbered ones
    for method, path, handler in sorted(
        served_routes(app), key=lambda r: (not r[1].startswith("/v1/"), r[1], r[0])
    ):
        if handler not in operations:  # tests/gateway/http/test_openapi.py fails on it
            logger.warning("%s %s is not described in the OpenAPI document", method, path)
            continue
        operation = operations[handler]
        entry = _operation(operation, path, refs)
        entry["operationId"] = _unique(operation.operation_id, ids)
        paths.setdefault(path, {})[method.lower()] = entry
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "infermesh gateway",
            "version": "1",
            "description": "An OpenAI-compatible API (base URL /v1) and Anthropic's "
            "Messages API over the mesh's models, and the admin API for "
            "API keys.",
        },
        "paths": paths,
        "components": {
            "schemas": definitions.get("$defs", {}),
            "securitySchemes": {
                "apiKey": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "An API key: 'Authorization: Bearer sk-...'",
                },
                "anthropicApiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"},
                "adminToken": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "The admin token ([admin] token)",
                },
            },
        },
    }


def _operation(
    operation: Operation, path: str, refs: Mapping[tuple[Any, JsonSchemaMode], JsonSchemaValue]
) -> dict[str, Any]:
    success: dict[str, Any] = {
        operation.success: {"schema": {} if operation.success != _JSON else {"type": "object"}}
    }
    if operation.streams:  # with "stream": true
        success[_SSE] = {"schema": {"type": "string"}}
    entry: dict[str, Any] = {
        "summary": operation.summary,
        "tags": [operation.tag],
        "parameters": [
            {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
            for name in _PATH_PARAM.findall(path)
        ],
        "responses": {
            str(operation.status): {"description": "Success", "content": success},
            "default": {
                "description": "An error",
                "content": {_JSON: {"schema": refs[(operation.errors, "validation")]}},
            },
        },
        "security": list(operation.security),
    }
    if operation.query is not None:
        schema = operation.query.model_json_schema()
        entry["parameters"] += [
            {
                "name": name,
                "in": "query",
                "required": name in schema.get("required", []),
                "schema": field,
            }
            for name, field in schema["properties"].items()
        ]
    if operation.body is not None:
        entry["requestBody"] = {
            "required": True,
            "content": {_JSON: {"schema": refs[(operation.body, "validation")]}},
        }
    return entry


def _unique(operation_id: str, taken: set[str]) -> str:
    """The id; an alias base path's copy of an operation gets a numbered one."""
    candidate, n = operation_id, 1
    while candidate in taken:
        n += 1
        candidate = f"{operation_id}{n}"
    taken.add(candidate)
    return candidate


def serve_document(app: web.Application, operations: dict[Handler, Operation]) -> None:
    """Builds ``app``'s document from ``operations`` at start-up, once every route is in place,
    for ``openapi_document`` to serve."""
    app[_OPERATIONS] = operations
    app.on_startup.append(_publish_document)


def mark_pages(app: web.Application) -> None:
    """Leaves the sub-application ``app`` (pages for people) out of the document."""
    app[_PAGES] = True


async def _publish_document(app: web.Application) -> None:
    app[_DOCUMENT] = build_document(app, app[_OPERATIONS])


async def openapi_document(request: web.Request) -> web.Response:
    return web.json_response(request.app[_DOCUMENT])
