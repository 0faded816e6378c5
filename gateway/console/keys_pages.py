"""The Keys pages: list and search, create (the key shown once), edit, disable, enable, rotate,
revoke; through the admin API's own operations (gateway.accounts.admin), so both apply one set
of rules. Every form's POST answers with a redirect to the page that shows its result; a new
key's plaintext comes to that page through the session (``gateway.console.session``)."""

from __future__ import annotations

import datetime
from typing import Any

from aiohttp import web

from gateway.accounts import admin, keys
from gateway.accounts.state import REDIS
from gateway.batches.records import BatchRecord
from gateway.batches.state import BATCH_RECORDS
from gateway.console import session
from gateway.console.render import redirect, render
from gateway.console.state import SESSION
from gateway.http.errors import InvalidRequestError
from gateway.http.validation import parse_body

# The form's fields for a key's settings, with their labels (also in the errors they cause).
LIMIT_LABELS = {
    "rpm": "Requests per minute",
    "tpm": "Tokens per minute",
    "max_concurrent": "Concurrent requests",
    "quota_tokens": "Lifetime token quota",
    "quota_period_tokens": "Tokens per period",
    "quota_period_s": "Period (seconds)",
    "weight": "Fair-queue weight (1-1000)",
}


_BATCHES_SHOWN = 20


def add_routes(router: web.UrlDispatcher) -> None:
    router.add_get("/keys", list_page)
    router.add_post("/keys", create)
    router.add_get("/keys/{id}", key_page)
    router.add_post("/keys/{id}", update)
    router.add_post("/keys/{id}/disable", disable)
    router.add_post("/keys/{id}/enable", enable)
    router.add_post("/keys/{id}/revoke", revoke)
    router.add_post("/keys/{id}/rotate", rotate)


def status(record: keys.KeyRecord, now_s: float) -> str:
    if record.revoked:
        return "revoked"
    if record.disabled:
        return "disabled"
    if record.expires_at is not None and record.expires_at <= now_s:
        return "expired"
    return "active"


async def list_page(request: web.Request) -> web.Response:
    query = request.query.get("q", "").strip()
    records = await keys.list_keys(request.config_dict[REDIS])
    if query:
        needle = query.lower()
        records = [
            r
            for r in records
            if needle in r.name.lower() or r.id.startswith(needle) or needle == (r.tier or "")
        ]
    now = datetime.datetime.now(datetime.UTC).timestamp()
    return render(
        request,
        "keys.html",
        title="Keys",
        keys=[(r, status(r, now)) for r in reversed(records)],  # newest first
        query=query,
        limit_labels=LIMIT_LABELS,
    )


async def key_page(request: web.Request) -> web.Response:
    redis = request.config_dict[REDIS]
    record = await admin.find_key(redis, request.match_info["id"])
    plaintext = await session.take_secret(redis, request, request[SESSION], record.id)
    now = datetime.datetime.now(datetime.UTC).timestamp()
    return render(
        request,
        "key.html",
        title=f"Key {record.name}",
        key=record,
        key_status=status(record, now),
        plaintext=plaintext,
        limit_labels=LIMIT_LABELS,
        batches=await batch_rows(request, record.id),
    )


async def create(request: web.Request) -> web.Response:
    form = await request.post()
    body = parse_body(admin.KeyCreate, _settings(form, clear_empty=False))
    plaintext, record = await admin.create_key(request.config_dict[REDIS], body)
    return await _show_new_key(request, record, plaintext)


async def _show_new_key(
    request: web.Request, record: keys.KeyRecord, plaintext: str
) -> web.Response:
    """A redirect to the new key's page, which shows ``plaintext`` once."""
    redis = request.config_dict[REDIS]
    await session.keep_secret(redis, request, request[SESSION], record.id, plaintext)
    return redirect(f"/console/keys/{record.id}")


async def update(request: web.Request) -> web.StreamResponse:
    kid = request.match_info["id"]
    body = parse_body(admin.KeyUpdate, _settings(await request.post(), clear_empty=True))
    await admin.update_key(request.config_dict[REDIS], kid, body)
    return redirect(f"/console/keys/{kid}")


async def disable(request: web.Request) -> web.StreamResponse:
    kid = request.match_info["id"]
    await admin.stop_key(request, kid, keys.disable_key)
    return redirect(f"/console/keys/{kid}")


async def enable(request: web.Request) -> web.StreamResponse:
    kid = request.match_info["id"]
    await admin.update_key(request.config_dict[REDIS], kid, admin.KeyUpdate(disabled=False))
    return redirect(f"/console/keys/{kid}")


async def revoke(request: web.Request) -> web.StreamResponse:
    kid = request.match_info["id"]
    await admin.stop_key(request, kid, keys.revoke_key)
    return redirect(f"/console/keys/{kid}")


async def rotate(request: web.Request) -> web.Response:
    plaintext, record = await admin.rotate_key(request, request.match_info["id"])
    return await _show_new_key(request, record, plaintext)


async def batch_rows(request: web.Request, kid: str) -> list[BatchRecord]:
    """The key's most recent batches, of both APIs."""
    batches, _ = await request.config_dict[BATCH_RECORDS].page(kid, None, None, _BATCHES_SHOWN)
    return batches


def _settings(form: Any, clear_empty: bool) -> dict[str, Any]:
    """The admin API's body from a key form: numbers as numbers, the expiry date (UTC) as unix
    seconds, models comma-separated; an empty field is left out, or with ``clear_empty``
    cleared (null)."""
    values: dict[str, Any] = {}
    for field in ("name", "tier", "models", "expires", *LIMIT_LABELS):
        text = str(form.get(field, "")).strip()
        if not text:
            if clear_empty and field != "name":
                values["expires_at" if field == "expires" else field] = None
            continue
        if field == "models":
            values[field] = [m.strip() for m in text.split(",") if m.strip()]
        elif field == "expires":
            values["expires_at"] = _unix_date(text)
        elif field in LIMIT_LABELS:
            values[field] = _whole_number(field, text)
        else:
            values[field] = text
    return values


def _whole_number(field: str, text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise InvalidRequestError(
            f"{LIMIT_LABELS[field]} must be a whole number, got {text[:40]!r}", param=field
        ) from None


def _unix_date(text: str) -> int:
    try:
        day = datetime.date.fromisoformat(text)
    except ValueError:
        raise InvalidRequestError(
            f"The expiry must be a date (YYYY-MM-DD), got {text[:40]!r}", param="expires_at"
        ) from None
    return int(datetime.datetime.combine(day, datetime.time(), datetime.UTC).timestamp())
