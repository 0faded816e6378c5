"""Redis script calls (EVALSHA) in shared round trips.

A call goes at once when no round trip is out; the calls that come while one is out wait and
go together in the next, one pipeline for all of them. Each call's reply, or the error Redis
answered it, reaches its own caller; a round trip that fails (Redis unreachable, a timeout)
fails every call in it. The calls that got NOSCRIPT (a new or restarted Redis) did not run:
they go again, after SCRIPT LOAD of the scripts, in one more round trip. A Redis Cluster
refuses scripts in pipelines: there each call goes alone.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from redis.asyncio.cluster import RedisCluster
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError

from infermesh.redis_client import REDIS_ERRORS, RedisClient

# One EVALSHA: the script, its keys and its arguments.
ScriptCall = tuple[AsyncScript, list[str], list[str | int | float]]


@dataclasses.dataclass(frozen=True)
class _Waiting:
    """A call waiting for the next round trip, and where its reply goes."""

    call: ScriptCall
    reply: asyncio.Future[Any]


class ScriptBatcher:
    """Runs calls of the scripts registered with ``register`` on ``client``; one per client."""

    def __init__(self, client: RedisClient) -> None:
        self._redis = client
        self._scripts: list[str] = []
        self._pipelined = not isinstance(client, RedisCluster)
        self._loaded = False  # the scripts, by this batcher; else the next round trip loads them
        self._waiting: list[_Waiting] = []  # for the next round trip
        self._sender: asyncio.Task[None] | None = None

    def register(self, script: str) -> AsyncScript:
        """The script, to name in calls; register each before the first call."""
        self._scripts.append(script)
        return self._redis.register_script(script)

    def call(self, call: ScriptCall) -> asyncio.Future[Any]:
        """Sends ``call`` with the next round trip (at once when none is out); the future holds
        its reply, or the Redis error it or its round trip got. Cancelling it before its round
        trip leaves the call out of it."""
        if not self._pipelined:
            script, keys, args = call
            return asyncio.ensure_future(script(keys=keys, args=args))
        waiting = _Waiting(call, asyncio.get_running_loop().create_future())
        self._waiting.append(waiting)
        if self._sender is None:
            self._sender = asyncio.get_running_loop().create_task(self._send_waiting())
        return waiting.reply

    async def drain(self) -> None:
        """Waits until the calls waiting or out have their replies."""
        if self._sender is not None:
            await asyncio.gather(self._sender, return_exceptions=True)

    async def _send_waiting(self) -> None:
        """Round trips, one after the other, until nothing waits."""
        try:
            while self._waiting:
                # not sent: the calls whose caller went away (cancelled) meanwhile
                waiting = [w for w in self._waiting if not w.reply.done()]
                self._waiting = []
                replies: list[Any]
                try:
                    replies = await self.run([w.call for w in waiting])
                except REDIS_ERRORS as e:
                    replies = [e] * len(waiting)
                except BaseException:  # cancelled (or a bug): no caller may wait for ever
                    for w in waiting:
                        w.reply.cancel()
                    raise
                for w, reply in zip(waiting, replies, strict=True):
                    if w.reply.done():  # its caller went away meanwhile
                        continue
                    if isinstance(reply, Exception):
                        w.reply.set_exception(reply)
                    else:
                        w.reply.set_result(reply)
        finally:
            self._sender = None

    async def run(self, calls: list[ScriptCall]) -> list[Any]:
        """Runs ``calls`` in one round trip now (one pipeline) and returns each one's reply, or
        the error Redis answered it (one call's error loses none of the others' replies);
        raises when the round trip itself failed. The calls that got NOSCRIPT go again with the
        scripts, in one more round trip (whose failure is theirs alone). On a Redis Cluster the
        calls go out together, each its own."""
        if not self._pipelined:
            return await asyncio.gather(*(self._run_alone(call) for call in calls))
        replies = await self._round_trip(calls, load=not self._loaded)
        again = [i for i, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
        if again:
            retried: list[Any]
            try:
                retried = await self._round_trip([calls[i] for i in again], load=True)
            except REDIS_ERRORS as e:  # the others ran: their replies stand
                retried = [e] * len(again)
            for i, reply in zip(again, retried, strict=True):
                replies[i] = reply
        return replies

    async def _round_trip(self, calls: list[ScriptCall], *, load: bool) -> list[Any]:
        """One pipeline of ``calls``, after SCRIPT LOAD of every script when ``load``."""
        async with self._redis.pipeline(transaction=False) as pipe:
            if load:
                for script in self._scripts:
                    pipe.script_load(script)
            for script_call, keys, args in calls:
                pipe.evalsha(script_call.sha, len(keys), *keys, *args)
            replies = await pipe.execute(raise_on_error=False)
        if load:
            self._loaded = True
            del replies[: len(self._scripts)]
        return replies

    @staticmethod
    async def _run_alone(call: ScriptCall) -> Any:
        script, keys, args = call
        try:
            return await script(keys=keys, args=args)
        except REDIS_ERRORS as e:
            return e
