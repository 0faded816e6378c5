"""``create_app(config)``: the gateway's routes, middlewares and shared objects."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from aiohttp import web

import telemetry
from gateway.admin import create_admin_app
from gateway.chat import create_chat_completion
from gateway.completions import create_completion
from gateway.config import GatewayConfig
from gateway.console import create_console_app
from gateway.generation import LIMITS_CONFIG, MODELS_CONFIG
from gateway.keys import REDIS, KeyStore
from gateway.limits import LIMITER, Limiter
from gateway.mesh_client import MESH, MeshClient
from gateway.messages import count_tokens, create_message
from gateway.middleware import (
    API_PREFIXES,
    KEY_STORE,
    REDIS_CONFIG,
    add_request_id,
    auth_middleware,
    error_middleware,
    redact_query_keys,
)
from gateway.models import list_models, retrieve_model
from gateway.openapi import openapi_document, publish_document
from gateway.ops import health, metrics, metrics_port
from gateway.prompt_tokens import PROMPT_TOKENS, PromptTokens
from gateway.reasoning import REASONING_FORMATS, ReasoningFormats
from gateway.recent import CONSOLE_CONFIG, recent_ctx, record_recent
from gateway.responses import (
    create_response,
    delete_response,
    list_input_items,
    retrieve_response,
)
from gateway.responses_store import RESPONSES_CONFIG
from gateway.validation import SERVER_CONFIG
from infermesh.redis_client import redis_client
from infermesh.tasks import cancel_and_wait
from telemetry.metrics import watch_event_loop

CONFIG = web.AppKey("config", GatewayConfig)


def create_app(config: GatewayConfig) -> web.Application:
    app = web.Application(
        client_max_size=config.server.max_body_bytes,
        middlewares=[
            redact_query_keys,
            *telemetry.aiohttp_middlewares(),
            record_recent,
            error_middleware,
            auth_middleware,
        ],
    )
    app[CONFIG] = config
    app[SERVER_CONFIG] = config.server
    app[REDIS_CONFIG] = config.redis
    app[LIMITS_CONFIG] = config.limits
    app[MODELS_CONFIG] = config.models
    app[RESPONSES_CONFIG] = config.responses
    app[CONSOLE_CONFIG] = config.console
    alias = config.server.alias_base
    app[API_PREFIXES] = ("/v1/", f"{alias}/") if alias else ("/v1/",)
    app.cleanup_ctx.append(_redis_ctx)
    app.cleanup_ctx.append(recent_ctx)
    app.cleanup_ctx.append(_mesh_ctx)
    app.cleanup_ctx.append(metrics_port(config.metrics, reuse_port=config.server.processes > 1))
    app.on_startup.append(_watch_event_loop)
    app.on_response_prepare.append(add_request_id)
    app.on_startup.append(publish_document)
    for base in ("/v1", alias) if alias else ("/v1",):
        app.router.add_post(f"{base}/chat/completions", create_chat_completion)
        app.router.add_post(f"{base}/completions", create_completion)
        app.router.add_get(f"{base}/models", list_models)
        app.router.add_get(f"{base}/models/{{model:.+}}", retrieve_model)  # ids may hold slashes
        app.router.add_post(f"{base}/responses", create_response)
        app.router.add_get(f"{base}/responses/{{response_id}}", retrieve_response)
        app.router.add_delete(f"{base}/responses/{{response_id}}", delete_response)
        app.router.add_get(f"{base}/responses/{{response_id}}/input_items", list_input_items)
    # Anthropic clients append /v1/messages to their base URL, the alias included.
    for base in ("", alias) if alias else ("",):
        app.router.add_post(f"{base}/v1/messages", create_message)
        app.router.add_post(f"{base}/v1/messages/count_tokens", count_tokens)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/openapi.json", openapi_document)
    admin_sha256 = config.admin.digest()
    app.add_subapp("/admin", create_admin_app(admin_sha256))
    if admin_sha256:  # the operator's console: on the admin gateway only
        app.add_subapp("/console", create_console_app(admin_sha256))
    return app


async def _watch_event_loop(app: web.Application) -> None:
    watch_event_loop(asyncio.get_running_loop())


async def _redis_ctx(app: web.Application) -> AsyncIterator[None]:
    config = app[CONFIG]
    # A blocking pool (one server, Sentinel): with every connection busy a request waits its
    # turn (up to timeout_s) where redis-py's default pool fails it at once, which would
    # answer 503 under load. redis-py retries a call on a new connection when one fails:
    # after a Redis restart the pool still holds connections to the old process.
    client = redis_client(
        config.redis.url,
        timeout_s=config.redis.timeout_s,
        max_connections=config.redis.max_connections,
    )
    app[REDIS] = client
    app[KEY_STORE] = KeyStore(client, cache_ttl_s=config.redis.key_cache_ttl_s)
    limiter = Limiter(
        client,
        lease_ttl_s=config.limits.lease_ttl_s,
        settle_retry_max=config.limits.settle_retry_max,
    )
    app[LIMITER] = limiter
    renewal = asyncio.create_task(limiter.renew_leases())
    retries = asyncio.create_task(limiter.retry_settlements())
    yield
    await cancel_and_wait(renewal)
    await cancel_and_wait(retries)
    await limiter.drain()
    await client.aclose()


async def _mesh_ctx(app: web.Application) -> AsyncIterator[None]:
    client = MeshClient(app[CONFIG].router, app[CONFIG].tls)
    app[MESH] = client
    app[REASONING_FORMATS] = ReasoningFormats(client)
    prompt_tokens = (
        PromptTokens(client, app[CONFIG].router.tokenizer_refresh_s)
        if app[CONFIG].router.prompt_tokens
        else None
    )
    app[PROMPT_TOKENS] = prompt_tokens
    yield
    if prompt_tokens is not None:
        await prompt_tokens.close()
    await client.close()
