"""Per-key limits and usage, through real gateways sharing one real Redis, with a
real router (and a real worker on the tiny model where tokens matter)."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import time
from collections.abc import Iterable
from typing import Any

import openai
import pytest
import redis.asyncio as aioredis
import redis.exceptions
from prometheus_client import REGISTRY
from redis.asyncio.connection import Connection

from devtools.redis_server import RedisServer
from gateway.accounts.keys import create_key, key_id, key_tag
from gateway.accounts.limits import _SETTLE, Admission, Limiter, duration, read_usage
from gateway.accounts.state import LIMITER
from gateway.accounts.usage import TokenUsage
from gateway.http.errors import RateLimitError
from infermesh.redis_client import redis_client as redis_client_for
from tests.helpers import MODEL
from tests.helpers.gateway import auth, make_config, sdk, start_gateway
from tests.helpers.inprocess import eventually

_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": 0}


async def _settled(redis_client, key: str, requests: int) -> dict[str, Any]:
    """The key's usage once ``requests`` requests have been settled."""
    deadline = time.monotonic() + 5
    while (usage := await read_usage(redis_client, key_id(key), 1))["requests"] < requests:
        assert time.monotonic() < deadline, usage
        await asyncio.sleep(0.02)
    return usage


async def _admitted_once_free(limiter: Limiter, key: str) -> Admission:
    """The admission ``limiter`` gets once the key's slot frees, within 5 s."""
    deadline = time.monotonic() + 5
    while True:
        try:
            return await limiter.admit(key, 0)
        except RateLimitError:
            assert time.monotonic() < deadline, "the slot never freed"
            await asyncio.sleep(0.05)


async def test_rpm_admits_exactly_the_limit_across_two_gateways(gateways, redis_client):
    key = await create_key(redis_client, "load", rpm=50)

    async def call(i: int):
        response = await gateways[i % 2].get("/v1/models", headers=auth(key))
        await response.read()
        return response

    responses = await asyncio.gather(*(call(i) for i in range(200)))
    by_status = collections.Counter(r.status for r in responses)
    assert by_status == {200: 50, 429: 150}
    admitted = [r for r in responses if r.status == 200]
    assert sorted(int(r.headers["x-ratelimit-remaining-requests"]) for r in admitted) == list(
        range(50)
    )
    assert {r.headers["x-ratelimit-limit-requests"] for r in responses} == {"50"}
    refused = next(r for r in responses if r.status == 429)
    assert 1 <= int(refused.headers["Retry-After"]) <= 60
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    assert refused.headers["x-ratelimit-reset-requests"].endswith("s")
    error = (await refused.json())["error"]
    assert (error["code"], error["type"]) == ("rate_limit_exceeded", "requests")
    assert "requests per minute" in error["message"]
    assert (await _settled(redis_client, key, 50))["requests"] == 50


async def test_tokens_are_reserved_then_settled_to_the_real_usage(served, redis_client):
    key = await create_key(redis_client, "tpm", tpm=1000)
    async with sdk(served, key) as client:
        first = await client.chat.completions.with_raw_response.create(**_CHAT, max_tokens=8)
        reserve = 1 + 8  # "hi": one estimated prompt token, plus max_tokens
        assert first.headers["x-ratelimit-limit-tokens"] == "1000"
        assert int(first.headers["x-ratelimit-remaining-tokens"]) == 1000 - reserve
        used = first.parse().usage.total_tokens
        await _settled(redis_client, key, 1)
        second = await client.chat.completions.with_raw_response.create(**_CHAT, max_tokens=8)
        assert int(second.headers["x-ratelimit-remaining-tokens"]) == 1000 - used - reserve

        with pytest.raises(openai.RateLimitError) as caught:
            await client.chat.completions.create(**_CHAT, max_tokens=2000)
    assert caught.value.code == "insufficient_quota"  # more than the limit: never admitted
    assert "max_tokens" in caught.value.message
    await _settled(redis_client, key, 2)
    async with sdk(served, key) as client:
        with pytest.raises(openai.RateLimitError) as caught:
            await client.chat.completions.create(**_CHAT, max_tokens=990)
    response = caught.value.response
    assert caught.value.code == "rate_limit_exceeded" and caught.value.body["type"] == "tokens"
    assert 1 <= int(response.headers["retry-after"]) <= 60
    assert response.headers["x-ratelimit-limit-tokens"] == "1000"


async def test_concurrent_requests_are_limited_and_freed(served, redis_client):
    key = await create_key(redis_client, "one-at-a-time", max_concurrent=1)
    stream = await served.post(
        "/v1/chat/completions",
        headers=auth(key),
        json={**_CHAT, "stream": True, "max_tokens": 2000},
    )
    await stream.content.readline()
    refused = await served.post("/v1/chat/completions", headers=auth(key), json=_CHAT)
    assert refused.status == 429 and refused.headers["Retry-After"] == "1"
    assert "concurrent requests" in (await refused.json())["error"]["message"]
    stream.close()
    await _settled(redis_client, key, 1)
    admitted = await served.post(
        "/v1/chat/completions", headers=auth(key), json={**_CHAT, "max_tokens": 2}
    )
    assert admitted.status == 200


async def test_token_quota_total_and_per_period(served, redis_client):
    total = await create_key(redis_client, "total", quota_tokens=60)
    async with sdk(served, total) as client:
        used = (await client.chat.completions.create(**_CHAT, max_tokens=4)).usage.total_tokens
        await _settled(redis_client, total, 1)
        assert (await read_usage(redis_client, key_id(total), 1))["quota_consumed_tokens"] == used
        with pytest.raises(openai.RateLimitError) as caught:
            await client.chat.completions.create(**_CHAT, max_tokens=60 - used)
    assert caught.value.code == "insufficient_quota" and caught.value.type == "insufficient_quota"
    assert "retry-after" not in caught.value.response.headers
    assert caught.value.response.headers["x-should-retry"] == "false"

    period = await create_key(redis_client, "hourly", quota_period_tokens=30, quota_period_s=3600)
    async with sdk(served, period) as client:
        await client.chat.completions.create(**_CHAT, max_tokens=10)
        with pytest.raises(openai.RateLimitError) as caught:
            await client.chat.completions.create(**_CHAT, max_tokens=25)
    assert caught.value.code == "insufficient_quota"
    assert 1 <= int(caught.value.response.headers["retry-after"]) <= 3600


async def test_usage_counts_finished_and_abandoned_streams(served, redis_client):
    key = await create_key(redis_client, "usage")
    async with sdk(served, key) as client:
        completion = await client.chat.completions.create(**_CHAT, max_tokens=5)
    usage = await _settled(redis_client, key, 1)
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (
        completion.usage.prompt_tokens,
        completion.usage.completion_tokens,
    )

    stream = await served.post(
        "/v1/chat/completions",
        headers=auth(key),
        json={**_CHAT, "stream": True, "max_tokens": 2000},
    )
    for _ in range(3):  # the role chunk, then tokens
        await stream.content.readline()
        await stream.content.readline()
    stream.close()
    usage = await _settled(redis_client, key, 2)
    assert usage["completion_tokens"] >= completion.usage.completion_tokens + 2
    assert usage["prompt_tokens"] > completion.usage.prompt_tokens
    assert usage["daily"][0]["requests"] == 2


async def test_redis_down_on_the_limit_path_is_503_then_recovers(
    served, redis_server, redis_client, tmp_path
):
    key = await create_key(redis_client, "cached", rpm=100)
    assert (await served.get("/v1/models", headers=auth(key))).status == 200  # now cached
    redis_server.stop()
    for method, path, body in [
        ("GET", "/v1/models", None),
        ("POST", "/v1/chat/completions", {**_CHAT, "max_tokens": 2}),
    ]:
        response = await served.request(method, path, json=body, headers=auth(key))
        assert response.status == 503, await response.text()
        assert (await response.json())["error"]["code"] == "auth_unavailable"
        assert response.headers["Retry-After"] == "1"

    with RedisServer(port=redis_server.port, workdir=tmp_path):
        fresh = aioredis.Redis.from_url(redis_server.url)
        try:
            new_key = await create_key(fresh, "after", rpm=100)
        finally:
            await fresh.aclose()
        response = await served.post(
            "/v1/chat/completions", headers=auth(new_key), json={**_CHAT, "max_tokens": 2}
        )
        assert response.status == 200
        assert response.headers["x-ratelimit-remaining-requests"] == "99"
        # the old key is gone with Redis' data: refused, even while still cached
        assert (await served.get("/v1/models", headers=auth(key))).status == 401


async def test_a_dead_gateways_slot_expires_a_live_one_is_renewed(redis_client):
    key = await create_key(redis_client, "lease", max_concurrent=1)
    dead = Limiter(redis_client, lease_ttl_s=1, settle_retry_max=10)
    await dead.admit(key_id(key), 0)  # never settled, never renewed
    live = Limiter(redis_client, lease_ttl_s=1, settle_retry_max=10)
    with pytest.raises(RateLimitError):
        await live.admit(key_id(key), 0)
    held = await _admitted_once_free(live, key_id(key))  # the dead slot expired
    renewal = asyncio.create_task(live.renew_leases())
    try:
        # held past its 1 s life, and refused to the other gateway at every moment of it
        held_until = time.monotonic() + 1.5
        while time.monotonic() < held_until:
            with pytest.raises(RateLimitError):
                await dead.admit(key_id(key), 0)
            await asyncio.sleep(0.1)
    finally:
        renewal.cancel()
    await live.settle(held, TokenUsage())
    await dead.admit(key_id(key), 0)  # the slot is free again


@pytest.mark.parametrize(
    "ms, text",
    [
        (0, "0ms"),
        (20, "20ms"),
        (1000, "1s"),
        (1500, "1.5s"),
        (59_999, "59.999s"),
        (60_000, "1m0s"),
        (361_000, "6m1s"),
    ],
)
def test_reset_durations_are_written_as_openai_does(ms, text):
    assert duration(ms) == text


async def test_requests_beyond_the_redis_connections_wait_for_one(
    redis_server, router, worker, redis_client
):
    config = make_config(redis_server.url, router.address)
    gateway = await start_gateway(
        dataclasses.replace(config, redis=dataclasses.replace(config.redis, max_connections=2))
    )
    key = await create_key(redis_client, "narrow")
    try:
        responses = await asyncio.gather(
            *(
                gateway.post(
                    "/v1/chat/completions", json={**_CHAT, "max_tokens": 2}, headers=auth(key)
                )
                for _ in range(12)
            )
        )
        assert [r.status for r in responses] == [200] * 12, [await r.text() for r in responses]
        assert (await _settled(redis_client, key, 12))["requests"] == 12
    finally:
        await gateway.close()


async def test_usage_settled_while_redis_is_down_is_recorded_once_it_is_back(tmp_path):
    server = RedisServer(workdir=tmp_path, persistent=True).start()
    client = aioredis.Redis.from_url(server.url, socket_timeout=0.5, socket_connect_timeout=0.5)
    limiter = Limiter(client, lease_ttl_s=1, settle_retry_max=10)
    retries = asyncio.create_task(limiter.retry_settlements())
    try:
        key = await create_key(client, "outage", tpm=1000, max_concurrent=1)
        admission = await limiter.admit(key_id(key), 100)
        server.stop()
        limiter.settle_soon(admission, TokenUsage(prompt_tokens=7, completion_tokens=11))
        await eventually(lambda: limiter.pending_settlements == 1)
        await limiter.drain()  # a retry while it is down fails; the settlement is kept
        assert limiter.pending_settlements == 1
        server.start()
        usage = await _settled(client, key, 1)
        assert (usage["prompt_tokens"], usage["completion_tokens"], usage["in_flight"]) == (
            7,
            11,
            0,
        )
        assert usage["quota_consumed_tokens"] == 18  # the reservation became the real usage
        assert limiter.pending_settlements == 0
    finally:
        retries.cancel()
        await client.aclose()
        server.stop()


async def test_settlements_past_the_bound_are_dropped_and_counted(tmp_path):
    server = RedisServer(workdir=tmp_path, persistent=True).start()
    client = aioredis.Redis.from_url(server.url, socket_timeout=0.5, socket_connect_timeout=0.5)
    limiter = Limiter(client, lease_ttl_s=1, settle_retry_max=2)
    dropped = REGISTRY.get_sample_value("infermesh_usage_settlements_dropped_total") or 0
    try:
        key = await create_key(client, "bounded")
        admissions = [await limiter.admit(key_id(key), 0) for _ in range(3)]
        server.stop()
        for admission in admissions:
            limiter.settle_soon(admission, TokenUsage(completion_tokens=1))
        await limiter.drain()  # tries the kept ones once more: Redis is still down
        assert limiter.pending_settlements == 2
        assert REGISTRY.get_sample_value("infermesh_usage_settlements_dropped_total") == dropped + 1
        server.start()
        await limiter.drain()
        assert (await read_usage(client, key_id(key), 1))["requests"] == 2  # the newest two
    finally:
        await client.aclose()
        server.stop()


async def test_a_settlement_counts_once_however_often_it_runs(redis_client):
    limiter = Limiter(redis_client, lease_ttl_s=1, settle_retry_max=10)
    key = await create_key(redis_client, "once", rpm=10)
    admission = await limiter.admit(key_id(key), 0, "req-once")
    for _ in range(3):  # a retry of a try whose reply was lost runs it again
        await limiter.settle(admission, TokenUsage(completion_tokens=5))
    usage = await read_usage(redis_client, key_id(key), 1)
    assert (usage["requests"], usage["completion_tokens"]) == (1, 5)
    # the done-mark tells which request was settled
    mark = f"infermesh:settled:{key_tag(key_id(key))}:{admission.id}"
    assert await redis_client.get(mark) == b"req-once"


async def test_requests_the_mesh_failed_count_against_no_limit(gateway, redis_client):
    """The gateway's router is down: every request is a 503, none is counted, so a key
    with 2 requests per minute is never refused with a 429 for them."""
    key = await create_key(redis_client, "refund", rpm=2, tpm=100, max_concurrent=1)
    for _ in range(5):
        response = await gateway.post(
            "/v1/chat/completions", json={**_CHAT, "max_tokens": 50}, headers=auth(key)
        )
        assert response.status == 503, await response.text()
        assert (await response.json())["error"]["code"] == "router_unavailable"
    await gateway.app[LIMITER].drain()  # settlements run in the background
    usage = await read_usage(redis_client, key_id(key), 1)
    assert (usage["requests"], usage["in_flight"], usage["quota_consumed_tokens"]) == (0, 0, 0)
    buckets = await redis_client.hgetall(f"infermesh:rl:{key_tag(key_id(key))}:rpm")
    assert buckets and sum(int(v) for v in buckets.values()) == 0  # counted, then given back


def _packed(command: bytes | str | Iterable[bytes]) -> bytes:
    """A round trip's bytes, as redis-py hands them to a connection to write."""
    if isinstance(command, str):
        return command.encode()
    return command if isinstance(command, bytes) else b"".join(command)


class _ScriptWrites(Connection):
    """A connection that counts its writes that carry a script call (EVALSHA): the round
    trips to Redis that run scripts, one write whether it holds one call or a pipeline."""

    count = 0

    async def send_packed_command(
        self, command: bytes | str | Iterable[bytes], check_health: bool = True
    ) -> None:
        data = _packed(command)
        if b"EVALSHA" in data:
            _ScriptWrites.count += 1
        await super().send_packed_command(data, check_health)


async def test_concurrent_admissions_share_round_trips_and_stay_exact(redis_server):
    client = aioredis.Redis.from_url(redis_server.url, connection_class=_ScriptWrites)
    try:
        key = await create_key(client, "batched", rpm=30)
        limiter = Limiter(client, lease_ttl_s=10, settle_retry_max=10)
        _ScriptWrites.count = 0
        outcomes = await asyncio.gather(
            *(limiter.admit(key_id(key), 0) for _ in range(50)), return_exceptions=True
        )
    finally:
        await client.aclose()
    assert _ScriptWrites.count <= 2, _ScriptWrites.count  # 50 when each goes alone
    admitted = [o for o in outcomes if isinstance(o, Admission)]
    refused = [o for o in outcomes if isinstance(o, RateLimitError)]
    assert (len(admitted), len(refused)) == (30, 20), outcomes
    assert sorted(int(a.headers["x-ratelimit-remaining-requests"]) for a in admitted) == list(
        range(30)
    )
    assert {e.headers["x-ratelimit-remaining-requests"] for e in refused} == {"0"}
    assert {e.type for e in refused} == {"requests"}


class _LosesScriptReplies(Connection):
    """A connection that loses the reply of a round trip carrying a script call (EVALSHA) after
    Redis ran it, as a connection a failover breaks does, while ``lose`` is above 0: the
    client's retry sends the round trip again on a new connection."""

    lose = 0
    _script_sent = False

    async def send_packed_command(
        self, command: bytes | str | Iterable[bytes], check_health: bool = True
    ) -> None:
        data = _packed(command)
        self._script_sent = b"EVALSHA" in data
        await super().send_packed_command(data, check_health)

    async def read_response(self, *args: Any, **kwargs: Any) -> Any:
        reply = await super().read_response(*args, **kwargs)
        if self._script_sent and _LosesScriptReplies.lose > 0:
            _LosesScriptReplies.lose -= 1
            await self.disconnect()
            raise redis.exceptions.ConnectionError("the reply was lost")
        return reply


async def test_an_admission_sent_again_after_its_reply_was_lost_counts_once(redis_server):
    """The gateway's Redis client (one retry on a new connection) meets a round trip whose
    admission ran but whose reply was lost: the retry runs the script again, which answers the
    first run's reply and counts nothing; the settlement frees the admission's mark."""
    client = redis_client_for(redis_server.url, timeout_s=5)
    assert isinstance(client, aioredis.Redis)
    pool = client.connection_pool
    pool.connection_class = type("Losing", (_LosesScriptReplies, pool.connection_class), {})
    try:
        limiter = Limiter(client, lease_ttl_s=10, settle_retry_max=10)
        key = await create_key(client, "replayed", rpm=10, tpm=1000, max_concurrent=5)
        kid = key_id(key)
        await limiter.admit(kid, 100)  # the scripts are loaded: the next round trip is one call
        calls, _ = await _evalsha_calls(client)
        _LosesScriptReplies.lose = 1
        admission = await limiter.admit(kid, 100, "req-replayed")
        assert _LosesScriptReplies.lose == 0
        assert (await _evalsha_calls(client))[0] == calls + 2  # it ran twice
        assert admission.headers["x-ratelimit-remaining-requests"] == "8"
        assert admission.headers["x-ratelimit-remaining-tokens"] == "800"
        tag = key_tag(kid)
        counts = [
            sum(int(v) for v in (await client.hgetall(f"infermesh:rl:{tag}:{limit}")).values())
            for limit in ("rpm", "tpm")
        ]
        usage = await read_usage(client, kid, 1)
        assert (counts, usage["quota_consumed_tokens"], usage["in_flight"]) == ([2, 200], 200, 2)
        mark = f"infermesh:admitted:{tag}:{admission.id}"
        assert await client.ttl(mark) > 0
        await limiter.settle(admission, TokenUsage(completion_tokens=5))
        assert not await client.exists(mark)
    finally:
        _LosesScriptReplies.lose = 0
        await client.aclose()


async def _evalsha_calls(client: aioredis.Redis) -> tuple[int, int]:
    """EVALSHA calls the server ran or refused, and its NOSCRIPT errors, so far."""
    calls = (await client.info("commandstats")).get("cmdstat_evalsha", {}).get("calls", 0)
    errors = (await client.info("errorstats")).get("errorstat_NOSCRIPT", {}).get("count", 0)
    return int(calls), int(errors)


async def test_admissions_and_settlements_run_once_each_after_a_script_flush(redis_client):
    limiter = Limiter(redis_client, lease_ttl_s=10, settle_retry_max=10)
    key = await create_key(redis_client, "flushed", rpm=100)
    kid = key_id(key)
    admitted = [await limiter.admit(kid, 0) for _ in range(10)]  # the scripts are loaded

    async def batch(settled: list[Admission]) -> None:
        """10 admissions and ``settled``'s settlements, all in one round trip."""
        admissions = asyncio.gather(*(limiter.admit(kid, 0) for _ in range(10)))
        for admission in settled:
            limiter.settle_soon(admission, TokenUsage(completion_tokens=1))
        admitted.extend(await admissions)
        await limiter.drain()
        assert limiter.pending_settlements == 0

    await redis_client.script_flush()  # a restarted Redis: neither script is loaded
    calls, noscript = await _evalsha_calls(redis_client)
    await batch(admitted[:5])
    # all 15 refused once, then sent again with the scripts
    assert await _evalsha_calls(redis_client) == (calls + 30, noscript + 15)

    await redis_client.script_flush()
    await redis_client.script_load(_SETTLE)  # only the admissions fail: only they go again
    calls, noscript = await _evalsha_calls(redis_client)
    await batch(admitted[5:10])
    assert await _evalsha_calls(redis_client) == (calls + 25, noscript + 10)

    buckets = await redis_client.hgetall(f"infermesh:rl:{key_tag(kid)}:rpm")
    assert sum(int(v) for v in buckets.values()) == len(admitted) == 30  # each admitted once
    usage = await read_usage(redis_client, kid, 1)
    assert (usage["requests"], usage["completion_tokens"]) == (10, 10)  # each settled once


async def test_every_admission_waiting_when_redis_is_down_fails_and_none_is_admitted(tmp_path):
    server = RedisServer(workdir=tmp_path, persistent=True).start()
    client = aioredis.Redis.from_url(server.url, socket_timeout=0.5, socket_connect_timeout=0.5)
    limiter = Limiter(client, lease_ttl_s=10, settle_retry_max=10)
    try:
        key = await create_key(client, "down", rpm=100)
        first = await limiter.admit(key_id(key), 0)
        server.stop()
        admissions = asyncio.gather(
            *(limiter.admit(key_id(key), 0) for _ in range(10)), return_exceptions=True
        )
        limiter.settle_soon(first, TokenUsage(completion_tokens=3))  # in the same round trip
        outcomes = await admissions
        assert {type(o) for o in outcomes} == {redis.exceptions.ConnectionError}, outcomes
        await eventually(lambda: limiter.pending_settlements == 1)
        server.start()
        buckets = await client.hgetall(f"infermesh:rl:{key_tag(key_id(key))}:rpm")
        assert sum(int(v) for v in buckets.values()) == 1  # only the first
        await limiter.drain()  # the kept settlement, now that Redis is back
        assert (await read_usage(client, key_id(key), 1))["completion_tokens"] == 3
    finally:
        await client.aclose()
        server.stop()
