"""Per-key limits and usage, atomic in Redis: two Lua scripts (gateway/accounts/lua/), one per
concern.

``admit`` (once per request, before the router is called) checks the key again
(so revoking or disabling it, or changing its limits, applies to the next request
on every gateway process), then requests per minute, tokens per minute, concurrent
requests and the token quotas, and either refuses or records the request in one
atomic step. ``settle`` (once per admitted request, however it ended) turns the
token reservation into the real usage, frees the concurrency slot and adds the
usage to the key's counters. Both use Redis' clock, so gateways with skewed clocks
agree. Scripts are registered once per process and run by EVALSHA (re-sent after a
Redis restart).

Admissions and settlements share round trips to Redis (``infermesh.script_batcher``): one
goes at once when no round trip is out; those that come while one is out wait and go together
in the next, one pipeline for all keys. Each call's reply or error reaches its own caller; a
Redis error that fails the round trip fails every admission in it (the request is answered
503: never admitted without Redis). A Redis Cluster refuses scripts in pipelines: there each
admission and each settlement is its own call.

Windows: requests and tokens per minute count in one-second buckets over a sliding
60 s window: a request admitted at second ``s`` counts until ``s + 60``. Exact at
the edges (a fixed minute window would admit twice the limit around a boundary),
and bounded in memory (at most 60 buckets), unlike a log of every request.

Redis layout, per key id (see ``gateway.accounts.keys`` for the key's own hash):

- ``infermesh:rl:{<id>}:rpm``, ``infermesh:rl:{<id>}:tpm``: hash second -> requests or
  tokens admitted in that second; only while the key has that limit.
- ``infermesh:rl:{<id>}:inflight``: sorted set of lease ids, scored by expiry in ms;
  only while the key has ``max_concurrent``. Gateways renew their leases every third
  of ``lease_ttl_s``, so a dead gateway's slots free themselves.
- ``infermesh:quota:{<id>}``: hash ``total`` and ``p:<period_s>:<index>`` -> tokens
  consumed (settled usage plus reservations in flight), for the quotas.
- ``infermesh:usage:{<id>}`` (lifetime) and ``infermesh:usage:{<id>}:d:<YYYY-MM-DD>``
  (UTC day): hash requests, prompt_tokens, completion_tokens, cached_tokens, laid out by
  ``infermesh.usage``, in which the router counts its internal callers' usage too.
- ``infermesh:admitted:{<id>}:<admission id>``: an admission's reply, from its admission to
  its settlement (at most ``_ADMITTED_TTL_S``), see below.

Tokens are reserved at admission (prompt estimate plus max_tokens, see
``gateway.api.generation``) so that concurrent requests cannot overrun a tokens-per-minute
limit or a quota; settling replaces the reservation with the real usage.

What counts: a request counts against requests per minute and in ``usage.requests`` once
it was admitted and the mesh served it (the caller's own mistakes, a 400 or 404 from
the router, count too). A request the mesh failed before its first token (a 5xx: router
unreachable, no worker, every worker failed; or a 429 because no worker has capacity) is
settled as *not served*: its requests-per-minute unit, token reservation and concurrency
slot are given back and nothing is added to its usage. A batch line's request is settled
against the limits but not billed: a line can run twice (its runner died after the request and
before the line's result was kept), so its usage is counted by the script that keeps its result,
once (``gateway.batches.records``). A stream that fails after its
first token counts, with the tokens it delivered.

A settlement that fails (Redis unreachable) waits in this process's memory and is retried
once Redis answers again, oldest first; at most ``[limits] settle_retry_max`` wait, past
that the oldest are dropped, counted in ``infermesh_usage_settlements_dropped_total`` and
logged (by key id). Each settlement marks itself done in Redis
(``infermesh:settled:{<id>}:<admission id>``, kept ``_SETTLED_TTL_S``), so a retry of one whose
reply was lost (it ran, but the connection dropped) does not count twice. The mark holds the
request's id (``x-request-id``), so that which requests were settled can be told afterwards
(``bench/redis_failover.py`` looks each one up).

Admissions are idempotent too: the Redis client sends a round trip again on a new connection
when the first one broke (a failover, a restart), also when its scripts had run and only their
replies were lost. Each admission writes its reply to its own mark
(``infermesh:admitted:{<id>}:<admission id>``) in the script that counts it, so the mark is
replicated with the counts or not at all, and the same admission run again answers that reply
without counting anything. Its settlement deletes the mark.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import importlib.resources
import logging
import math
import secrets
from typing import Any

from gateway.accounts.keys import key_tag, redis_key
from gateway.accounts.usage import TokenUsage
from gateway.http.errors import AuthenticationError, RateLimitError
from infermesh.redis_client import REDIS_ERRORS, RedisClient, decoded
from infermesh.script_batcher import ScriptBatcher, ScriptCall
from infermesh.usage import USAGE_DAY_TTL_S, USAGE_FIELDS, usage_day, usage_key
from telemetry.metrics import (
    RATE_LIMITED,
    SETTLEMENTS_DROPPED,
    SETTLEMENTS_PENDING,
    SETTLEMENTS_RETRIED,
)

logger = logging.getLogger(__name__)

# How long a settlement's done-mark lives: a retry later than this after a try whose reply
# was lost could count twice; retries normally run within a second of Redis's return.
# Retries run every 0.5 s once Redis answers; a longer life only grew the keyspace
# (RELIABILITY.md, Soak).
_SETTLED_TTL_S = 60
# How long an admission's mark lives when no settlement deletes it (its caller got an error):
# the client's retries of a round trip come within seconds.
_ADMITTED_TTL_S = 60
_RETRY_INTERVAL_S = 0.5
_LUA = importlib.resources.files("gateway.accounts") / "lua"
_ADMIT = (_LUA / "admit.lua").read_text()
_SETTLE = (_LUA / "settle.lua").read_text()


_ADMITTED, _UNAUTHORIZED = 0, 1
_LIMIT_NAMES = {
    "requests": "requests per minute",
    "tokens": "tokens per minute",
    "concurrency": "concurrent requests",
    "quota": "token quota",
    "quota_period": "token quota of this period",
}


@dataclasses.dataclass(frozen=True)
class Admission:
    """An admitted request's claim on its key's limits, released by ``Limiter.settle``."""

    key_id: str
    second: int
    reserve: int
    tokens_windowed: bool
    quota_field: str
    lease: str  # the concurrency slot's id; "": the key has no concurrency limit
    headers: dict[str, str]  # x-ratelimit-* for the response
    id: str  # unique per admission
    request_id: str  # the request's x-request-id, held by its settlement's done-mark
    bills: bool = True  # False: a batch line's, whose usage its batch counts (with its result)


@dataclasses.dataclass(frozen=True)
class _Settlement:
    admission: Admission
    usage: TokenUsage
    served: bool


def mesh_failed(error: BaseException) -> bool:
    """Whether ``error``, raised before a request's first token, is the mesh's failure (a
    5xx, or a 429 for want of worker capacity) rather than the caller's: such a request is
    settled as not served."""
    status = getattr(error, "status", None)
    return isinstance(status, int) and (status >= 500 or status == 429)


def _keys(kid: str) -> dict[str, str]:
    # One hash tag for all: each script below touches one hash slot (Redis Cluster).
    tag = key_tag(kid)
    return {
        "key": redis_key(kid),
        "rpm": f"infermesh:rl:{tag}:rpm",
        "tpm": f"infermesh:rl:{tag}:tpm",
        "inflight": f"infermesh:rl:{tag}:inflight",
        "quota": f"infermesh:quota:{tag}",
        "usage": usage_key(kid),
    }


def _admitted_mark(kid: str, admission_id: str) -> str:
    return f"infermesh:admitted:{key_tag(kid)}:{admission_id}"


def _settle_call(settlement: _Settlement) -> tuple[list[str], list[str | int | float]]:
    """The keys and arguments of the settlement script for ``settlement``."""
    admission = settlement.admission
    usage = settlement.usage if settlement.served else TokenUsage()
    keys = _keys(admission.key_id)
    return (
        [
            keys["tpm"],
            keys["inflight"],
            keys["quota"],
            keys["usage"],
            f"{keys['usage']}:d:{usage_day()}",
            keys["rpm"],
            f"infermesh:settled:{key_tag(admission.key_id)}:{admission.id}",
            _admitted_mark(admission.key_id, admission.id),
        ],
        [
            admission.second,
            admission.reserve,
            int(admission.tokens_windowed),
            admission.quota_field,
            usage.prompt_tokens,
            usage.completion_tokens,
            usage.cached_prompt_tokens,
            admission.lease,
            USAGE_DAY_TTL_S,
            int(settlement.served),
            _SETTLED_TTL_S,
            admission.request_id,
            int(admission.bills),
        ],
    )


class Limiter:
    """Admits and settles requests against their key's limits; one per gateway process."""

    def __init__(self, client: RedisClient, lease_ttl_s: float, settle_retry_max: int) -> None:
        self._redis = client
        self._lease_ttl_ms = int(lease_ttl_s * 1000)
        self._scripts = ScriptBatcher(client)
        self._admit = self._scripts.register(_ADMIT)
        self._settle = self._scripts.register(_SETTLE)
        self._leases: dict[str, str] = {}  # lease id -> inflight key, for renewal
        # settlements that failed, oldest first, for retry_settlements
        self._failed: collections.deque[_Settlement] = collections.deque()
        self._retry_max = settle_retry_max
        self._dropped = 0

    async def admit(
        self, kid: str, reserve_tokens: int, request_id: str = "", *, bills: bool = True
    ) -> Admission:
        """Admits one request (``request_id``: its x-request-id) reserving ``reserve_tokens``;
        not ``bills`` (a batch line's request): its settlement counts against the key's limits
        but adds nothing to its usage, which the line's batch counts once with the line's result
        (``gateway.batches.records``). Raises ``RateLimitError`` (429) over a limit,
        ``AuthenticationError`` when the key stopped being valid.
        Redis errors propagate: the caller answers 503 and admits nothing. Goes in the
        next round trip to Redis, with the other admissions and the settlements that wait
        for it (at once when none is out)."""
        keys = _keys(kid)
        lease = secrets.token_hex(8)
        call: ScriptCall = (
            self._admit,
            [
                keys["key"],
                keys["rpm"],
                keys["tpm"],
                keys["inflight"],
                keys["quota"],
                _admitted_mark(kid, lease),
            ],
            [reserve_tokens, lease, self._lease_ttl_ms, _ADMITTED_TTL_S],
        )
        out = await self._scripts.call(call)
        if out[0] == _UNAUTHORIZED:
            raise AuthenticationError(
                "Incorrect API key provided, or the key is disabled or expired."
            )
        headers = _rate_headers(out)
        if out[0] != _ADMITTED:
            RATE_LIMITED.labels(limit=decoded(out[1])).inc()
            raise _limit_error(decoded(out[1]), int(out[2]), reserve_tokens, headers)
        held = bool(out[12])
        if held:
            self._leases[lease] = keys["inflight"]
        return Admission(
            key_id=kid,
            second=int(out[9]),
            reserve=reserve_tokens,
            tokens_windowed=bool(out[10]),
            quota_field=decoded(out[11]),
            lease=lease if held else "",
            headers=headers,
            id=lease,
            request_id=request_id,
            bills=bills,
        )

    async def settle(
        self,
        admission: Admission,
        usage: TokenUsage,
        *,
        served: bool = True,
    ) -> None:
        """Replaces the reservation with ``usage``, frees the slot, counts the usage; not
        ``served`` (the mesh failed the request): gives its request-per-minute unit back
        and counts nothing (a choice's first tokens, when another choice of the request
        failed, were never delivered). Runs at most once per admission, however often it
        is called. Its own round trip; raises what Redis raised."""
        self._leases.pop(admission.lease, None)
        keys, args = _settle_call(_Settlement(admission, usage, served))
        [reply] = await self._scripts.run([(self._settle, keys, args)])
        if isinstance(reply, Exception):
            raise reply

    def settle_soon(
        self,
        admission: Admission,
        usage: TokenUsage,
        *,
        served: bool = True,
    ) -> None:
        """Settles in the background: also when the request's task is being cancelled
        (a client that went away), and without delaying the response. Goes in the next
        round trip to Redis, with the admissions and other settlements that wait for it;
        a settlement that fails is retried by ``retry_settlements``."""
        self._leases.pop(admission.lease, None)
        settlement = _Settlement(admission, usage, served)
        reply = self._scripts.call((self._settle, *_settle_call(settlement)))
        reply.add_done_callback(lambda done: self._settled(settlement, done))

    def _settled(self, settlement: _Settlement, reply: asyncio.Future[Any]) -> None:
        """A settlement's round trip came back: one that failed is kept to retry."""
        if reply.cancelled() or reply.exception() is None:
            return
        if not self._failed:
            logger.warning(
                "could not record usage (%s); keeping settlements to retry",
                type(reply.exception()).__name__,
            )
        self._keep(settlement)

    @property
    def pending_settlements(self) -> int:
        """Settlements that failed and wait for Redis."""
        return len(self._failed)

    def _keep(self, settlement: _Settlement) -> None:
        self._failed.append(settlement)
        if len(self._failed) > self._retry_max:
            lost = self._failed.popleft()
            SETTLEMENTS_DROPPED.inc()
            self._dropped += 1
            if self._dropped % 1000 == 1:  # the first of each thousand: no flood of lines
                logger.error(
                    "usage settlement of key %s dropped: more than %d wait for Redis "
                    "([limits] settle_retry_max); %d dropped so far",
                    lost.admission.key_id[:12],
                    self._retry_max,
                    self._dropped,
                )
        SETTLEMENTS_PENDING.set(len(self._failed))

    async def retry_settlements(self) -> None:
        """Runs until cancelled: settles the kept settlements, oldest first, once Redis
        answers again."""
        while True:
            await asyncio.sleep(_RETRY_INTERVAL_S)
            await self._flush()

    async def _flush(self) -> None:
        flushed = 0
        while self._failed:
            settlement = self._failed[0]
            try:
                await self.settle(settlement.admission, settlement.usage, served=settlement.served)
            except REDIS_ERRORS:
                break
            if self._failed and self._failed[0] is settlement:  # not dropped meanwhile
                self._failed.popleft()
            flushed += 1
        if flushed:
            SETTLEMENTS_RETRIED.inc(flushed)
            SETTLEMENTS_PENDING.set(len(self._failed))
            logger.info(
                "recorded %d usage settlements that had waited for Redis; %d still wait",
                flushed,
                len(self._failed),
            )

    async def drain(self) -> None:
        """At shutdown: waits for the settlements in flight and tries the kept ones once
        more; those that still fail are lost (logged)."""
        await self._scripts.drain()
        await self._flush()
        if self._failed:
            logger.error(
                "%d usage settlements lost at shutdown: Redis unreachable", len(self._failed)
            )

    async def renew_leases(self) -> None:
        """Runs until cancelled: pushes back the expiry of this process's concurrency slots."""
        interval_s = self._lease_ttl_ms / 3000
        while True:
            await asyncio.sleep(interval_s)
            if not self._leases:
                continue
            try:
                now = await self._redis.time()
                score = now[0] * 1000 + now[1] // 1000 + self._lease_ttl_ms
                async with self._redis.pipeline(transaction=False) as pipe:
                    for lease, key in list(self._leases.items()):
                        pipe.zadd(key, {lease: score}, xx=True)
                        pipe.pexpire(key, self._lease_ttl_ms)
                    await pipe.execute()
            except REDIS_ERRORS as e:
                logger.warning("could not renew concurrency leases: %s", type(e).__name__)


async def read_usage(client: RedisClient, kid: str, days: int) -> dict[str, Any]:
    """A key's lifetime usage, per UTC day for the last ``days`` days, and its quota counters."""
    keys = _keys(kid)
    day_names = [usage_day(i) for i in range(days)]
    async with client.pipeline(transaction=False) as pipe:
        pipe.hgetall(keys["usage"])
        for day in day_names:
            pipe.hgetall(f"{keys['usage']}:d:{day}")
        pipe.hgetall(keys["quota"])
        pipe.zcard(keys["inflight"])
        rows = await pipe.execute()
    quota = {decoded(k): int(v) for k, v in rows[-2].items()}
    period = {k: v for k, v in quota.items() if k.startswith("p:")}
    return {
        "id": kid,
        **_counts(rows[0]),
        "daily": [{"date": d, **_counts(r)} for d, r in zip(day_names, rows[1:-2], strict=True)],
        "quota_consumed_tokens": quota.get("total", 0),
        "quota_period_consumed_tokens": next(iter(period.values()), 0),
        "in_flight": rows[-1],
    }


def _counts(raw: dict[bytes, bytes]) -> dict[str, int]:
    values = {decoded(k): int(v) for k, v in raw.items()}
    counts = {f: values.get(f, 0) for f in USAGE_FIELDS}
    counts["total_tokens"] = counts["prompt_tokens"] + counts["completion_tokens"]
    return counts


def _rate_headers(out: list[Any]) -> dict[str, str]:
    headers = {}
    for kind, at in (("requests", 3), ("tokens", 6)):
        if int(out[at]) >= 0:
            headers[f"x-ratelimit-limit-{kind}"] = str(out[at])
            headers[f"x-ratelimit-remaining-{kind}"] = str(out[at + 1])
            headers[f"x-ratelimit-reset-{kind}"] = duration(int(out[at + 2]))
    return headers


def duration(ms: int) -> str:
    """A wait as OpenAI writes it in x-ratelimit-reset-*: "20ms", "1.5s", "6m0s"."""
    if ms < 1000:
        return f"{max(ms, 0)}ms"
    minutes, seconds = divmod(ms / 1000, 60)
    text = f"{seconds:.3f}".rstrip("0").rstrip(".") + "s"
    return f"{int(minutes)}m{text}" if minutes else text


def _limit_error(
    which: str, retry_ms: int, reserve: int, headers: dict[str, str]
) -> RateLimitError:
    limit = _LIMIT_NAMES[which]
    if retry_ms < 0:
        if which == "quota":
            message = "You exceeded the token quota of this API key."
        else:
            message = (
                f"This request reserves {reserve} tokens, more than the key's {limit} "
                f"allows; lower max_tokens or the prompt."
            )
        return RateLimitError(
            message,
            code="insufficient_quota",
            type="insufficient_quota",
            headers={**headers, "x-should-retry": "false"},
        )
    retry_s = max(1, math.ceil(retry_ms / 1000))
    kind = "tokens" if which in ("tokens", "quota_period") else "requests"
    code = "insufficient_quota" if which == "quota_period" else "rate_limit_exceeded"
    return RateLimitError(
        f"Rate limit reached: {limit} of this API key. Please try again in {duration(retry_ms)}.",
        code=code,
        type=kind,
        retry_after_s=retry_s,
        headers=headers,
    )
