"""``create_app(config)``: the gateway's routes, middlewares and shared objects."""
from __future__ import annotations

from collections.abc import AsyncIterator

import redis.asyncio as redis
from aiohttp import web

import telemetry
from gateway.chat import MAX_BODY_BYTES, create_chat_completion
from gateway.config import GatewayConfig
from gateway.keys import KeyStore
from gateway.middleware import (KEY_STORE, REDIS_RETRY_AFTER_S, add_request_id, auth_middleware,
                                error_middleware, redact_query_keys)
from gateway.models import list_models, retrieve_model
from gateway.router_client import ROUTER, RouterClient

CONFIG = web.AppKey("config", GatewayConfig)
REDIS = web.AppKey("redis", redis.Redis)


def create_app(config: GatewayConfig) -> web.Application:
    app = web.Application(
        client_max_size=config.server.max_body_bytes,
        middlewares=[redact_query_keys, telemetry.aiohttp_middleware(), error_middleware,
                     auth_middleware])
    app[CONFIG] = config
    app[MAX_BODY_BYTES] = config.server.max_body_bytes
    app[REDIS_RETRY_AFTER_S] = config.redis.retry_after_s
    app.cleanup_ctx.append(_redis_ctx)
    app.cleanup_ctx.append(_router_ctx)
    app.on_response_prepare.append(add_request_id)
    app.router.add_post("/v1/chat/completions", create_chat_completion)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model:.+}", retrieve_model)  # ids may hold slashes
    app.router.add_get("/health", health)
    return app


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def _redis_ctx(app: web.Application) -> AsyncIterator[None]:
    config = app[CONFIG].redis
    client = redis.Redis.from_url(config.url, socket_timeout=config.timeout_s,
                                  socket_connect_timeout=config.timeout_s)
    app[REDIS] = client
    app[KEY_STORE] = KeyStore(client, cache_ttl_s=config.key_cache_ttl_ms / 1000)
    yield
    await client.aclose()


async def _router_ctx(app: web.Application) -> AsyncIterator[None]:
    client = RouterClient(app[CONFIG].router)
    app[ROUTER] = client
    yield
    await client.close()
