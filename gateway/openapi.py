"""``GET /openapi.json``: an OpenAPI 3.1 document of every route the gateway serves.

Built from the app's own router (a route whose handler this module does not describe is
left out, with a warning, and fails the test that compares the two) and from the pydantic models the
handlers validate with (request bodies, the usage query, the error shapes). The
OpenAI-compatible operations carry OpenAI's operation ids and paths as OpenAI's clients
call them: the base URL ``/v1`` (or the alias) plus ``/chat/completions`` and so on.
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

from gateway import admin
from gateway.anthropic_protocol import MessagesBody, MessagesRequest
from gateway.chat import create_chat_completion
from gateway.completions import create_completion
from gateway.completions_protocol import CompletionRequest
from gateway.errors import AnthropicErrorBody, ErrorBody
from gateway.messages import count_tokens, create_message
from gateway.models import list_models, retrieve_model
from gateway.openai_protocol import ChatCompletionRequest
from gateway.ops import health, metrics
from gateway.responses import (
    InputItemsQuery,
    RetrieveQuery,
    create_response,
    delete_response,
    list_input_items,
    retrieve_response,
)
from gateway.responses_protocol import ResponsesRequest

logger = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

_DOCUMENT = web.AppKey("openapi_document", dict)
_REF = "#/components/schemas/{model}"
_PATH_PARAM = re.compile(r"{(\w+)}")
_JSON = "application/json"
_SSE = "text/event-stream"
_API_KEY: list[dict[str, list[str]]] = [{"apiKey": []}]


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


def _operations() -> dict[Handler, Operation]:
    """What each handler does."""
    keys: tuple[dict[str, list[str]], ...] = ({"adminToken": []},)
    return {
        create_chat_completion: Operation(
            "createChatCompletion",
            "Creates a model response for the given chat conversation",
            "OpenAI",
            ChatCompletionRequest,
            streams=True,
            security=tuple(_API_KEY),
        ),
        create_completion: Operation(
            "createCompletion",
            "Creates a completion for the provided prompt (legacy)",
            "OpenAI",
            CompletionRequest,
            streams=True,
            security=tuple(_API_KEY),
        ),
        list_models: Operation(
            "listModels", "Lists the models the key may use", "OpenAI", security=tuple(_API_KEY)
        ),
        retrieve_model: Operation(
            "retrieveModel", "Describes one model", "OpenAI", security=tuple(_API_KEY)
        ),
        create_response: Operation(
            "createResponse",
            "Creates a model response (OpenAI's Responses API)",
            "OpenAI",
            ResponsesRequest,
            streams=True,
            security=tuple(_API_KEY),
        ),
        retrieve_response: Operation(
            "getResponse",
            "A stored response",
            "OpenAI",
            query=RetrieveQuery,
            security=tuple(_API_KEY),
        ),
        delete_response: Operation(
            "deleteResponse", "Deletes a stored response", "OpenAI", security=tuple(_API_KEY)
        ),
        list_input_items: Operation(
            "listInputItems",
            "The input items of a stored response",
            "OpenAI",
            query=InputItemsQuery,
            security=tuple(_API_KEY),
        ),
        create_message: Operation(
            "createMessage",
            "Creates a message (Anthropic's Messages API)",
            "Anthropic",
            MessagesRequest,
            streams=True,
            security=({"apiKey": []}, {"anthropicApiKey": []}),
            errors=AnthropicErrorBody,
        ),
        count_tokens: Operation(
            "countMessageTokens",
            "Counts a message's input tokens, as the message is billed (Anthropic's Messages API)",
            "Anthropic",
            MessagesBody,
            security=({"apiKey": []}, {"anthropicApiKey": []}),
            errors=AnthropicErrorBody,
        ),
        health: Operation("health", "Liveness of this gateway process", "Operations"),
        metrics: Operation(
            "metrics", "Prometheus metrics of this process", "Operations", success="text/plain"
        ),
        openapi_document: Operation("openapi", "This document", "Operations"),
        admin.create: Operation(
            "createKey",
            "Creates an API key (its plaintext is shown once)",
            "Admin",
            admin.KeyCreate,
            status=201,
            security=keys,
        ),
        admin.list_all: Operation("listKeys", "Lists the API keys", "Admin", security=keys),
        admin.get: Operation("getKey", "Describes an API key", "Admin", security=keys),
        admin.update: Operation(
            "updateKey",
            "Sets (or with null clears) fields of a key",
            "Admin",
            admin.KeyUpdate,
            security=keys,
        ),
        admin.disable: Operation("disableKey", "Disables a key", "Admin", security=keys),
        admin.revoke: Operation("revokeKey", "Revokes a key for good", "Admin", security=keys),
        admin.rotate: Operation(
            "rotateKey",
            "A new key with the same settings; the old one revoked",
            "Admin",
            status=201,
            security=keys,
        ),
        admin.usage: Operation(
            "getKeyUsage",
            "A key's usage: lifetime, per UTC day, quotas",
            "Admin",
            query=admin.UsageQuery,
            security=keys,
        ),
        admin.caller_usage: Operation(
            "getCallerUsage",
            "An internal gRPC caller's usage, by its certificate's identity",
            "Admin",
            query=admin.CallerUsageQuery,
            security=keys,
        ),
        admin.fleet: Operation(
            "listFleet",
            "The router's workers: models, GPU kind and count, precision, "
            "memory, max_parallel, load",
            "Admin",
            security=keys,
        ),
    }


# Set on a sub-application of pages for people (the console): no part of the API.
PAGES = web.AppKey("pages", bool)


def served_routes(app: web.Application) -> Iterator[tuple[str, str, Handler]]:
    """(method, path template, handler) of every route, sub-applications included but for
    pages (``PAGES``); HEAD, which aiohttp adds to every GET, is left out."""
    for resource in app.router.resources():
        if isinstance(resource, web.PrefixedSubAppResource):
            if not resource.get_info()["app"].get(PAGES, False):
                yield from served_routes(resource.get_info()["app"])
            continue
        for route in resource:
            if route.method != "HEAD":
                yield route.method, resource.canonical, route.handler


def build_document(app: web.Application) -> dict[str, Any]:
    operations = _operations()
    models = {m for op in operations.values() for m in (op.body, op.query, op.errors) if m}
    refs, definitions = models_json_schema([(m, "validation") for m in models], ref_template=_REF)
    paths: dict[str, dict[str, Any]] = {}
    ids: set[str] = set()
    # /v1 first: its operations get the plain ids, an alias's copies the numbered ones
    for method, path, handler in sorted(
        served_routes(app), key=lambda r: (not r[1].startswith("/v1/"), r[1], r[0])
    ):
        if handler not in operations:  # tests/gateway/test_openapi.py fails on it
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


async def publish_document(app: web.Application) -> None:
    """``on_startup``: built once, when every route is in place."""
    app[_DOCUMENT] = build_document(app)


async def openapi_document(request: web.Request) -> web.Response:
    return web.json_response(request.app[_DOCUMENT])
