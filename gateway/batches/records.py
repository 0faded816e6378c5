"""Batches in Redis: each batch's record, its lines' claims and results, so that any gateway
process can run its lines and a batch outlives the process that created it.

Redis layout, every key of one batch with its API key's hash tag (one Redis Cluster slot, so
one script touches them all, and a batch is found only under the key that owns it):

- ``infermesh:batch:{<key id>}:<batch id>``: a hash of the ``BatchRecord`` fields, with
  ``next``, the first line never claimed.
- ``...:claims``: line -> ``<expiry ms>:<owner>``, the lines runners hold now (claim.lua,
  renew.lua). A runner that dies stops renewing; its lines are claimed again once their claims
  run out.
- ``...:results``: line -> the line's result (JSON), written once (settle.lua): a line is settled
  once whichever runner ran it, counted once in ``completed`` or ``failed``, and its usage billed
  once to the key's usage (``infermesh.usage``) by the same script.
- ``infermesh:batches:{<key id>}``: the key's batch ids by creation (ms), for listing.
- ``infermesh:batches:active``: ``<key id>/<batch id>`` of every batch not yet ended, what the
  runners look through (another slot: written beside, never in, a batch's scripts).

The lines themselves are a blob (``gateway.batches.store``), ``<key id>/<batch id>.lines``: JSONL
of ``{"custom_id", "url", "body"}``, validated before the batch is recorded.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import time
from typing import Any, cast

import orjson

from gateway.accounts.keys import key_tag
from gateway.accounts.usage import TokenUsage
from gateway.batches.files import blob_name
from gateway.batches.store import BlobStore, one_chunk
from gateway.config import BatchesSection
from infermesh.redis_client import RedisClient, decoded
from infermesh.usage import USAGE_DAY_TTL_S, usage_day, usage_key

ACTIVE = "infermesh:batches:active"
_LUA = importlib.resources.files("gateway.batches") / "lua"

# An ended batch is one of these; the others are still running (or being finalized).
ENDED = ("completed", "failed", "expired", "cancelled")
_TIMES = (
    "in_progress_at",
    "finalizing_at",
    "completed_at",
    "failed_at",
    "expired_at",
    "cancelling_at",
    "cancelled_at",
)


@dataclasses.dataclass(frozen=True)
class BatchLine:
    custom_id: str
    url: str  # the endpoint, as a path under the gateway's root ("/v1/chat/completions")
    body: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class BatchRecord:
    """A batch as both APIs describe it (each in its own shape); times in unix s, None: not
    yet."""

    id: str
    owner: str  # the key id
    api: str  # "openai" or "anthropic": the API whose routes show it
    endpoint: str
    input_file_id: str
    total: int
    status: str  # validating..cancelled, OpenAI's names
    created_at: int
    expires_at: int
    discount: float  # the fraction of its tokens not billed, as configured when it was made
    completed: int = 0  # lines that succeeded (2xx)
    failed: int = 0  # lines that got an error answer
    prompt_tokens: int = 0
    completion_tokens: int = 0
    metadata: dict[str, str] | None = None
    errors: list[dict[str, Any]] | None = None  # why validation failed it
    output_file_id: str | None = None
    error_file_id: str | None = None
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None

    @property
    def settled(self) -> int:
        return self.completed + self.failed

    @property
    def billed_tokens(self) -> int:
        """What the batch's tokens are billed as, after the batch discount."""
        return round((self.prompt_tokens + self.completion_tokens) * (1 - self.discount))

    @property
    def ref(self) -> str:
        """How ``ACTIVE`` names it."""
        return f"{self.owner}/{self.id}"


@dataclasses.dataclass(frozen=True)
class LineResult:
    """What one line got: its answer (``status_code`` 0: none, the batch ended first)."""

    custom_id: str
    status_code: int
    request_id: str
    body: Any

    @property
    def succeeded(self) -> bool:
        return 200 <= self.status_code < 300


def batch_key(kid: str, batch_id: str) -> str:
    return f"infermesh:batch:{key_tag(kid)}:{batch_id}"


def lines_blob(kid: str, batch_id: str) -> str:
    return blob_name(kid, f"{batch_id}.lines")


def _index_key(kid: str) -> str:
    return f"infermesh:batches:{key_tag(kid)}"


def _encode(values: dict[str, Any]) -> dict[str, str]:
    """Hash fields of a record's values; None values are left out."""
    return {
        name: orjson.dumps(value).decode() if name in ("metadata", "errors") else str(value)
        for name, value in values.items()
        if value is not None
    }


def _decode(fields: dict[str, str]) -> BatchRecord:
    values: dict[str, Any] = {}
    for field in dataclasses.fields(BatchRecord):
        raw = fields.get(field.name)
        if raw is None:
            continue
        if field.name in ("metadata", "errors"):
            values[field.name] = orjson.loads(raw)
        elif field.name == "discount":
            values[field.name] = float(raw)
        elif field.type in ("int", "int | None"):
            values[field.name] = int(raw)
        else:
            values[field.name] = raw
    return BatchRecord(**values)


class BatchRecords:
    """Every key's batches; each call names the key. Redis errors propagate (503)."""

    def __init__(self, client: RedisClient, store: BlobStore) -> None:
        self.redis = client
        self._redis = client
        self._store = store
        self._claim = client.register_script((_LUA / "claim.lua").read_text())
        self._renew = client.register_script((_LUA / "renew.lua").read_text())
        self._settle = client.register_script((_LUA / "settle.lua").read_text())
        self._cancel = client.register_script((_LUA / "cancel.lua").read_text())

    async def create(self, record: BatchRecord, lines: list[BatchLine]) -> None:
        """Stores the lines, then the record (and, unless it failed validation, marks it for
        the runners)."""
        blob = b"".join(orjson.dumps(dataclasses.asdict(line)) + b"\n" for line in lines)
        name = lines_blob(record.owner, record.id)
        await self._store.put(name, one_chunk(blob), len(blob))
        try:
            async with self._redis.pipeline(transaction=True) as pipe:
                fields = _encode(dataclasses.asdict(record))
                pipe.hset(batch_key(record.owner, record.id), mapping=fields)  # type: ignore[arg-type]
                pipe.zadd(_index_key(record.owner), {record.id: time.time_ns() // 1_000_000})
                await pipe.execute()
            if record.status not in ENDED:
                await self._redis.sadd(ACTIVE, record.ref)
        except BaseException:
            await self._store.delete(name)
            raise

    async def get(self, kid: str, batch_id: str) -> BatchRecord | None:
        raw = await self._redis.hgetall(batch_key(kid, batch_id))
        if not raw:
            return None
        fields = {decoded(k): decoded(v) for k, v in raw.items()}
        return _decode({**fields, "id": batch_id, "owner": kid})

    async def page(
        self, kid: str, api: str | None, after: str | None, limit: int
    ) -> tuple[list[BatchRecord], bool]:
        """The key's batches of ``api`` (None: of both), newest first, from after ``after``; and
        whether there are more."""
        listed = cast(
            list[bytes | str], await self._redis.zrange(_index_key(kid), 0, -1, desc=True)
        )
        ids = [decoded(i) for i in listed]
        if after is not None:
            ids = ids[ids.index(after) + 1 :] if after in ids else []
        out: list[BatchRecord] = []
        for batch_id in ids:
            record = await self.get(kid, batch_id)
            if record is not None and api in (None, record.api):
                if len(out) == limit:
                    return out, True
                out.append(record)
        return out, False

    async def set(self, record: BatchRecord, **changes: Any) -> BatchRecord:
        """The record with ``changes`` written, and only them (the counts the runners add to
        are left as they are in Redis)."""
        fields = _encode(changes)
        await self._redis.hset(batch_key(record.owner, record.id), mapping=fields)  # type: ignore[arg-type]
        return dataclasses.replace(record, **changes)

    async def cancel(self, record: BatchRecord) -> BatchRecord:
        """Stops new lines of a running batch (the runners finish what they hold, then one
        finalizes it); any other batch is answered as it is."""
        now = int(time.time())
        await self._cancel(keys=[batch_key(record.owner, record.id)], args=[now])
        return await self.get(record.owner, record.id) or record

    async def active(self) -> list[tuple[str, str]]:
        """(key id, batch id) of every batch not ended."""
        refs = [decoded(r) for r in await self._redis.smembers(ACTIVE)]
        return [(ref.partition("/")[0], ref.partition("/")[2]) for ref in refs]

    async def ended(self, record: BatchRecord) -> None:
        """Forgets an ended batch's claims, results and lines (its files hold them now)."""
        key = batch_key(record.owner, record.id)
        await self._redis.delete(f"{key}:claims", f"{key}:results")
        await self._redis.srem(ACTIVE, record.ref)
        await self._store.delete(lines_blob(record.owner, record.id))

    async def lines(self, record: BatchRecord) -> list[BatchLine]:
        blob = await self._store.get(lines_blob(record.owner, record.id))
        return [BatchLine(**orjson.loads(line)) for line in blob.splitlines() if line]

    async def claim(self, record: BatchRecord, owner: str, most: int, lease_s: float) -> list[int]:
        key = batch_key(record.owner, record.id)
        taken = await self._claim(
            keys=[key, f"{key}:claims"],
            args=[time.time_ns() // 1_000_000, int(lease_s * 1000), owner, most],
        )
        return [int(decoded(line)) for line in taken]

    async def renew(
        self, record: BatchRecord, owner: str, lines: list[int], lease_s: float
    ) -> None:
        expiry = time.time_ns() // 1_000_000 + int(lease_s * 1000)
        await self._renew(
            keys=[f"{batch_key(record.owner, record.id)}:claims"], args=[expiry, owner, *lines]
        )

    async def give_back(self, record: BatchRecord, owner: str, line: int) -> None:
        """A claimed line this runner will not run: claimed again by the next runner to ask."""
        await self._renew(
            keys=[f"{batch_key(record.owner, record.id)}:claims"], args=[0, owner, line]
        )

    async def live_claims(self, record: BatchRecord) -> int:
        """Lines some runner holds and still renews."""
        claims = await self._redis.hvals(f"{batch_key(record.owner, record.id)}:claims")
        now_ms = time.time_ns() // 1_000_000
        return sum(int(decoded(c).partition(":")[0]) >= now_ms for c in claims)

    async def settle(
        self, record: BatchRecord, line: int, result: LineResult, usage: TokenUsage
    ) -> bool:
        """Keeps ``result`` as the line's and bills ``usage`` to the batch's key (its lifetime
        and today's usage, one request, and ``batch_billed_tokens`` after the batch's discount),
        in one script, unless the line has a result already (False: nothing kept or billed)."""
        key = batch_key(record.owner, record.id)
        lifetime = usage_key(record.owner)
        tokens = usage.prompt_tokens + usage.completion_tokens
        settled = await self._settle(
            keys=[key, f"{key}:results", f"{key}:claims", lifetime, f"{lifetime}:d:{usage_day()}"],
            args=[
                line,
                orjson.dumps(dataclasses.asdict(result)),
                "completed" if result.succeeded else "failed",
                usage.prompt_tokens,
                usage.completion_tokens,
                usage.cached_prompt_tokens,
                round(tokens * (1 - record.discount)),
                USAGE_DAY_TTL_S,
            ],
        )
        return bool(settled)

    async def results(self, record: BatchRecord) -> dict[int, LineResult]:
        raw = await self._redis.hgetall(f"{batch_key(record.owner, record.id)}:results")
        return {int(decoded(k)): LineResult(**orjson.loads(v)) for k, v in raw.items()}


def new_record(
    api: str,
    batch_id: str,
    owner: str,
    endpoint: str,
    input_file_id: str,
    total: int,
    config: BatchesSection,
    metadata: dict[str, str] | None = None,
    errors: list[dict[str, Any]] | None = None,
) -> BatchRecord:
    """A batch as it is created: running, or failed when its validation found ``errors``."""
    now = int(time.time())
    return BatchRecord(
        id=batch_id,
        owner=owner,
        api=api,
        endpoint=endpoint,
        input_file_id=input_file_id,
        total=0 if errors else total,
        status="failed" if errors else "in_progress",
        created_at=now,
        expires_at=now + config.completion_window_s,
        discount=config.discount,
        metadata=metadata,
        errors=errors or None,
        failed_at=now if errors else None,
        in_progress_at=None if errors else now,
    )
