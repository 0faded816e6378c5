"""The usage of internal callers: services that call the router's Generate/Complete with a
client certificate (``spiffe://infermesh/client/<name>``) instead of an API key. The gateway
counts its keys' usage itself; these callers have no gateway in front, so the router counts
each request they make under their certificate's identity, in the layout API keys' usage has
(``infermesh.usage``; ``GET /admin/clients/{name}/usage`` reads it). Without TLS there is no
identity, and nothing is counted."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import grpc

from infermesh.authz import peer_of
from infermesh.pb import common_pb2
from infermesh.redis_client import REDIS_ERRORS, RedisClient
from infermesh.usage import count_usage, identity_owner

logger = logging.getLogger(__name__)


class CallerUsage:
    """Counts internal callers' requests in Redis, off the request's path."""

    def __init__(self, redis: RedisClient) -> None:
        self._redis = redis
        self._pending: set[asyncio.Task[None]] = set()

    def owner(self, context: grpc.aio.ServicerContext[Any, Any]) -> str:
        """Whom the call's usage is counted for: an internal caller's identity, else ""
        (a gateway counts its own requests)."""
        peer = peer_of(context)
        return identity_owner(peer.uri) if peer.role == "client" else ""

    def count(self, owner: str, usage: common_pb2.Usage) -> None:
        """Counts one request of ``owner`` with ``usage``, in the background: the reply does
        not wait for Redis (a call that ended by cancellation counts too)."""
        task = asyncio.create_task(self._count(owner, usage))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _count(self, owner: str, usage: common_pb2.Usage) -> None:
        try:
            await count_usage(self._redis, owner, usage)
        except REDIS_ERRORS as e:
            logger.warning("usage of %s not counted: Redis failed (%s)", owner, e)

    async def close(self) -> None:
        """Waits for the counts under way, then closes the connection."""
        await asyncio.gather(*self._pending)
        await self._redis.aclose()
