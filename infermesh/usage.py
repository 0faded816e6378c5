"""Where a caller's token usage is counted in Redis: one layout for every service that counts.

``infermesh:usage:{<owner>}`` holds an owner's lifetime counts and
``infermesh:usage:{<owner>}:d:<YYYY-MM-DD>`` those of one UTC day (kept ``USAGE_DAY_TTL_S``):
hashes of ``USAGE_FIELDS``. The owner is an API key's id, counted by the gateway's settlement
script beside the key's limits (the hash tag keeps them in one Redis Cluster slot), or an internal
gRPC caller's certificate identity (``identity_owner``), counted by the router that served it.
"""

from __future__ import annotations

import datetime

from infermesh.pb import common_pb2
from infermesh.redis_client import RedisClient

USAGE_FIELDS = ("requests", "prompt_tokens", "completion_tokens", "cached_tokens")
USAGE_DAY_TTL_S = 400 * 86400
# The owners count_usage counted (a set), so the console can list the internal callers.
CALLERS = "infermesh:callers"
_IDENTITY_PREFIX = "spiffe://infermesh/"


def usage_key(owner: str) -> str:
    """The hash of ``owner``'s lifetime counts; its day's hash appends ``:d:<day>``."""
    return f"infermesh:usage:{{{owner}}}"


def usage_day(offset: int = 0) -> str:
    """The UTC date ``offset`` days ago, as the daily hashes name it."""
    today = datetime.datetime.now(datetime.UTC).date()
    return (today - datetime.timedelta(days=offset)).isoformat()


def identity_owner(uri: str) -> str:
    """The owner an internal caller's usage is counted under: ``cert:`` and its certificate's
    identity (``spiffe://infermesh/client/billing`` -> ``cert:client/billing``)."""
    return "cert:" + uri.removeprefix(_IDENTITY_PREFIX)


async def count_usage(client: RedisClient, owner: str, usage: common_pb2.Usage) -> None:
    """Adds one request and its tokens to ``owner``'s lifetime and today's counts, at once, and
    ``owner`` to the set of ``CALLERS``."""
    lifetime = usage_key(owner)
    day = f"{lifetime}:d:{usage_day()}"
    counts = {
        "requests": 1,
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "cached_tokens": usage.cached_prompt_tokens,
    }
    async with client.pipeline(transaction=True) as pipe:
        for key in (lifetime, day):
            for field, amount in counts.items():
                pipe.hincrby(key, field, amount)
        pipe.expire(day, USAGE_DAY_TTL_S)
        await pipe.execute()
    await client.sadd(CALLERS, owner)  # another slot than the counts': not in their transaction
