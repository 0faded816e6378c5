"""The admin API for keys, mounted at ``/admin`` behind its own credential.

``Authorization: Bearer <admin token>``, compared by SHA-256 digest with
``[admin] token`` / ``token_sha256`` (``INFERMESH_GATEWAY_ADMIN_TOKEN[_SHA256]``);
with neither configured every call is refused. API keys are not admin
credentials, and the admin token is not an API key.

    POST   /admin/keys                 create: {name, expires_at?, models?, limits...,
                                       weight? (1-1000), tier?}
                                       -> 201 {key (the plaintext, shown once), ...record}
    GET    /admin/keys                 list
    GET    /admin/keys/{id}            get
    PATCH  /admin/keys/{id}            update: fields present are set, null clears
    POST   /admin/keys/{id}/disable    disable (PATCH {"disabled": false} enables again)
    POST   /admin/keys/{id}/revoke     revoke for good
    POST   /admin/keys/{id}/rotate     a new key with the same settings; the old one revoked
    GET    /admin/keys/{id}/usage?days=N  usage: lifetime, per UTC day, quota counters
    GET    /admin/callers/usage?identity=URI&days=N
                                       an internal gRPC caller's usage, counted by the router
                                       under its certificate's identity
                                       (spiffe://infermesh/client/NAME)
    GET    /admin/fleet                the router's workers: models, engine, GPU kind and count,
                                       precision, memory, max_parallel, speeds, load, ejected
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Annotated, Any

from aiohttp import web
from aiohttp.typedefs import Handler
from pydantic import BaseModel, ConfigDict, Field

from gateway.accounts import keys
from gateway.accounts.limits import read_usage
from gateway.accounts.state import ADMIN_SHA256, KEY_STORE, REDIS
from gateway.http.errors import (
    AuthenticationError,
    GatewayError,
    InvalidRequestError,
    NotFoundError,
)
from gateway.http.middleware import single_header
from gateway.http.validation import STRICT, parse_body, read_json
from gateway.mesh.state import MESH
from infermesh.authz import role_uri
from infermesh.names import precision_name
from infermesh.pb import router_pb2
from infermesh.redis_client import RedisClient
from infermesh.usage import identity_owner

_MAX_USAGE_DAYS = 400

Limit = Annotated[int, Field(ge=1, le=2**53)] | None


class _KeyFields(BaseModel):
    model_config = STRICT
    expires_at: Annotated[int, Field(ge=0)] | None = None
    models: list[Annotated[str, Field(min_length=1, max_length=256, pattern=r"^[^,]+$")]] | None = (
        None
    )
    rpm: Limit = None
    tpm: Limit = None
    max_concurrent: Limit = None
    quota_tokens: Limit = None
    quota_period_tokens: Limit = None
    quota_period_s: Limit = None
    # fair queueing when the fleet is full: the key's share, and its metrics' label
    weight: Annotated[int, Field(ge=1, le=1000)] | None = None
    tier: Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9_-]{0,31}$")] | None = None


class KeyCreate(_KeyFields):
    name: Annotated[str, Field(min_length=1, max_length=200)]


class KeyUpdate(_KeyFields):
    name: Annotated[str, Field(min_length=1, max_length=200)] | None = None
    disabled: bool | None = None


class UsageQuery(BaseModel):
    """The query of ``GET /admin/keys/{id}/usage``: strings, so not strict."""

    model_config = ConfigDict(extra="ignore")
    days: Annotated[int, Field(ge=1, le=_MAX_USAGE_DAYS)] = 7


class CallerUsageQuery(UsageQuery):
    """The query of ``GET /admin/callers/usage``: the caller's certificate identity."""

    identity: Annotated[str, Field(pattern=f"^{role_uri('client')}(/[^/]+)?$")]


class AdminDisabledError(GatewayError):
    status, type, code = 403, "invalid_request_error", "admin_disabled"


def create_admin_app(token_sha256: str | None) -> web.Application:
    """The sub-application behind the admin credential; its routes are in ``gateway.routes``."""
    app = web.Application(middlewares=[_require_admin])
    app[ADMIN_SHA256] = token_sha256 or ""
    return app


@web.middleware
async def _require_admin(request: web.Request, handler: Handler) -> web.StreamResponse:
    expected = request.app[ADMIN_SHA256]
    if not expected:
        raise AdminDisabledError(
            "The admin API is disabled: configure [admin] token_sha256 "
            "(INFERMESH_GATEWAY_ADMIN_SHA256)"
        )
    scheme, _, presented = (single_header(request, "Authorization") or "").partition(" ")
    digest = keys.key_id(presented.strip())
    if scheme.lower() != "bearer" or not hmac.compare_digest(digest, expected):
        raise AuthenticationError(
            "Missing or wrong admin token ('Authorization: Bearer ...')", code="invalid_admin_token"
        )
    return await handler(request)


def _redis(request: web.Request) -> RedisClient:
    return request.config_dict[REDIS]


async def create(request: web.Request) -> web.Response:
    body = parse_body(KeyCreate, await read_json(request))
    plaintext, record = await create_key(_redis(request), body)
    return web.json_response({"key": plaintext, **record.to_json()}, status=201)


async def list_all(request: web.Request) -> web.Response:
    records = await keys.list_keys(_redis(request))
    return web.json_response({"object": "list", "data": [r.to_json() for r in records]})


async def get(request: web.Request) -> web.Response:
    return web.json_response((await find_key(_redis(request), request.match_info["id"])).to_json())


async def update(request: web.Request) -> web.Response:
    body = parse_body(KeyUpdate, await read_json(request))
    record = await update_key(_redis(request), request.match_info["id"], body)
    return web.json_response(record.to_json())


async def disable(request: web.Request) -> web.Response:
    kid = request.match_info["id"]
    return web.json_response((await stop_key(request, kid, keys.disable_key)).to_json())


async def revoke(request: web.Request) -> web.Response:
    kid = request.match_info["id"]
    return web.json_response((await stop_key(request, kid, keys.revoke_key)).to_json())


async def rotate(request: web.Request) -> web.Response:
    plaintext, record = await rotate_key(request, request.match_info["id"])
    return web.json_response({"key": plaintext, **record.to_json()}, status=201)


# The key operations behind these routes, shared with the console (gateway.console): each
# answers the key's record as it is afterwards, or raises the GatewayError its route answers.


async def create_key(redis: RedisClient, body: KeyCreate) -> tuple[str, keys.KeyRecord]:
    """A new key: its plaintext (shown once) and its record."""
    values = body.model_dump(exclude={"name"}, exclude_none=True)
    plaintext = await keys.create_key(redis, body.name, **values)
    return plaintext, await find_key(redis, keys.key_id(plaintext))


async def update_key(redis: RedisClient, kid: str, body: KeyUpdate) -> keys.KeyRecord:
    """Sets the fields ``body`` holds; null clears a field (never the name or disabled)."""
    changes = {f: getattr(body, f) for f in body.model_fields_set}
    if changes.get("name", "") is None or changes.get("disabled", False) is None:
        raise InvalidRequestError("name and disabled cannot be cleared")
    if not changes:
        raise InvalidRequestError(f"Nothing to update; fields: {', '.join(keys.UPDATABLE_FIELDS)}")
    try:
        record = await keys.update_key(redis, kid, changes)
    except ValueError as e:
        raise InvalidRequestError(str(e), param="disabled") from None
    if record is None:
        raise _not_found(kid)
    return record


async def stop_key(
    request: web.Request, kid: str, stop: Callable[[RedisClient, str], Awaitable[bool]]
) -> keys.KeyRecord:
    """Disables or revokes (``stop``) the key ``kid``."""
    if not await stop(_redis(request), kid):
        raise _not_found(kid)
    request.config_dict[KEY_STORE].forget(kid)  # this process at once; the others at admission
    return await find_key(_redis(request), kid)


async def rotate_key(request: web.Request, kid: str) -> tuple[str, keys.KeyRecord]:
    """The new key replacing ``kid`` (revoked): its plaintext (shown once) and its record."""
    plaintext = await keys.rotate_key(_redis(request), kid)
    if plaintext is None:
        await find_key(_redis(request), kid)  # 404 when it does not exist
        raise InvalidRequestError("Only an enabled, unexpired, unrevoked key can be rotated")
    request.config_dict[KEY_STORE].forget(kid)
    return plaintext, await find_key(_redis(request), keys.key_id(plaintext))


async def usage(request: web.Request) -> web.Response:
    kid = request.match_info["id"]
    record = await find_key(_redis(request), kid)
    days = parse_body(UsageQuery, dict(request.query)).days
    counts: dict[str, Any] = await read_usage(_redis(request), kid, days)
    return web.json_response({"name": record.name, **counts})


async def caller_usage(request: web.Request) -> web.Response:
    query = parse_body(CallerUsageQuery, dict(request.query))
    counts = await read_usage(_redis(request), identity_owner(query.identity), query.days)
    # an API key's quota and concurrency counters: an internal caller has neither
    for field in ("quota_consumed_tokens", "quota_period_consumed_tokens", "in_flight"):
        del counts[field]
    return web.json_response({"identity": query.identity, **counts})


async def fleet(request: web.Request) -> web.Response:
    workers = await request.config_dict[MESH].list_workers()
    return web.json_response(
        {
            "object": "list",
            "data": [worker_json(w) for w in sorted(workers, key=lambda w: w.worker.worker_id)],
        }
    )


def worker_json(status: router_pb2.WorkerStatus) -> dict[str, Any]:
    info, caps, load = status.worker, status.worker.capabilities, status.load
    return {
        "worker_id": info.worker_id,
        "models": list(info.models),
        "engine": caps.engine,
        "reasoning_format": caps.reasoning_format,  # "": the model does not reason
        "gpu_kind": caps.gpu_kind,
        "gpu_count": caps.gpu_count,
        "device_name": caps.device_name,
        "precision": precision_name(caps.precision),
        "prefill_tokens_per_second": round(caps.prefill_tokens_per_second),
        "decode_tokens_per_second": round(caps.decode_tokens_per_second),
        "memory_total_bytes": caps.memory_total_bytes,
        "memory_used_bytes": load.memory_used_bytes,
        "weight_bytes": caps.weight_bytes,
        "max_parallel": caps.max_parallel,
        "running": load.running,
        "waiting": load.waiting,
        "kv_cache_usage": load.kv_cache_usage,
        "last_heartbeat_age_s": round(status.last_heartbeat_age_s, 3),
        "ejected": status.ejected,
    }


async def find_key(redis: RedisClient, kid: str) -> keys.KeyRecord:
    """The key's record; a 404 when there is none."""
    record = await keys.get_key(redis, kid)
    if record is None:
        raise _not_found(kid)
    return record


def _not_found(kid: str) -> NotFoundError:
    return NotFoundError(f"No API key with id '{kid[:64]}'", code="key_not_found", param="id")
