"""Serving OpenAI's Batch API (``/v1/batches``): create, retrieve, list, cancel, over
``gateway.batches``; and the batch's output and error files, written when it ends.

Every line of the input file is checked when the batch is created, as OpenAI checks them: a line
that is not JSON, lacks a field, names another endpoint than the batch's, repeats a
``custom_id``, asks to stream or is larger than a request body may be fails the batch's
validation (status ``failed``, each bad line in ``errors`` with its number), and no line runs. A
line that passes but that the endpoint refuses when it runs (a bad parameter, an unknown model)
gets its error answer in the error file; the others' answers are in the output file.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from typing import Annotated, Any, Literal

import orjson
from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

from gateway.accounts.state import API_KEY
from gateway.batches.files import Files
from gateway.batches.records import BatchLine, BatchRecord, LineResult, new_record
from gateway.batches.state import BATCH_RECORDS, BATCH_RUNNER, FILES
from gateway.config import CONFIG
from gateway.http import json_body
from gateway.http.errors import InvalidRequestError, ObjectNotFoundError
from gateway.http.validation import STRICT, parse_body, read_json
from gateway.openai.files import file_not_found

API = "openai"
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
_MAX_ERRORS = 1000  # validation errors listed (the first ones)


class BatchCreate(BaseModel):
    """The body of ``POST /v1/batches``."""

    model_config = STRICT
    input_file_id: str
    endpoint: Literal["/v1/chat/completions", "/v1/completions", "/v1/responses"]
    completion_window: Literal["24h"]
    metadata: (
        Annotated[dict[str, Annotated[str, Field(max_length=512)]], Field(max_length=16)] | None
    ) = None


class BatchListQuery(BaseModel):
    """The query of ``GET /v1/batches``: strings, so not strict."""

    model_config = ConfigDict(extra="ignore")
    limit: Annotated[int, Field(ge=1, le=100)] = 20
    after: str | None = None


def _error(line: int, code: str, message: str, param: str | None = None) -> dict[str, Any]:
    return {"code": code, "message": message, "param": param, "line": line}


def check_lines(
    data: bytes, endpoint: str, max_line_bytes: int, max_lines: int
) -> tuple[list[BatchLine], list[dict[str, Any]]]:
    """The input file's requests, and the errors that fail the batch (none: it may run)."""
    lines: list[BatchLine] = []
    errors: list[dict[str, Any]] = []
    seen: set[str] = set()
    for number, raw in enumerate(data.splitlines(), 1):
        if not raw.strip():
            continue
        if len(raw) > max_line_bytes:
            errors.append(
                _error(
                    number,
                    "request_too_large",
                    f"The line is larger than the limit of {max_line_bytes} bytes for one request.",
                )
            )
            continue
        try:
            line = orjson.loads(raw)
        except orjson.JSONDecodeError:
            errors.append(
                _error(number, "invalid_json_line", "This line is not parseable as valid JSON.")
            )
            continue
        problem = _line_problem(line, endpoint, seen)
        if problem is not None:
            errors.append(_error(number, *problem))
            continue
        seen.add(line["custom_id"])
        lines.append(BatchLine(line["custom_id"], line["url"], line["body"]))
    if not lines and not errors:
        errors.append(_error(0, "empty_file", "The input file has no requests."))
    if len(lines) > max_lines:
        errors.append(
            _error(
                0,
                "too_many_requests",
                f"The input file has {len(lines)} requests; a batch may have at most {max_lines}.",
            )
        )
    return lines, errors[:_MAX_ERRORS]


def _line_problem(line: Any, endpoint: str, seen: set[str]) -> tuple[str, str, str] | None:
    """(code, message, param) of what is wrong with a parsed line, if anything."""
    if not isinstance(line, dict):
        return "invalid_request", "A line must be a JSON object.", "line"
    custom_id = line.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return "missing_required_parameter", "The line has no 'custom_id' string.", "custom_id"
    if line.get("method") != "POST":
        return "invalid_method", "The line's 'method' must be 'POST'.", "method"
    if line.get("url") != endpoint:
        return (
            "mismatched_endpoint",
            f"The line's 'url' ({line.get('url')!r}) is not the batch's endpoint ({endpoint}).",
            "url",
        )
    body = line.get("body")
    if not isinstance(body, dict):
        return "missing_required_parameter", "The line has no 'body' object.", "body"
    if body.get("stream"):
        return (
            "invalid_request",
            "Batch requests cannot stream ('stream' must be false).",
            "body.stream",
        )
    if custom_id in seen:
        return (
            "duplicate_custom_id",
            "The custom_id for this request is a duplicate of another request. The custom_id "
            "parameter must be unique for each request in a batch.",
            "custom_id",
        )
    return None


def batch_object(record: BatchRecord) -> dict[str, Any]:
    return {
        "id": record.id,
        "object": "batch",
        "endpoint": record.endpoint,
        "errors": {"object": "list", "data": record.errors} if record.errors else None,
        "input_file_id": record.input_file_id,
        "completion_window": "24h",
        "status": record.status,
        "output_file_id": record.output_file_id,
        "error_file_id": record.error_file_id,
        "created_at": record.created_at,
        "in_progress_at": record.in_progress_at,
        "expires_at": record.expires_at,
        "finalizing_at": record.finalizing_at,
        "completed_at": record.completed_at,
        "failed_at": record.failed_at,
        "expired_at": record.expired_at,
        "cancelling_at": record.cancelling_at,
        "cancelled_at": record.cancelled_at,
        "request_counts": {
            "total": record.total,
            "completed": record.completed,
            "failed": record.failed,
        },
        "metadata": record.metadata,
        "usage": {
            "input_tokens": record.prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": record.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": record.prompt_tokens + record.completion_tokens,
        },
        "billed_tokens": record.billed_tokens,  # this gateway's: the tokens after the discount
    }


async def create_batch(request: web.Request) -> web.Response:
    body = parse_body(BatchCreate, await read_json(request))
    kid = request[API_KEY].id
    files = request.app[FILES]
    source = await files.get(kid, body.input_file_id)
    if source is None:
        raise file_not_found(body.input_file_id)
    if source.purpose != "batch":
        raise InvalidRequestError(
            f"The file {source.id} has purpose '{source.purpose}'; a batch's input file must "
            "have purpose 'batch'",
            param="input_file_id",
        )
    lines, errors = check_lines(
        await files.content(source),
        body.endpoint,
        request.config_dict[CONFIG].server.max_body_bytes,
        request.app[CONFIG].files.max_lines,
    )
    record = new_record(
        API,
        f"batch_{secrets.token_hex(12)}",
        kid,
        body.endpoint,
        source.id,
        len(lines),
        request.app[CONFIG].batches,
        body.metadata,
        errors,
    )
    await request.app[BATCH_RECORDS].create(record, [] if errors else lines)
    request.app[BATCH_RUNNER].wake()
    return json_body.json_response(batch_object(record))


async def retrieve_batch(request: web.Request) -> web.Response:
    return json_body.json_response(batch_object(await _batch(request)))


async def cancel_batch(request: web.Request) -> web.Response:
    record = await request.app[BATCH_RECORDS].cancel(await _batch(request))
    request.app[BATCH_RUNNER].wake()
    return json_body.json_response(batch_object(record))


async def list_batches(request: web.Request) -> web.Response:
    query = parse_body(BatchListQuery, dict(request.query))
    page, more = await request.app[BATCH_RECORDS].page(
        request[API_KEY].id, API, query.after, query.limit
    )
    return json_body.json_response(
        {
            "object": "list",
            "data": [batch_object(r) for r in page],
            "first_id": page[0].id if page else None,
            "last_id": page[-1].id if page else None,
            "has_more": more,
        }
    )


async def _batch(request: web.Request) -> BatchRecord:
    batch_id = request.match_info["batch_id"]
    record = await request.app[BATCH_RECORDS].get(request[API_KEY].id, batch_id)
    if record is None or record.api != API:
        raise ObjectNotFoundError(f"No such Batch object: {batch_id}", param="batch_id")
    return record


async def write_outputs(
    files: Files, record: BatchRecord, lines: list[BatchLine], results: Mapping[int, LineResult]
) -> dict[str, Any]:
    """The output file (the lines answered 2xx) and the error file (the others; and, when the
    batch expired, the lines it never ran), as OpenAI writes them; the record's file ids."""
    output: list[bytes] = []
    failed: list[bytes] = []
    for i, line in enumerate(lines):
        result = results.get(i)
        entry: dict[str, Any] = {
            "id": f"batch_req_{record.id.removeprefix('batch_')}_{i}",
            "custom_id": line.custom_id,
        }
        if result is not None:
            entry["response"] = {
                "status_code": result.status_code,
                "request_id": result.request_id,
                "body": result.body,
            }
            entry["error"] = None
            (output if result.succeeded else failed).append(orjson.dumps(entry))
        elif record.status == "expired":
            entry["response"] = None
            entry["error"] = {
                "code": "batch_expired",
                "message": "This request could not be executed before the completion window "
                "expired.",
            }
            failed.append(orjson.dumps(entry))
    changes: dict[str, Any] = {}
    stem = record.id.removeprefix("batch_")
    for field, name, entries in (
        ("output_file_id", "output", output),
        ("error_file_id", "error", failed),
    ):
        if entries:
            written = await files.write(
                record.owner,
                f"file-{stem}-{name}",
                f"{record.id}_{name}.jsonl",
                b"\n".join(entries) + b"\n",
            )
            changes[field] = written.id
    return changes
