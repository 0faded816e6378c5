"""Stored responses (``store: true``, the default, as OpenAI's): what ``previous_response_id``,
``GET /v1/responses/{id}`` and its ``input_items`` read.

One Redis string per response, ``infermesh:response:{<key id>}:<response id>``, JSON, expiring
after ``[responses] ttl_s``. It carries the API key's hash tag (``gateway.accounts.keys``), so on
a Redis Cluster it lives in the key's slot, and a response is found only under the key that made it:
another key's lookup misses, a 404 like any unknown id. A response keeps its whole conversation
(the items of the responses before it, its input and its output), so continuing from it reads one
key, whatever became of the responses before it. Stored data counts against no limit and is never
logged. A Redis failure is a 503: nothing is answered as if no response were stored.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable
from typing import Any, TypeVar

import orjson

from gateway.accounts.keys import key_tag
from gateway.http.errors import ServiceUnavailableError
from gateway.http.json_body import dumps
from infermesh.redis_client import REDIS_ERRORS, RedisClient

PREFIX = "infermesh:response:"
T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]  # the response object, as answered
    input: list[dict[str, Any]]  # its own input items, as input_items lists them
    context: list[dict[str, Any]]  # the items of the responses it continued
    session: str  # the session its chain belongs to (gateway.mesh.affinity)

    def conversation(self) -> list[dict[str, Any]]:
        """What a response continuing from this one is preceded by."""
        return [*self.context, *self.input, *self.response["output"]]


def redis_key(kid: str, response_id: str) -> str:
    return f"{PREFIX}{key_tag(kid)}:{response_id}"


class ResponseStore:
    """The stored responses of every API key; each call names the key."""

    def __init__(self, client: RedisClient, ttl_s: int, retry_after_s: int) -> None:
        self._redis = client
        self._ttl_s = ttl_s
        self._retry_after_s = retry_after_s

    async def save(self, kid: str, stored: StoredResponse) -> None:
        key = redis_key(kid, stored.response["id"])
        await self._call(self._redis.set(key, dumps(dataclasses.asdict(stored)), ex=self._ttl_s))

    async def load(self, kid: str, response_id: str) -> StoredResponse | None:
        raw = await self._call(self._redis.get(redis_key(kid, response_id)))
        return None if raw is None else StoredResponse(**orjson.loads(raw))

    async def delete(self, kid: str, response_id: str) -> bool:
        return bool(await self._call(self._redis.delete(redis_key(kid, response_id))))

    async def _call(self, pending: Awaitable[T]) -> T:
        try:
            return await pending
        except REDIS_ERRORS as e:
            raise ServiceUnavailableError(
                "The response store is unavailable; try again shortly",
                code="response_store_unavailable",
                retry_after_s=self._retry_after_s,
            ) from e
