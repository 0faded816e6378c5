"""Every route of the gateway, in one table: its method, path and handler, and how the OpenAPI
document (``gateway.http.openapi``) describes it. ``create_app`` adds the routes from it, and
the document describes the routes served with it."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from aiohttp import web

from gateway.accounts import admin
from gateway.anthropic import message_batches
from gateway.anthropic.messages import count_tokens, create_message
from gateway.anthropic.messages_protocol import MessagesBody, MessagesRequest
from gateway.http.errors import AnthropicErrorBody
from gateway.http.openapi import Handler, Operation, openapi_document
from gateway.http.ops import health, metrics
from gateway.openai import batches, files
from gateway.openai.chat import create_chat_completion
from gateway.openai.chat_protocol import ChatCompletionRequest
from gateway.openai.completions import create_completion
from gateway.openai.completions_protocol import CompletionRequest
from gateway.openai.models import list_models, retrieve_model
from gateway.openai.responses import (
    InputItemsQuery,
    RetrieveQuery,
    create_response,
    delete_response,
    list_input_items,
    retrieve_response,
)
from gateway.openai.responses_protocol import ResponsesRequest
from gateway.openai.responses_socket import responses_socket


@dataclasses.dataclass(frozen=True)
class Route:
    method: str
    path: str  # under each base path of its table
    handler: Handler
    operation: Operation


_API_KEY: tuple[dict[str, list[str]], ...] = ({"apiKey": []},)
_ANTHROPIC_KEYS: tuple[dict[str, list[str]], ...] = ({"apiKey": []}, {"anthropicApiKey": []})
_ADMIN_TOKEN: tuple[dict[str, list[str]], ...] = ({"adminToken": []},)

# Under OpenAI's base URL: /v1, and the alias ([server] alias_base) when there is one.
OPENAI = (
    Route(
        "POST",
        "/chat/completions",
        create_chat_completion,
        Operation(
            "createChatCompletion",
            "Creates a model response for the given chat conversation",
            "OpenAI",
            ChatCompletionRequest,
            streams=True,
            security=_API_KEY,
        ),
    ),
    Route(
        "POST",
        "/completions",
        create_completion,
        Operation(
            "createCompletion",
            "Creates a completion for the provided prompt (legacy)",
            "OpenAI",
            CompletionRequest,
            streams=True,
            security=_API_KEY,
        ),
    ),
    Route(
        "GET",
        "/models",
        list_models,
        Operation("listModels", "Lists the models the key may use", "OpenAI", security=_API_KEY),
    ),
    Route(
        "GET",
        "/models/{model:.+}",  # ids may hold slashes
        retrieve_model,
        Operation("retrieveModel", "Describes one model", "OpenAI", security=_API_KEY),
    ),
    Route(
        "POST",
        "/responses",
        create_response,
        Operation(
            "createResponse",
            "Creates a model response (OpenAI's Responses API)",
            "OpenAI",
            ResponsesRequest,
            streams=True,
            security=_API_KEY,
        ),
    ),
    Route(
        "GET",
        "/responses",
        responses_socket,
        Operation(
            "createResponseSocket",
            "The Responses API over WebSocket: response.create messages in, each response's "
            "stream events out on the same socket",
            "OpenAI",
            security=_API_KEY,
        ),
    ),
    Route(
        "GET",
        "/responses/{response_id}",
        retrieve_response,
        Operation(
            "getResponse", "A stored response", "OpenAI", query=RetrieveQuery, security=_API_KEY
        ),
    ),
    Route(
        "DELETE",
        "/responses/{response_id}",
        delete_response,
        Operation("deleteResponse", "Deletes a stored response", "OpenAI", security=_API_KEY),
    ),
    Route(
        "GET",
        "/responses/{response_id}/input_items",
        list_input_items,
        Operation(
            "listInputItems",
            "The input items of a stored response",
            "OpenAI",
            query=InputItemsQuery,
            security=_API_KEY,
        ),
    ),
    Route(
        "POST",
        "/files",
        files.upload_file,
        Operation(
            "createFile",
            "Uploads a file (multipart: 'file' and 'purpose', 'batch' for a batch's input)",
            "OpenAI",
            security=_API_KEY,
        ),
    ),
    Route(
        "GET",
        "/files",
        files.list_files,
        Operation(
            "listFiles",
            "Lists the key's files",
            "OpenAI",
            query=files.FileListQuery,
            security=_API_KEY,
        ),
    ),
    Route(
        "GET",
        "/files/{file_id}",
        files.retrieve_file,
        Operation("retrieveFile", "Describes a file", "OpenAI", security=_API_KEY),
    ),
    Route(
        "DELETE",
        "/files/{file_id}",
        files.delete_file,
        Operation("deleteFile", "Deletes a file", "OpenAI", security=_API_KEY),
    ),
    Route(
        "GET",
        "/files/{file_id}/content",
        files.file_content,
        Operation(
            "downloadFile",
            "A file's bytes",
            "OpenAI",
            success="application/octet-stream",
            security=_API_KEY,
        ),
    ),
    Route(
        "POST",
        "/batches",
        batches.create_batch,
        Operation(
            "createBatch",
            "Creates a batch of requests from an uploaded JSONL file (OpenAI's Batch API)",
            "OpenAI",
            batches.BatchCreate,
            security=_API_KEY,
        ),
    ),
    Route(
        "GET",
        "/batches",
        batches.list_batches,
        Operation(
            "listBatches",
            "Lists the key's batches, newest first",
            "OpenAI",
            query=batches.BatchListQuery,
            security=_API_KEY,
        ),
    ),
    Route(
        "GET",
        "/batches/{batch_id}",
        batches.retrieve_batch,
        Operation("retrieveBatch", "Describes a batch", "OpenAI", security=_API_KEY),
    ),
    Route(
        "POST",
        "/batches/{batch_id}/cancel",
        batches.cancel_batch,
        Operation(
            "cancelBatch",
            "Cancels a batch: no new lines start; those running finish",
            "OpenAI",
            security=_API_KEY,
        ),
    ),
)

# Anthropic's clients append /v1/messages to their base URL: under "", and the alias.
ANTHROPIC = (
    Route(
        "POST",
        "/v1/messages",
        create_message,
        Operation(
            "createMessage",
            "Creates a message (Anthropic's Messages API)",
            "Anthropic",
            MessagesRequest,
            streams=True,
            security=_ANTHROPIC_KEYS,
            errors=AnthropicErrorBody,
        ),
    ),
    Route(
        "POST",
        "/v1/messages/count_tokens",
        count_tokens,
        Operation(
            "countMessageTokens",
            "Counts a message's input tokens, as the message is billed (Anthropic's Messages API)",
            "Anthropic",
            MessagesBody,
            security=_ANTHROPIC_KEYS,
            errors=AnthropicErrorBody,
        ),
    ),
    Route(
        "POST",
        "/v1/messages/batches",
        message_batches.create_message_batch,
        Operation(
            "createMessageBatch",
            "Creates a batch of Messages requests (Anthropic's Message Batches API)",
            "Anthropic",
            message_batches.MessageBatchCreate,
            security=_ANTHROPIC_KEYS,
            errors=AnthropicErrorBody,
        ),
    ),
    Route(
        "GET",
        "/v1/messages/batches",
        message_batches.list_message_batches,
        Operation(
            "listMessageBatches",
            "Lists the key's message batches, newest first",
            "Anthropic",
            query=message_batches.MessageBatchListQuery,
            security=_ANTHROPIC_KEYS,
            errors=AnthropicErrorBody,
        ),
    ),
    Route(
        "GET",
        "/v1/messages/batches/{batch_id}",
        message_batches.retrieve_message_batch,
        Operation(
            "retrieveMessageBatch",
            "Describes a message batch",
            "Anthropic",
            security=_ANTHROPIC_KEYS,
            errors=AnthropicErrorBody,
        ),
    ),
    Route(
        "POST",
        "/v1/messages/batches/{batch_id}/cancel",
        message_batches.cancel_message_batch,
        Operation(
            "cancelMessageBatch",
            "Cancels a message batch: no new requests start; those running finish",
            "Anthropic",
            security=_ANTHROPIC_KEYS,
            errors=AnthropicErrorBody,
        ),
    ),
    Route(
        "GET",
        "/v1/messages/batches/{batch_id}/results",
        message_batches.message_batch_results,
        Operation(
            "messageBatchResults",
            "An ended message batch's results, one JSON line per request",
            "Anthropic",
            success="application/binary",
            security=_ANTHROPIC_KEYS,
            errors=AnthropicErrorBody,
        ),
    ),
)

# At the gateway's root.
OPS = (
    Route(
        "GET",
        "/health",
        health,
        Operation("health", "Liveness of this gateway process", "Operations"),
    ),
    Route(
        "GET",
        "/metrics",
        metrics,
        Operation(
            "metrics", "Prometheus metrics of this process", "Operations", success="text/plain"
        ),
    ),
    Route(
        "GET",
        "/openapi.json",
        openapi_document,
        Operation("openapi", "This document", "Operations"),
    ),
)

# Under /admin: the admin API's sub-application (gateway.accounts.admin), with its own credential.
ADMIN = (
    Route(
        "POST",
        "/keys",
        admin.create,
        Operation(
            "createKey",
            "Creates an API key (its plaintext is shown once)",
            "Admin",
            admin.KeyCreate,
            status=201,
            security=_ADMIN_TOKEN,
        ),
    ),
    Route(
        "GET",
        "/keys",
        admin.list_all,
        Operation("listKeys", "Lists the API keys", "Admin", security=_ADMIN_TOKEN),
    ),
    Route(
        "GET",
        "/keys/{id}",
        admin.get,
        Operation("getKey", "Describes an API key", "Admin", security=_ADMIN_TOKEN),
    ),
    Route(
        "PATCH",
        "/keys/{id}",
        admin.update,
        Operation(
            "updateKey",
            "Sets (or with null clears) fields of a key",
            "Admin",
            admin.KeyUpdate,
            security=_ADMIN_TOKEN,
        ),
    ),
    Route(
        "POST",
        "/keys/{id}/disable",
        admin.disable,
        Operation("disableKey", "Disables a key", "Admin", security=_ADMIN_TOKEN),
    ),
    Route(
        "POST",
        "/keys/{id}/revoke",
        admin.revoke,
        Operation("revokeKey", "Revokes a key for good", "Admin", security=_ADMIN_TOKEN),
    ),
    Route(
        "POST",
        "/keys/{id}/rotate",
        admin.rotate,
        Operation(
            "rotateKey",
            "A new key with the same settings; the old one revoked",
            "Admin",
            status=201,
            security=_ADMIN_TOKEN,
        ),
    ),
    Route(
        "GET",
        "/keys/{id}/usage",
        admin.usage,
        Operation(
            "getKeyUsage",
            "A key's usage: lifetime, per UTC day, quotas",
            "Admin",
            query=admin.UsageQuery,
            security=_ADMIN_TOKEN,
        ),
    ),
    Route(
        "GET",
        "/callers/usage",
        admin.caller_usage,
        Operation(
            "getCallerUsage",
            "An internal gRPC caller's usage, by its certificate's identity",
            "Admin",
            query=admin.CallerUsageQuery,
            security=_ADMIN_TOKEN,
        ),
    ),
    Route(
        "GET",
        "/fleet",
        admin.fleet,
        Operation(
            "listFleet",
            "The router's workers: models, GPU kind and count, precision, "
            "memory, max_parallel, load",
            "Admin",
            security=_ADMIN_TOKEN,
        ),
    ),
)


def add_routes(router: web.UrlDispatcher, routes: Iterable[Route], base: str = "") -> None:
    for route in routes:
        if route.method == "GET":  # and HEAD, as aiohttp adds it
            router.add_get(base + route.path, route.handler)
        else:
            router.add_route(route.method, base + route.path, route.handler)


def operations() -> dict[Handler, Operation]:
    """What each handler does, for the OpenAPI document."""
    return {route.handler: route.operation for route in (*OPENAI, *ANTHROPIC, *OPS, *ADMIN)}
