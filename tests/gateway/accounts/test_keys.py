from __future__ import annotations

import hashlib

import pytest
import redis
import redis.asyncio as aioredis

from gateway.accounts.keys import (
    ApiKey,
    KeyStore,
    create_key,
    disable_key,
    get_key,
    key_id,
    list_keys,
    revoke_key,
    rotate_key,
    update_key,
)


async def test_create_key_stores_only_the_hash(redis_client):
    plaintext = await create_key(redis_client, "load-test")
    assert plaintext.startswith("sk-") and len(plaintext) >= 3 + 43
    assert plaintext != await create_key(redis_client, "other")

    digest = hashlib.sha256(plaintext.encode()).hexdigest()
    stored = {}
    async for name in redis_client.scan_iter():
        stored[name] = (
            await redis_client.hgetall(name)
            if name.startswith(b"infermesh:key:")
            else await redis_client.smembers(name)
        )
    everything = repr(stored).encode()
    assert plaintext.encode() not in everything
    assert plaintext.removeprefix("sk-").encode() not in everything
    fields = stored[f"infermesh:key:{{{digest}}}".encode()]
    assert fields[b"name"] == b"load-test" and fields[b"disabled"] == b"0"
    assert int(fields[b"created"]) > 0
    assert digest.encode() in stored[b"infermesh:keys"]


async def test_authenticate_known_unknown_disabled_and_expired(redis_client):
    store = KeyStore(redis_client, cache_ttl_s=0)
    key = await create_key(redis_client, "dev")
    assert await store.authenticate(key) == ApiKey(id=key_id(key), name="dev")
    assert await store.authenticate(key + "x") is None
    assert await store.authenticate("") is None

    assert await disable_key(redis_client, key_id(key))
    assert await store.authenticate(key) is None
    assert not await disable_key(redis_client, "0" * 64)

    expired = await create_key(redis_client, "old", expires_at=1)
    assert await store.authenticate(expired) is None
    limited = await create_key(redis_client, "one-model", models=["m1", "m2"])
    assert (await store.authenticate(limited)).models == ("m1", "m2")


async def test_records_update_revoke_and_rotate(redis_client):
    key = await create_key(redis_client, "ci", rpm=10, models=["m"], expires_at=2**40)
    kid = key_id(key)
    record = await get_key(redis_client, kid)
    assert (record.name, record.limits, record.models, record.expires_at) == (
        "ci",
        {"rpm": 10},
        ("m",),
        2**40,
    )

    record = await update_key(
        redis_client, kid, {"rpm": None, "tpm": 500, "models": None, "name": "ci-2"}
    )
    assert (record.name, record.limits, record.models) == ("ci-2", {"tpm": 500}, ())
    assert await update_key(redis_client, "0" * 64, {"rpm": 1}) is None

    rotated = await rotate_key(redis_client, kid)
    new = await get_key(redis_client, key_id(rotated))
    old = await get_key(redis_client, kid)
    assert (new.name, new.limits, new.rotated_from, new.usable(0)) == (
        "ci-2",
        {"tpm": 500},
        kid,
        True,
    )
    assert old.revoked and old.rotated_to == new.id
    assert await rotate_key(redis_client, kid) is None  # a revoked key is not rotated again
    with pytest.raises(ValueError, match="cannot be enabled"):
        await update_key(redis_client, kid, {"disabled": False})

    other = await create_key(redis_client, "other")
    assert await revoke_key(redis_client, key_id(other))
    assert not await revoke_key(redis_client, "0" * 64)
    assert sorted(r.name for r in await list_keys(redis_client)) == ["ci-2", "ci-2", "other"]


async def test_only_successes_are_cached_and_only_for_the_ttl(redis_client):
    now = [0.0]
    store = KeyStore(redis_client, cache_ttl_s=1.0, clock=lambda: now[0])
    key = await create_key(redis_client, "dev")
    await disable_key(redis_client, key_id(key))
    assert await store.authenticate(key) is None
    # A refusal is not cached: re-enabling takes effect at once.
    await redis_client.hset(f"infermesh:key:{{{key_id(key)}}}", "disabled", "0")
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
