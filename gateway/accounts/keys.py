"""API keys: created once, stored in Redis only as a SHA-256 hash, with their limits.

Redis layout (limit state and usage counters: see ``gateway.accounts.limits``):

- ``infermesh:key:{<id>}``: a hash per key, ``<id>`` = SHA-256 hex of the plaintext.
  Fields: ``name``; ``created`` (unix s); ``disabled`` and ``revoked`` ("0"/"1");
  optional ``expires_at`` (unix s); ``models`` (comma-separated allow-list, absent:
  every model); optional limits ``rpm``, ``tpm``, ``max_concurrent``, ``quota_tokens``
  (lifetime), ``quota_period_tokens`` per ``quota_period_s`` (periods aligned to the
  Unix epoch, so 86400 means UTC days); ``rotated_to`` / ``rotated_from`` (ids). A
  limit that is absent is no limit. Fair queueing when the fleet is full (the router's
  ``[fair_queue]``): optional ``weight`` (the key's share against other keys'; absent: its
  tier's weight in the router's ``[fair_queue] tier_weights``, else 1) and ``tier`` (that
  table's key and the label of the queue's metrics; absent: "default").
- ``infermesh:keys``: the set of every id, so listing needs no SCAN.

Every Redis key of one API key carries the hash tag ``{<id>}``, so in a Redis Cluster
they share a hash slot and one Lua script can touch them all (``gateway.accounts.limits``). The
index lives in another slot: nothing updates it in the same transaction as a key.

The hex digest doubles as the key's id for operators; the plaintext exists only in
the answer to ``create_key``/``rotate_key``. Revoking is final; disabling is not.
"""

from __future__ import annotations

import dataclasses
import hashlib
import secrets
import time
from collections.abc import Callable, Mapping
from typing import Any

import redis.asyncio as redis

from infermesh.redis_client import RedisClient, decoded

KEY_PREFIX = "infermesh:key:"
INDEX = "infermesh:keys"
_PLAINTEXT_PREFIX = "sk-"
_RANDOM_BYTES = 32  # 256 bits
_CACHE_MAX_ENTRIES = 10_000

LIMIT_FIELDS = (
    "rpm",
    "tpm",
    "max_concurrent",
    "quota_tokens",
    "quota_period_tokens",
    "quota_period_s",
)
QUEUE_FIELDS = ("weight", "tier")
# Fields an operator may change after creation.
UPDATABLE_FIELDS = ("name", "expires_at", "models", "disabled", *LIMIT_FIELDS, *QUEUE_FIELDS)


def key_id(plaintext: str) -> str:
    """The key's stable id: SHA-256 hex of the plaintext. A header's bytes that are not
    UTF-8 (aiohttp decodes them with surrogateescape) are hashed as sent."""
    return hashlib.sha256(plaintext.encode("utf-8", "surrogateescape")).hexdigest()


def key_tag(kid: str) -> str:
    """The hash tag of every Redis key that belongs to the API key ``kid``."""
    return f"{{{kid}}}"


def redis_key(kid: str) -> str:
    return KEY_PREFIX + key_tag(kid)


@dataclasses.dataclass(frozen=True)
class KeyRecord:
    """A key's metadata as an operator sees it: never the plaintext."""

    id: str
    name: str
    created: int
    disabled: bool
    revoked: bool
    expires_at: int | None
    models: tuple[str, ...]  # empty: every model
    limits: dict[str, int]  # only the limits that are set
    rotated_to: str | None = None
    rotated_from: str | None = None
    weight: int | None = None  # absent: 1
    tier: str | None = None  # absent: "default"

    def usable(self, now_s: float) -> bool:
        return (
            not self.disabled
            and not self.revoked
            and (self.expires_at is None or self.expires_at > now_s)
        )

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["models"] = list(self.models)
        return out


def _fields(name: str, values: Mapping[str, Any]) -> dict[str, str]:
    """Redis fields for a new key; ``values`` holds the optional fields to set."""
    fields = {"name": name, "created": str(int(time.time())), "disabled": "0", "revoked": "0"}
    for field, value in values.items():
        if value is not None:
            fields[field] = _encode(field, value)
    return fields


def _encode(field: str, value: Any) -> str:
    if field == "models":
        return ",".join(value)
    if field == "disabled":
        return "1" if value else "0"
    return str(value)


async def create_key(client: RedisClient, name: str, **values: Any) -> str:
    """Stores a new key's hash under ``name`` and returns the plaintext, the only time it exists.

    ``values``: optional fields of the layout above (``expires_at``, ``models``, limits)."""
    plaintext = _PLAINTEXT_PREFIX + secrets.token_urlsafe(_RANDOM_BYTES)
    await _store(client, key_id(plaintext), _fields(name, values))
    return plaintext


async def _store(client: RedisClient, kid: str, fields: Mapping[str, str]) -> None:
    # Indexed first: should the second call fail, listing skips an id without a record
    # (``_record``), whereas a record missing from the index would be a working key no
    # operator can list.
    await client.sadd(INDEX, kid)
    # redis-py's mapping type has invariant keys, which a Mapping[str, str] does not match
    await client.hset(redis_key(kid), mapping=fields)  # type: ignore[arg-type]


async def _discard(client: RedisClient, kid: str) -> None:
    await client.delete(redis_key(kid))
    await client.srem(INDEX, kid)


async def create_key_at(redis_url: str, name: str) -> str:
    """``create_key`` on a Redis named by URL, for command-line tools and tests."""
    client = redis.Redis.from_url(redis_url)
    try:
        return await create_key(client, name)
    finally:
        await client.aclose()


async def get_key(client: RedisClient, kid: str) -> KeyRecord | None:
    return _record(kid, await client.hgetall(redis_key(kid)))


async def list_keys(client: RedisClient) -> list[KeyRecord]:
    """Every key, oldest first."""
    ids = sorted(decoded(k) for k in await client.smembers(INDEX))
    async with client.pipeline(transaction=False) as pipe:
        for kid in ids:
            pipe.hgetall(redis_key(kid))
        rows = await pipe.execute()
    records = [
        r for r in (_record(kid, row) for kid, row in zip(ids, rows, strict=True)) if r is not None
    ]
    return sorted(records, key=lambda r: (r.created, r.id))


async def update_key(client: RedisClient, kid: str, changes: Mapping[str, Any]) -> KeyRecord | None:
    """Sets (or with None, clears) the ``changes`` fields; None when no such key exists.

    A revoked key cannot be enabled again."""
    assert set(changes) <= set(UPDATABLE_FIELDS), f"not updatable: {set(changes)}"
    key = redis_key(kid)
    async with client.pipeline(transaction=True) as pipe:
        while True:
            try:
                await pipe.watch(key)
                record = _record(kid, await pipe.hgetall(key))
                if record is None:
                    return None
                if record.revoked and changes.get("disabled") is False:
                    raise ValueError("a revoked key cannot be enabled again")
                pipe.multi()  # type: ignore[no-untyped-call]  # redis-py's MULTI: no annotations
                cleared = [f for f, v in changes.items() if v is None or v == []]
                kept = {f: _encode(f, v) for f, v in changes.items() if f not in cleared}
                if cleared:
                    pipe.hdel(key, *cleared)
                if kept:
                    pipe.hset(key, mapping=kept)  # type: ignore[arg-type]  # as in _store
                await pipe.execute()
                break
            except redis.WatchError:
                continue
    return await get_key(client, kid)


async def disable_key(client: RedisClient, kid: str) -> bool:
    """Marks the key with id ``kid`` disabled; False when no such key exists."""
    return await update_key(client, kid, {"disabled": True}) is not None


async def revoke_key(client: RedisClient, kid: str) -> bool:
    """Revokes the key for good (its record and usage stay); False when no such key exists."""
    if not await client.exists(redis_key(kid)):
        return False
    await client.hset(redis_key(kid), mapping={"revoked": "1", "disabled": "1"})
    return True


async def rotate_key(client: RedisClient, kid: str) -> str | None:
    """A new key with the old one's name, expiry, models and limits; the old key is
    revoked once the new one is stored. Returns the new plaintext; None when ``kid``
    does not name a usable key, or when it changed meanwhile (e.g. two rotations
    raced: one wins). The new key is stored before anyone holds its plaintext, so the
    old and new key in their two hash slots need no common transaction."""
    raw = await client.hgetall(redis_key(kid))
    old = _record(kid, raw)
    if old is None or not old.usable(time.time()):
        return None
    plaintext = _PLAINTEXT_PREFIX + secrets.token_urlsafe(_RANDOM_BYTES)
    new_id = key_id(plaintext)
    values = {
        "expires_at": old.expires_at,
        "models": old.models or None,
        **old.limits,
        "weight": old.weight,
        "tier": old.tier,
        "rotated_from": kid,
    }
    await _store(client, new_id, _fields(old.name, values))
    snapshot = [item for pair in raw.items() for item in pair]
    if await client.eval(_REVOKE_UNCHANGED, 1, redis_key(kid), new_id, *snapshot):
        return plaintext
    await _discard(client, new_id)
    return None


# Revokes KEYS[1] for a rotation to ARGV[1] only if its fields are still ARGV[2..]
# (as read before the new key was made): WATCH's guarantee, in one hash slot.
_REVOKE_UNCHANGED = """
local now = redis.call('HGETALL', KEYS[1])
if #now ~= #ARGV - 1 then return 0 end
for i = 1, #now do
  if now[i] ~= ARGV[i + 1] then return 0 end
end
redis.call('HSET', KEYS[1], 'revoked', '1', 'disabled', '1', 'rotated_to', ARGV[1])
return 1
"""


def _record(kid: str, raw: Mapping[bytes | str, bytes | str]) -> KeyRecord | None:
    # Decoded either way: the client may or may not use decode_responses.
    fields = {decoded(k): decoded(v) for k, v in raw.items()}
    if not fields:
        return None
    return KeyRecord(
        id=kid,
        name=fields.get("name", ""),
        created=int(fields.get("created", "0")),
        disabled=fields.get("disabled", "0") != "0",
        revoked=fields.get("revoked", "0") == "1",
        expires_at=int(float(fields["expires_at"])) if "expires_at" in fields else None,
        models=tuple(m for m in fields.get("models", "").split(",") if m),
        limits={f: int(fields[f]) for f in LIMIT_FIELDS if f in fields},
        rotated_to=fields.get("rotated_to"),
        rotated_from=fields.get("rotated_from"),
        weight=int(fields["weight"]) if "weight" in fields else None,
        tier=fields.get("tier"),
    )


@dataclasses.dataclass(frozen=True)
class ApiKey:
    """An authenticated key, as handlers see it: never the plaintext."""

    id: str
    name: str
    models: tuple[str, ...] = ()  # empty: every model
    weight: int = 0  # its share of the router's fair queueing (0: its tier's)
    tier: str = ""  # the queue metrics' label ("": default)
    batch: bool = False  # acting for one of its batches' lines (gateway.batches.runner)

    def allows(self, model: str) -> bool:
        return not self.models or model in self.models

    @property
    def tenant(self) -> str:
        """Its name in the router's fair queue: its batches queue apart from its live requests,
        so that each has its own share."""
        return f"{self.id}/batch" if self.batch else self.id


class KeyStore:
    """Authenticates presented keys against Redis, once per request.

    Only successes are cached, for ``cache_ttl_s`` (at most 1 s), so a new key
    works at once and a revoked one stops within the TTL; the admission script of
    ``gateway.accounts.limits`` checks the key again in Redis for every request it admits.
    Redis errors propagate: the caller answers 503, never 401 and never admits.
    """

    def __init__(
        self, client: RedisClient, cache_ttl_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._redis = client
        self._cache_ttl_s = cache_ttl_s
        self._clock = clock
        self._cache: dict[str, tuple[ApiKey, float]] = {}

    async def authenticate(self, presented: str) -> ApiKey | None:
        """The key when ``presented`` is a known, enabled, unexpired key, else None."""
        return await self.by_id(key_id(presented))

    async def by_id(self, kid: str) -> ApiKey | None:
        """The key of id ``kid`` when it is known, enabled and unexpired, else None."""
        now = self._clock()
        cached = self._cache.get(kid)
        if cached is not None and cached[1] > now:
            return cached[0]
        record = _record(kid, await self._redis.hgetall(redis_key(kid)))
        if record is None or not record.usable(time.time()):
            self._cache.pop(kid, None)
            return None
        key = ApiKey(
            id=kid,
            name=record.name,
            models=record.models,
            weight=record.weight or 0,
            tier=record.tier or "",
        )
        if self._cache_ttl_s > 0:
            if len(self._cache) >= _CACHE_MAX_ENTRIES:
                self._cache = {k: v for k, v in self._cache.items() if v[1] > now}
            self._cache[kid] = (key, now + self._cache_ttl_s)
        return key

    def forget(self, kid: str) -> None:
        """Drops a cached success, e.g. right after this process revoked the key."""
        self._cache.pop(kid, None)
