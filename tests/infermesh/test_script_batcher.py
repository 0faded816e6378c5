"""Script calls in shared round trips, on a real Redis: each call's own reply or error, calls
that come while a round trip is out sent together in the next, a call cancelled before its
round trip left out, the scripts loaded again after a flush."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from infermesh.script_batcher import ScriptBatcher

_ECHO = "if ARGV[1] == 'fail' then return redis.error_reply('told to fail') end return ARGV[1]"
_COUNT = "return redis.call('INCR', KEYS[1])"


async def _evalsha_calls(client: aioredis.Redis) -> int:
    return int((await client.info("commandstats")).get("cmdstat_evalsha", {}).get("calls", 0))


async def test_each_call_gets_its_own_reply_and_waiting_calls_share_a_round_trip(redis_server):
    client = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
    try:
        batcher = ScriptBatcher(client)
        echo = batcher.register(_ECHO)
        first = batcher.call((echo, [], ["first"]))  # goes at once
        rest = [batcher.call((echo, [], [str(i)])) for i in range(20)]  # wait for the next
        failing = batcher.call((echo, [], ["fail"]))
        left_out = batcher.call((echo, [], ["left out"]))
        left_out.cancel()
        assert await first == "first"
        assert await asyncio.gather(*rest) == [str(i) for i in range(20)]
        with pytest.raises(ResponseError, match="told to fail"):
            await failing
        await batcher.drain()
        # one SCRIPT LOAD and the first call, then every waiting call but the cancelled one
        assert await _evalsha_calls(client) == 22
    finally:
        await client.aclose()


async def test_calls_refused_for_a_flushed_script_run_once_after_loading_it(redis_server):
    client = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
    try:
        batcher = ScriptBatcher(client)
        count = batcher.register(_COUNT)
        assert await batcher.call((count, ["n"], [])) == 1
        await client.script_flush()  # a restarted Redis: the script is gone
        replies = await asyncio.gather(*(batcher.call((count, ["n"], [])) for _ in range(5)))
        assert sorted(replies) == [2, 3, 4, 5, 6]  # each ran once
        assert await batcher.run([(count, ["n"], []), (count, ["n"], [])]) == [7, 8]
    finally:
        await client.aclose()
