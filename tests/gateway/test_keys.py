from __future__ import annotations

import hashlib

import pytest
import redis
import redis.asyncio as aioredis

from gateway.keys import ApiKey, KeyStore, create_key, disable_key, key_id


async def test_create_key_stores_only_the_hash(redis_client):
    plaintext = await create_key(redis_client, "load-test")
    assert plaintext.startswith("sk-") and len(plaintext) >= 3 + 43
    assert plaintext != await create_key(redis_client, "other")

    digest = hashlib.sha256(plaintext.encode()).hexdigest()
    stored = {}
    async for name in redis_client.scan_iter():
        stored[name] = await redis_client.hgetall(name)
    everything = repr(stored).encode()
    assert plaintext.encode() not in everything
    assert plaintext.removeprefix("sk-").encode() not in everything
    fields = stored[f"infermesh:key:{digest}".encode()]
    assert fields[b"name"] == b"load-test" and fields[b"disabled"] == b"0"
    assert int(fields[b"created"]) > 0


async def test_authenticate_known_unknown_disabled_and_expired(redis_client):
    store = KeyStore(redis_client, cache_ttl_s=0)
    key = await create_key(redis_client, "dev")
    assert await store.authenticate(key) == ApiKey(id=key_id(key), name="dev")
    assert await store.authenticate(key + "x") is None
    assert await store.authenticate("") is None

    assert await disable_key(redis_client, key_id(key))
    assert await store.authenticate(key) is None
    assert not await disable_key(redis_client, "0" * 64)

    expired = await create_key(redis_client, "old", expires=1)
    assert await store.authenticate(expired) is None


async def test_only_successes_are_cached_and_only_for_the_ttl(redis_client):
    now = [0.0]
    store = KeyStore(redis_client, cache_ttl_s=1.0, clock=lambda: now[0])
    key = await create_key(redis_client, "dev")
    await disable_key(redis_client, key_id(key))
    assert await store.authenticate(key) is None
    # A refusal is not cached: re-enabling takes effect at once.
    await redis_client.hset(f"infermesh:key:{key_id(key)}", "disabled", "0")
    assert await store.authenticate(key) is not None

    await disable_key(redis_client, key_id(key))
    now[0] = 0.5
    assert await store.authenticate(key) is not None  # cached success
    now[0] = 1.5
    assert await store.authenticate(key) is None


async def test_a_decoding_client_reads_the_same_keys(redis_server):
    client = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
    try:
        key = await create_key(client, "decoded")
        assert (await KeyStore(client, 0).authenticate(key)).name == "decoded"
    finally:
        await client.aclose()


async def test_redis_errors_propagate(redis_server, redis_client):
    key = await create_key(redis_client, "dev")
    redis_server.stop()
    with pytest.raises(redis.RedisError):
        await KeyStore(redis_client, cache_ttl_s=1.0).authenticate(key)
