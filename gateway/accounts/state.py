"""The accounts' app and request keys: Redis and what lives in it (keys, limits), the admin
credential, and what a request's authentication and settlement put on it."""

from __future__ import annotations

from aiohttp import web

from gateway.accounts.keys import ApiKey, KeyStore
from gateway.accounts.limits import Limiter
from gateway.accounts.usage import TokenUsage
from infermesh.redis_client import RedisClient

REDIS = web.AppKey[RedisClient]("redis")
KEY_STORE = web.AppKey[KeyStore]("key_store")
LIMITER = web.AppKey[Limiter]("limiter")
# The admin token's SHA-256 the admin API and the console check ("": the admin API is off).
ADMIN_SHA256 = web.AppKey[str]("admin_sha256")
API_KEY = web.RequestKey[ApiKey]("api_key")  # the request's key, once authenticated
USAGE = web.RequestKey[TokenUsage]("usage")  # the request's token usage, once settled
FIRST_TOKEN_S = web.RequestKey[float]("first_token_s")  # seconds to its first token
