"""``create_app(config)``: the gateway's routes, middlewares and shared objects."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from aiohttp import web

import telemetry
from gateway.accounts.admin import create_admin_app
from gateway.accounts.auth import auth_middleware
from gateway.accounts.keys import KeyStore
from gateway.accounts.limits import Limiter
from gateway.accounts.recent import recent_ctx, record_recent
from gateway.accounts.state import KEY_STORE, LIMITER, REDIS
from gateway.anthropic.message_batches import write_results
from gateway.batches.files import Files
from gateway.batches.records import BatchRecords
from gateway.batches.runner import BatchRunner
from gateway.batches.state import BATCH_RECORDS, BATCH_RUNNER, FILES
from gateway.batches.store import LocalDirectoryStore
from gateway.config import CONFIG, GatewayConfig
from gateway.console import create_console_app
from gateway.http.loopback import Loopback
from gateway.http.middleware import add_request_id, error_middleware, redact_query_keys
from gateway.http.openapi import serve_document
from gateway.http.ops import metrics_port
from gateway.http.state import API_PREFIXES, LOOPBACK
from gateway.mesh.client import MeshClient
from gateway.mesh.reasoning_formats import ReasoningFormats
from gateway.mesh.state import MESH, PROMPT_TOKENS, REASONING_FORMATS
from gateway.openai.batches import write_outputs
from gateway.routes import ADMIN, ANTHROPIC, OPENAI, OPS, add_routes, operations
from infermesh.prompt_tokens import PromptTokens
from infermesh.redis_client import redis_client
from infermesh.tasks import cancel_and_wait
from telemetry.metrics import watch_event_loop


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
    app[LOOPBACK] = Loopback()
    alias = config.server.alias_base
    app[API_PREFIXES] = ("/v1/", f"{alias}/") if alias else ("/v1/",)
    app.cleanup_ctx.append(_redis_ctx)
    app.cleanup_ctx.append(recent_ctx)
    app.cleanup_ctx.append(_mesh_ctx)
    app.cleanup_ctx.append(_batches_ctx)
    app.cleanup_ctx.append(metrics_port(config.metrics, reuse_port=config.server.processes > 1))
    app.on_startup.append(_watch_event_loop)
    app.on_response_prepare.append(add_request_id)
    for base in ("/v1", alias) if alias else ("/v1",):
        add_routes(app.router, OPENAI, base)
    for base in ("", alias) if alias else ("",):
        add_routes(app.router, ANTHROPIC, base)
    add_routes(app.router, OPS)
    serve_document(app, operations())
    admin_sha256 = config.admin.digest()
    admin = create_admin_app(admin_sha256)
    add_routes(admin.router, ADMIN)
    app.add_subapp("/admin", admin)
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
    if prompt_tokens is not None:
        prompt_tokens.learn()  # learnt before the first requests, which wait for it
    yield
    if prompt_tokens is not None:
        await prompt_tokens.close()
    await client.close()


async def _batches_ctx(app: web.Application) -> AsyncIterator[None]:
    """The files, the batches and this process's batch runner (``gateway.batches``)."""
    store = LocalDirectoryStore(app[CONFIG].files.directory)
    files = Files(app[REDIS], store)
    records = BatchRecords(app[REDIS], store)
    runner = BatchRunner(
        records,
        files,
        app[LOOPBACK],
        app[CONFIG].batches,
        {"openai": write_outputs, "anthropic": write_results},
    )
    app[FILES], app[BATCH_RECORDS], app[BATCH_RUNNER] = files, records, runner
    running = asyncio.create_task(runner.run())
    yield
    await cancel_and_wait(running)
