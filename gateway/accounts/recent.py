"""The recent requests of the API keys, for the console's Recent requests page (gateway.console).

Every gateway records each request an API key authenticated, when it ends, in two capped Redis
streams: ``infermesh:recent:{<key id>}`` (the key's last ``[console] recent_per_key``, in its
hash slot) and ``infermesh:recent`` (all keys' last ``recent_total``). An entry holds the time,
key id and name, path, model, status, tokens, time to first token, duration and trace id: never
a prompt, a completion or key material. Recording happens off the request's path, in shared round
trips, and a Redis failure loses entries (logged), never the request.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler

from gateway.accounts.keys import key_tag
from gateway.accounts.state import API_KEY, FIRST_TOKEN_S, REDIS, USAGE
from gateway.accounts.usage import TokenUsage
from gateway.config import CONFIG, ConsoleSection
from gateway.http.state import MODEL, REQUEST_ID, TRACE_ID
from infermesh.redis_client import REDIS_ERRORS, RedisClient, decoded

logger = logging.getLogger(__name__)

ALL_KEYS = "infermesh:recent"
_MAX_WAITING = 10_000  # entries waiting for their write, about 300 bytes each
# Set by the generation (gateway.api.generation) for the request's entry.


def key_stream(kid: str) -> str:
    return f"{ALL_KEYS}:{key_tag(kid)}"


@dataclasses.dataclass(frozen=True)
class RecentRequest:
    """One entry of the streams."""

    at: float  # unix s, when it ended
    key_id: str
    key_name: str
    path: str
    model: str
    status: int
    prompt_tokens: int
    cached_tokens: int  # stored under this name, as the usage counts are (infermesh.usage)
    completion_tokens: int
    first_token_ms: int | None  # None: no token came (refused, failed, or not a generation)
    duration_ms: int
    trace_id: str
    request_id: str

    def fields(self) -> dict[str, str]:
        return {f: "" if v is None else str(v) for f, v in dataclasses.asdict(self).items()}

    @classmethod
    def parse(cls, raw: Mapping[bytes | str, bytes | str]) -> RecentRequest:
        text = {decoded(k): decoded(v) for k, v in raw.items()}
        return cls(
            at=float(text["at"]),
            key_id=text["key_id"],
            key_name=text["key_name"],
            path=text["path"],
            model=text["model"],
            status=int(text["status"]),
            prompt_tokens=int(text["prompt_tokens"]),
            cached_tokens=int(text["cached_tokens"]),
            completion_tokens=int(text["completion_tokens"]),
            first_token_ms=int(text["first_token_ms"]) if text["first_token_ms"] else None,
            duration_ms=int(text["duration_ms"]),
            trace_id=text["trace_id"],
            request_id=text["request_id"],
        )


class RecentRequests:
    """Writes entries in the background, in order, and reads them back, newest first.

    One write is out at a time; the entries that end meanwhile go together in the next (one
    pipelined round trip however many requests ended), at most ``_MAX_WAITING`` of them: past
    that (Redis slow or away) the oldest are dropped."""

    def __init__(self, redis: RedisClient, config: ConsoleSection) -> None:
        self._redis = redis
        self._config = config
        self._waiting: collections.deque[RecentRequest] = collections.deque(maxlen=_MAX_WAITING)
        self._writer: asyncio.Task[None] | None = None

    def record(self, entry: RecentRequest) -> None:
        self._waiting.append(entry)
        if self._writer is None or self._writer.done():
            self._writer = asyncio.create_task(self._write_waiting())

    async def _write_waiting(self) -> None:
        per_key, total = self._config.recent_per_key, self._config.recent_total
        while self._waiting:
            batch = list(self._waiting)
            self._waiting.clear()
            try:
                async with self._redis.pipeline(transaction=False) as pipe:
                    for entry in batch:
                        # exact caps: trimming one entry per add is cheap
                        fields: dict[Any, Any] = entry.fields()  # redis-py: invariant key type
                        pipe.xadd(
                            key_stream(entry.key_id), fields, maxlen=per_key, approximate=False
                        )
                        pipe.xadd(ALL_KEYS, fields, maxlen=total, approximate=False)
                    await pipe.execute()
            except REDIS_ERRORS as e:
                logger.warning(
                    "%d recent requests not recorded: Redis failed (%s)",
                    len(batch),
                    type(e).__name__,
                )

    async def read(self, kid: str | None, count: int) -> list[RecentRequest]:
        """The last ``count`` requests of the key ``kid``, or of every key (None)."""
        stream = key_stream(kid) if kid else ALL_KEYS
        rows = await self._redis.xrevrange(stream, count=count)
        return [RecentRequest.parse(fields) for _, fields in rows or [] if fields]

    async def drain(self) -> None:
        """Waits for the entries recorded so far to be written (or to fail)."""
        if self._writer is not None:
            await self._writer


# This module's own slot of the app; the console reads it through recent_requests.
_RECENT = web.AppKey[RecentRequests]("recent")


def recent_requests(request: web.Request) -> RecentRequests:
    """The app's recorder of recent requests, for reading them back."""
    return request.config_dict[_RECENT]


async def recent_ctx(app: web.Application) -> AsyncIterator[None]:
    """``cleanup_ctx``, after the Redis client's: the recorder, drained at shutdown."""
    recent = RecentRequests(app[REDIS], app[CONFIG].console)
    app[_RECENT] = recent
    yield
    await recent.drain()


@web.middleware
async def record_recent(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Outside the error middleware, so it sees the status every answer ends with."""
    started = time.monotonic()
    response = await handler(request)
    key = request.get(API_KEY)
    if key is not None:
        usage = request.get(USAGE, TokenUsage())
        first_token_s = request.get(FIRST_TOKEN_S)
        recent_requests(request).record(
            RecentRequest(
                at=time.time(),
                key_id=key.id,
                key_name=key.name,
                path=request.path,
                model=request.get(MODEL, ""),
                status=response.status,
                prompt_tokens=usage.prompt_tokens,
                cached_tokens=usage.cached_prompt_tokens,
                completion_tokens=usage.completion_tokens,
                first_token_ms=None if first_token_s is None else round(first_token_s * 1000),
                duration_ms=round((time.monotonic() - started) * 1000),
                trace_id=request.get(TRACE_ID, ""),
                request_id=request.get(REQUEST_ID, ""),
            )
        )
    return response
