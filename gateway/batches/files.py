"""Uploaded files and the files batches write, per API key: their bytes in the ``BlobStore``,
their metadata in Redis.

Redis layout, with the key's hash tag (``gateway.accounts.keys``), so that a file is found
only under the key that owns it (another key's lookup misses: a 404 like any unknown id):

- ``infermesh:file:{<key id>}:<file id>``: a hash of the file's ``FileRecord`` fields.
- ``infermesh:files:{<key id>}``: a sorted set of the key's file ids by creation (ms), for
  listing.

An upload writes its bytes first and its metadata after, in one transaction: a file is listed
only once its bytes are whole, and an upload refused midway leaves nothing.
"""

from __future__ import annotations

import dataclasses
import secrets
import time
from collections.abc import AsyncIterable
from typing import cast

from gateway.accounts.keys import key_tag
from gateway.batches.store import BlobStore, one_chunk
from infermesh.redis_client import RedisClient, decoded


@dataclasses.dataclass(frozen=True)
class FileRecord:
    id: str
    bytes: int
    created_at: int  # unix s
    filename: str
    purpose: str  # "batch" (uploads), "batch_output" (what batches write)
    owner: str  # the key id

    @property
    def blob(self) -> str:
        return blob_name(self.owner, self.id)


def blob_name(kid: str, object_id: str) -> str:
    return f"{kid}/{object_id}"


def new_file_id() -> str:
    return f"file-{secrets.token_hex(12)}"


def _meta_key(kid: str, file_id: str) -> str:
    return f"infermesh:file:{key_tag(kid)}:{file_id}"


def _index_key(kid: str) -> str:
    return f"infermesh:files:{key_tag(kid)}"


class Files:
    """The files of every key; each call names the key. Redis errors propagate (503)."""

    def __init__(self, client: RedisClient, store: BlobStore) -> None:
        self._redis = client
        self.store = store

    async def create(
        self,
        kid: str,
        filename: str,
        purpose: str,
        chunks: AsyncIterable[bytes],
        max_bytes: int,
        file_id: str | None = None,
    ) -> FileRecord:
        """Stores a file's bytes, then its metadata; ``BlobTooLargeError`` past ``max_bytes``."""
        file_id = file_id or new_file_id()
        size = await self.store.put(blob_name(kid, file_id), chunks, max_bytes)
        record = FileRecord(file_id, size, int(time.time()), filename, purpose, kid)
        try:
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.hset(_meta_key(kid, file_id), mapping=_fields(record))  # type: ignore[arg-type]
                pipe.zadd(_index_key(kid), {file_id: time.time_ns() // 1_000_000})
                await pipe.execute()
        except BaseException:
            await self.store.delete(blob_name(kid, file_id))
            raise
        return record

    async def write(self, kid: str, file_id: str, filename: str, data: bytes) -> FileRecord:
        """A file a batch writes (its output or errors), under a name it chose."""
        return await self.create(kid, filename, "batch_output", one_chunk(data), len(data), file_id)

    async def set_purpose(self, record: FileRecord, purpose: str) -> FileRecord:
        await self._redis.hset(_meta_key(record.owner, record.id), "purpose", purpose)
        return dataclasses.replace(record, purpose=purpose)

    async def get(self, kid: str, file_id: str) -> FileRecord | None:
        raw = await self._redis.hgetall(_meta_key(kid, file_id))
        fields = {decoded(k): decoded(v) for k, v in raw.items()}
        if not fields:
            return None
        return FileRecord(
            id=file_id,
            bytes=int(fields["bytes"]),
            created_at=int(fields["created_at"]),
            filename=fields["filename"],
            purpose=fields["purpose"],
            owner=kid,
        )

    async def page(self, kid: str, after: str | None, limit: int, newest_first: bool) -> list[str]:
        """Up to ``limit`` + 1 file ids (the extra one tells there are more), from after
        ``after``; [] when ``after`` is not a file of the key."""
        index = _index_key(kid)
        start = 0
        if after is not None:
            rank = await (
                self._redis.zrevrank(index, after)
                if newest_first
                else self._redis.zrank(index, after)
            )
            if rank is None:
                return []
            start = cast(int, rank) + 1
        ids = cast(
            list[bytes | str],
            await self._redis.zrange(index, start, start + limit, desc=newest_first),
        )
        return [decoded(i) for i in ids]

    async def content(self, record: FileRecord) -> bytes:
        return await self.store.get(record.blob)

    async def delete(self, kid: str, file_id: str) -> bool:
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.delete(_meta_key(kid, file_id))
            pipe.zrem(_index_key(kid), file_id)
            deleted, _ = await pipe.execute()
        if deleted:
            await self.store.delete(blob_name(kid, file_id))
        return bool(deleted)


def _fields(record: FileRecord) -> dict[str, str]:
    return {
        "bytes": str(record.bytes),
        "created_at": str(record.created_at),
        "filename": record.filename,
        "purpose": record.purpose,
    }
