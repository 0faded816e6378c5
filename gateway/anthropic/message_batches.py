"""Serving Anthropic's Message Batches API (``/v1/messages/batches``): create, retrieve, list,
cancel and results (JSONL), on the same runner as OpenAI's batches (``gateway.batches``).

A batch's requests come in its body. They are checked when it is created, as OpenAI's batch lines
are: each ``custom_id`` Anthropic's pattern and unique, each ``params`` a valid ``POST
/v1/messages`` body (its fields, as ``gateway.anthropic.messages`` parses them) not asking to
stream and no larger than a request body may be. A batch with a bad request is refused whole (400,
the error's ``param`` naming the request: ``requests.<i>.params.<field>``), nothing stored. What
only running a request can tell (a model not served, a prompt longer than its context) is an
``errored`` result with Anthropic's error.
"""

from __future__ import annotations

import datetime
import secrets
from collections.abc import Mapping
from typing import Annotated, Any

import orjson
from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from gateway.accounts.state import API_KEY
from gateway.anthropic import messages_protocol as wire
from gateway.batches.files import Files, blob_name
from gateway.batches.records import (
    ENDED,
    BatchLine,
    BatchRecord,
    LineResult,
    new_record,
)
from gateway.batches.state import BATCH_RECORDS, BATCH_RUNNER, FILES
from gateway.batches.store import one_chunk
from gateway.config import CONFIG
from gateway.http.errors import InvalidRequestError, ObjectNotFoundError
from gateway.http.json_body import dumps, json_response
from gateway.http.validation import STRICT, parse_body, read_json

API = "anthropic"
_ENDPOINT = "/v1/messages"
_MAX_REQUESTS = 100_000  # Anthropic's limit per batch
_PATH = "/v1/messages/batches"


class BatchRequest(BaseModel):
    model_config = STRICT
    custom_id: Annotated[str, StringConstraints(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    params: dict[str, Any]


class MessageBatchCreate(BaseModel):
    """The body of ``POST /v1/messages/batches``."""

    model_config = STRICT
    requests: Annotated[list[BatchRequest], Field(min_length=1, max_length=_MAX_REQUESTS)]


class MessageBatchListQuery(BaseModel):
    """The query of ``GET /v1/messages/batches``: strings, so not strict."""

    model_config = ConfigDict(extra="ignore")
    limit: Annotated[int, Field(ge=1, le=1000)] = 20
    after_id: str | None = None


def _time(ts: int | None) -> str | None:
    if ts is None:
        return None
    return datetime.datetime.fromtimestamp(ts, datetime.UTC).isoformat().replace("+00:00", "Z")


def _results_blob(record: BatchRecord) -> str:
    return blob_name(record.owner, f"{record.id}.results")


def batch_object(record: BatchRecord, request: web.Request) -> dict[str, Any]:
    ended = record.status in ENDED
    unsettled = record.total - record.settled
    status = "ended" if ended else "canceling" if record.status == "cancelling" else "in_progress"
    base = request.path[: request.path.index(_PATH)]
    return {
        "id": record.id,
        "type": "message_batch",
        "processing_status": status,
        "request_counts": {
            "processing": 0 if ended else unsettled,
            "succeeded": record.completed,
            "errored": record.failed,
            "canceled": unsettled if record.status == "cancelled" else 0,
            "expired": unsettled if record.status == "expired" else 0,
        },
        "ended_at": _time(record.completed_at or record.cancelled_at or record.expired_at),
        "created_at": _time(record.created_at),
        "expires_at": _time(record.expires_at),
        "archived_at": None,
        "cancel_initiated_at": _time(record.cancelling_at),
        "results_url": f"{request.url.origin()}{base}{_PATH}/{record.id}/results"
        if ended
        else None,
    }


async def create_message_batch(request: web.Request) -> web.Response:
    body = parse_body(MessageBatchCreate, await read_json(request))
    limit = request.config_dict[CONFIG].server.max_body_bytes
    seen: set[str] = set()
    for i, item in enumerate(body.requests):
        if item.custom_id in seen:
            raise InvalidRequestError(
                f"Duplicate custom_id '{item.custom_id}': each request's custom_id must be "
                "unique within the batch",
                param=f"requests.{i}.custom_id",
            )
        seen.add(item.custom_id)
        _check_params(i, item.params)
        if item.params.get("stream"):
            raise InvalidRequestError(
                "Batch requests cannot stream", param=f"requests.{i}.params.stream"
            )
        if len(dumps(item.params)) > limit:
            raise InvalidRequestError(
                f"The request's params are larger than the limit of {limit} bytes for one request",
                param=f"requests.{i}.params",
            )
    lines = [BatchLine(item.custom_id, _ENDPOINT, item.params) for item in body.requests]
    record = new_record(
        API,
        f"msgbatch_{secrets.token_hex(12)}",
        request[API_KEY].id,
        _ENDPOINT,
        "",
        len(lines),
        request.app[CONFIG].batches,
    )
    await request.app[BATCH_RECORDS].create(record, lines)
    request.app[BATCH_RUNNER].wake()
    return json_response(batch_object(record, request))


def _check_params(i: int, params: dict[str, Any]) -> None:
    """A 400 naming request ``i``'s bad parameter when its ``params`` are no Messages body."""
    try:
        wire.parse_messages_request(params, wire.MessagesRequest).check_budget()
    except InvalidRequestError as e:
        param = f"requests.{i}.params" + (f".{e.param}" if e.param else "")
        raise InvalidRequestError(f"requests.{i}.params: {e.message}", param=param) from None


async def retrieve_message_batch(request: web.Request) -> web.Response:
    return json_response(batch_object(await _batch(request), request))


async def cancel_message_batch(request: web.Request) -> web.Response:
    record = await request.app[BATCH_RECORDS].cancel(await _batch(request))
    request.app[BATCH_RUNNER].wake()
    return json_response(batch_object(record, request))


async def list_message_batches(request: web.Request) -> web.Response:
    query = parse_body(MessageBatchListQuery, dict(request.query))
    page, more = await request.app[BATCH_RECORDS].page(
        request[API_KEY].id, API, query.after_id, query.limit
    )
    return json_response(
        {
            "data": [batch_object(r, request) for r in page],
            "has_more": more,
            "first_id": page[0].id if page else None,
            "last_id": page[-1].id if page else None,
        }
    )


async def message_batch_results(request: web.Request) -> web.Response:
    record = await _batch(request)
    if record.status not in ENDED:
        raise InvalidRequestError(
            f"Message batch {record.id} is still {record.status}; its results are available "
            "once it has ended"
        )
    try:
        data = await request.app[FILES].store.get(_results_blob(record))
    except FileNotFoundError:
        raise _not_found(record.id) from None
    return web.Response(body=data, content_type="application/binary")


async def _batch(request: web.Request) -> BatchRecord:
    batch_id = request.match_info["batch_id"]
    record = await request.app[BATCH_RECORDS].get(request[API_KEY].id, batch_id)
    if record is None or record.api != API:
        raise _not_found(batch_id)
    return record


def _not_found(batch_id: str) -> ObjectNotFoundError:
    return ObjectNotFoundError(f"No message batch with id '{batch_id}'", param="batch_id")


async def write_results(
    files: Files, record: BatchRecord, lines: list[BatchLine], results: Mapping[int, LineResult]
) -> dict[str, Any]:
    """Every request's result, in the batch's order: succeeded with its message, errored with
    Anthropic's error, canceled or expired when it never ran."""
    out: list[bytes] = []
    for i, line in enumerate(lines):
        result = results.get(i)
        if result is None:
            outcome: dict[str, Any] = {
                "type": "canceled" if record.status == "cancelled" else "expired"
            }
        elif result.succeeded:
            outcome = {"type": "succeeded", "message": result.body}
        else:
            outcome = {"type": "errored", "error": result.body}
        out.append(orjson.dumps({"custom_id": line.custom_id, "result": outcome}))
    data = b"\n".join(out) + b"\n"
    await files.store.put(_results_blob(record), one_chunk(data), len(data))
    return {}
