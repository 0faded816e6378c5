"""Where uploaded files and batch outputs keep their bytes: a ``BlobStore``.

The interface is the whole contract an S3-compatible store would have to keep (objects by name,
written whole, read whole, deleted; a name is ``<key id>/<object id>``, safe as a path or an
object key). ``LocalDirectoryStore`` is the default, a directory of ``[files] directory``;
gateways sharing batch work must share its directory (or another store). Metadata (who owns an
object, its size, its purpose) lives in Redis (``gateway.batches.files``), never here.
"""

from __future__ import annotations

import asyncio
import os
import re
import tempfile
from collections.abc import AsyncIterable
from pathlib import Path
from typing import Protocol

_NAME = re.compile(r"[0-9a-f]{64}/[A-Za-z0-9_.-]{1,128}")


class BlobTooLargeError(Exception):
    """An object's bytes passed the writer's limit; nothing of it was kept."""


class BlobStore(Protocol):
    """Objects by name. Each call is atomic for its object: a reader sees a whole object or
    none, and a failed or refused write leaves nothing behind."""

    async def put(self, name: str, chunks: AsyncIterable[bytes], max_bytes: int) -> int:
        """Writes the object ``name`` from ``chunks`` and answers its size; raises
        ``BlobTooLargeError`` past ``max_bytes`` (nothing kept)."""
        ...

    async def get(self, name: str) -> bytes:
        """The object's bytes; ``FileNotFoundError`` when there is none."""
        ...

    async def delete(self, name: str) -> None:
        """Deletes the object; no error when there is none."""
        ...


class LocalDirectoryStore:
    """A ``BlobStore`` in a local directory: one file per object, written to a temporary name
    and renamed into place, so that readers never see half an object."""

    def __init__(self, directory: str) -> None:
        self._root = Path(directory or Path(tempfile.gettempdir()) / "infermesh-files")
        self._root.mkdir(parents=True, exist_ok=True)

    async def put(self, name: str, chunks: AsyncIterable[bytes], max_bytes: int) -> int:
        path = self._path(name)
        await asyncio.to_thread(path.parent.mkdir, exist_ok=True)
        partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
        size = 0
        try:
            with partial.open("wb") as out:  # local disk: small writes, not worth a thread each
                async for chunk in chunks:
                    size += len(chunk)
                    if size > max_bytes:
                        raise BlobTooLargeError(name)
                    out.write(chunk)
            partial.replace(path)
        finally:
            partial.unlink(missing_ok=True)
        return size

    async def get(self, name: str) -> bytes:
        return await asyncio.to_thread(self._path(name).read_bytes)

    async def delete(self, name: str) -> None:
        await asyncio.to_thread(self._path(name).unlink, missing_ok=True)

    def _path(self, name: str) -> Path:
        if not _NAME.fullmatch(name):  # names are made by the gateway: a bad one is a bug
            raise ValueError(f"not a blob name: {name!r}")
        return self._root / name


async def one_chunk(data: bytes) -> AsyncIterable[bytes]:
    """``data`` as the chunks ``BlobStore.put`` takes."""
    yield data
