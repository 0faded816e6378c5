"""Serving OpenAI's Files API (``/v1/files``): upload (multipart, as the SDK sends it), retrieve,
list, delete and content download, over ``gateway.batches.files``. A file is its key's: another
key's id is not found (404), never forbidden."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from aiohttp import BodyPartReader, web
from pydantic import BaseModel, ConfigDict, Field

from gateway.accounts.state import API_KEY
from gateway.batches.files import FileRecord
from gateway.batches.state import FILES
from gateway.batches.store import BlobTooLargeError
from gateway.config import CONFIG
from gateway.http import json_body
from gateway.http.errors import InvalidRequestError, ObjectNotFoundError, RequestTooLargeError
from gateway.http.validation import parse_body

# What uploads may be for: batch input, and OpenAI's catch-all.
_PURPOSES = ("batch", "user_data")
_FILENAME_MAX_CHARS = 255
_PURPOSE_MAX_BYTES = 64


class FileListQuery(BaseModel):
    """The query of ``GET /v1/files``: strings, so not strict."""

    model_config = ConfigDict(extra="ignore")
    purpose: str | None = None
    limit: Annotated[int, Field(ge=1, le=10_000)] = 10_000
    order: Literal["asc", "desc"] = "desc"
    after: str | None = None


def file_object(record: FileRecord) -> dict[str, Any]:
    return {
        "id": record.id,
        "object": "file",
        "bytes": record.bytes,
        "created_at": record.created_at,
        "filename": record.filename,
        "purpose": record.purpose,
        "status": "processed",
        "expires_at": None,
        "status_details": None,
    }


async def upload_file(request: web.Request) -> web.Response:
    """The parts ``purpose`` and ``file``; the file's bytes are written as they arrive, and
    nothing is kept of an upload that fails (too large, no purpose, a purpose not allowed)."""
    if not request.content_type.startswith("multipart/"):
        raise InvalidRequestError(
            "Uploads are multipart/form-data, with the parts 'file' and 'purpose'",
            param="file",
        )
    config = request.app[CONFIG].files
    kid = request[API_KEY].id
    files = request.app[FILES]
    purpose: str | None = None
    record: FileRecord | None = None
    try:
        async for part in await request.multipart():
            if not isinstance(part, BodyPartReader):
                continue
            if part.name == "purpose":
                raw = await part.read_chunk(_PURPOSE_MAX_BYTES)  # the rest of the part is skipped
                purpose = raw.decode("utf-8", "replace").strip()
            elif part.name == "file" and record is None:
                filename = (part.filename or "upload.jsonl")[:_FILENAME_MAX_CHARS]
                first = purpose if purpose in _PURPOSES else "batch"  # the SDK sends it first
                record = await files.create(
                    kid, filename, first, _chunks(part), config.max_file_bytes
                )
        if record is None:
            raise InvalidRequestError("The upload has no 'file' part", param="file")
        if purpose not in _PURPOSES:
            raise InvalidRequestError(
                f"Invalid value for 'purpose': {purpose!r}; this gateway takes "
                f"{', '.join(_PURPOSES)}",
                param="purpose",
            )
    except BlobTooLargeError:
        raise RequestTooLargeError(
            f"The file is larger than the limit of {config.max_file_bytes} bytes",
            param="file",
            code="file_too_large",
        ) from None
    except BaseException:
        if record is not None:
            await files.delete(kid, record.id)
        raise
    if purpose != record.purpose:
        record = await files.set_purpose(record, purpose)
    return json_body.json_response(file_object(record))


async def _chunks(part: BodyPartReader) -> AsyncIterator[bytes]:
    while chunk := await part.read_chunk():
        yield chunk


async def retrieve_file(request: web.Request) -> web.Response:
    return json_body.json_response(file_object(await _file(request)))


async def list_files(request: web.Request) -> web.Response:
    query = parse_body(FileListQuery, dict(request.query))
    kid = request[API_KEY].id
    files = request.app[FILES]
    ids = await files.page(kid, query.after, query.limit, query.order == "desc")
    records = [r for r in [await files.get(kid, i) for i in ids] if r is not None]
    if query.purpose is not None:
        records = [r for r in records if r.purpose == query.purpose]
    page = records[: query.limit]
    return json_body.json_response(
        {
            "object": "list",
            "data": [file_object(r) for r in page],
            "first_id": page[0].id if page else None,
            "last_id": page[-1].id if page else None,
            "has_more": len(ids) > query.limit,
        }
    )


async def delete_file(request: web.Request) -> web.Response:
    file_id = request.match_info["file_id"]
    if not await request.app[FILES].delete(request[API_KEY].id, file_id):
        raise file_not_found(file_id)
    return json_body.json_response({"id": file_id, "object": "file", "deleted": True})


async def file_content(request: web.Request) -> web.Response:
    record = await _file(request)
    try:
        data = await request.app[FILES].content(record)
    except FileNotFoundError:  # deleted meanwhile
        raise file_not_found(record.id) from None
    return web.Response(body=data, content_type="application/octet-stream")


async def _file(request: web.Request) -> FileRecord:
    file_id = request.match_info["file_id"]
    record = await request.app[FILES].get(request[API_KEY].id, file_id)
    if record is None:
        raise file_not_found(file_id)
    return record


def file_not_found(file_id: str) -> ObjectNotFoundError:
    return ObjectNotFoundError(f"No such File object: {file_id}", param="id")
