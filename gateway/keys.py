"""API keys: created once, stored in Redis only as a SHA-256 hash.

Redis layout: one hash per key, ``infermesh:key:<sha256 hex of the key>`` with
fields ``name``, ``created`` (unix seconds), ``disabled`` ("0"/"1") and
optionally ``expires`` (unix seconds). The hex digest doubles as the key's id
for operators; the plaintext exists only in the answer to ``create_key``.
"""
from __future__ import annotations

import dataclasses
import hashlib
import secrets
import time
from collections.abc import Callable

import redis.asyncio as redis

_KEY_PREFIX = "infermesh:key:"
_PLAINTEXT_PREFIX = "sk-"
_RANDOM_BYTES = 32  # 256 bits
_CACHE_MAX_ENTRIES = 10_000


def key_id(plaintext: str) -> str:
    """The key's stable id: SHA-256 hex of the plaintext."""
    return hashlib.sha256(plaintext.encode()).hexdigest()


def _redis_key(kid: str) -> str:
    return f"{_KEY_PREFIX}{kid}"


async def create_key(redis: redis.Redis, name: str, *, expires: float | None = None) -> str:
    """Stores a new key's hash under ``name`` and returns the plaintext, the only time it exists."""
    plaintext = _PLAINTEXT_PREFIX + secrets.token_urlsafe(_RANDOM_BYTES)
    fields = {"name": name, "created": str(int(time.time())), "disabled": "0"}
    if expires is not None:
        fields["expires"] = str(int(expires))
    await redis.hset(_redis_key(key_id(plaintext)), mapping=fields)
    return plaintext


async def disable_key(redis: redis.Redis, kid: str) -> bool:
    """Marks the key with id ``kid`` disabled; False when no such key exists."""
    if not await redis.exists(_redis_key(kid)):
        return False
    await redis.hset(_redis_key(kid), "disabled", "1")
    return True


@dataclasses.dataclass(frozen=True)
class ApiKey:
    """An authenticated key, as handlers see it: never the plaintext."""
    id: str
    name: str


class KeyStore:
    """Authenticates presented keys against Redis, once per request.

    Only successes are cached, for ``cache_ttl_s``, so a new key works at once
    and a revoked one stops within the TTL. Redis errors propagate: the caller
    answers 503, never 401 and never admits.
    """

    def __init__(self, redis: redis.Redis, cache_ttl_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._redis = redis
        self._cache_ttl_s = cache_ttl_s
        self._clock = clock
        self._cache: dict[str, tuple[ApiKey, float]] = {}

    async def authenticate(self, presented: str) -> ApiKey | None:
        """The key's record when ``presented`` is a known, enabled, unexpired key, else None."""
        kid = key_id(presented)
        now = self._clock()
        cached = self._cache.get(kid)
        if cached is not None and cached[1] > now:
            return cached[0]
        fields = await self._redis.hgetall(_redis_key(kid))
        key = _valid_key(kid, fields)
        if key is None:
            self._cache.pop(kid, None)
        elif self._cache_ttl_s > 0:
            if len(self._cache) >= _CACHE_MAX_ENTRIES:
                self._cache = {k: v for k, v in self._cache.items() if v[1] > now}
            self._cache[kid] = (key, now + self._cache_ttl_s)
        return key

    def forget(self, kid: str) -> None:
        """Drops a cached success, e.g. right after this process revoked the key."""
        self._cache.pop(kid, None)


def _valid_key(kid: str, raw: dict[bytes | str, bytes | str]) -> ApiKey | None:
    # Decoded either way: the client may or may not use decode_responses.
    fields = {_text(k): _text(v) for k, v in raw.items()}
    if not fields or fields.get("disabled", "0") != "0":
        return None
    expires = fields.get("expires")
    if expires is not None and float(expires) <= time.time():
        return None
    return ApiKey(id=kid, name=fields.get("name", ""))


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
