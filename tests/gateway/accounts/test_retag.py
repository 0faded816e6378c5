"""The migration to hash-tagged names: a key, its limit state and usage written by an older
gateway work again after it, on a real Redis."""

from __future__ import annotations

from devtools.retag import retag
from gateway.accounts.keys import INDEX, KeyStore, key_id
from gateway.accounts.limits import read_usage


async def test_an_untagged_key_and_its_usage_work_after_the_retag(redis_client):
    plaintext = "sk-older-gateway-key"
    kid = key_id(plaintext)
    await redis_client.sadd(INDEX, kid)
    await redis_client.hset(
        f"infermesh:key:{kid}",
        mapping={"name": "old", "created": "1", "disabled": "0", "revoked": "0", "rpm": "5"},
    )
    await redis_client.hset(f"infermesh:usage:{kid}", mapping={"requests": 7, "prompt_tokens": 70})
    await redis_client.hset(f"infermesh:usage:{kid}:d:2026-11-29", mapping={"requests": 7})
    await redis_client.hset(f"infermesh:rl:{kid}:rpm", "1796050000", 2)
    store = KeyStore(redis_client, cache_ttl_s=0)
    assert await store.authenticate(plaintext) is None  # the tagged layout does not see it

    report = await retag(redis_client)
    assert (report.renamed, report.conflicts) == (4, [])
    assert (await store.authenticate(plaintext)).name == "old"
    usage = await read_usage(redis_client, kid, 1)
    assert (usage["requests"], usage["prompt_tokens"]) == (7, 70)
    assert await redis_client.hgetall(f"infermesh:usage:{{{kid}}}:d:2026-11-29") == {
        b"requests": b"7"
    }
    assert not [n async for n in redis_client.scan_iter(match=f"infermesh:*:{kid}*")]

    assert (await retag(redis_client)).renamed == 0  # a second run finds nothing to do
    await redis_client.hset(f"infermesh:quota:{kid}", "total", 1)
    await redis_client.hset(f"infermesh:quota:{{{kid}}}", "total", 2)
    assert (await retag(redis_client)).conflicts == [f"infermesh:quota:{kid}"]
