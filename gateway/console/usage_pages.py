"""The Usage page and its CSV: requests and tokens per API key per UTC day over the chosen
range, totals per tier, and the internal callers' usage (counted by the router) beside the keys'.
Read from the counters the gateway and the router keep (infermesh.usage,
gateway.accounts.limits)."""

from __future__ import annotations

import asyncio
import csv
import dataclasses
import io
from typing import Any, Literal

from aiohttp import web

from gateway.accounts import keys
from gateway.accounts.admin import UsageQuery
from gateway.accounts.limits import read_usage
from gateway.accounts.state import REDIS
from gateway.console import charts
from gateway.console.render import render, secure
from gateway.http.validation import parse_body
from infermesh.redis_client import RedisClient, decoded
from infermesh.usage import CALLERS, USAGE_FIELDS

_COUNTS = (*USAGE_FIELDS, "total_tokens")


@dataclasses.dataclass(frozen=True)
class OwnerUsage:
    """One API key's or internal caller's usage over the range."""

    kind: Literal["key", "caller"]
    id: str
    name: str
    tier: str
    daily: list[dict[str, Any]]  # oldest day first: {"date", *_COUNTS}
    totals: dict[str, int]


async def read_all(redis: RedisClient, days: int) -> tuple[list[OwnerUsage], list[OwnerUsage]]:
    """Every key's and every internal caller's usage over the last ``days`` days."""
    records = await keys.list_keys(redis)
    callers = sorted(decoded(c) for c in await redis.smembers(CALLERS))
    owners: list[tuple[Literal["key", "caller"], str, str, str]] = [
        *(("key", r.id, r.name, r.tier or "default") for r in records),
        *(("caller", c, c.removeprefix("cert:"), "internal") for c in callers),
    ]
    counts = await asyncio.gather(*(read_usage(redis, owner[1], days) for owner in owners))
    usages = [
        _owner_usage(*owner, c["daily"][::-1]) for owner, c in zip(owners, counts, strict=True)
    ]
    return [u for u in usages if u.kind == "key"], [u for u in usages if u.kind == "caller"]


def _owner_usage(
    kind: Literal["key", "caller"], oid: str, name: str, tier: str, daily: list[dict[str, Any]]
) -> OwnerUsage:
    totals = {f: sum(day[f] for day in daily) for f in _COUNTS}
    return OwnerUsage(kind, oid, name, tier, daily, totals)


def add_routes(router: web.UrlDispatcher) -> None:
    router.add_get("/usage", usage_page)
    router.add_get("/usage.csv", usage_csv)


async def usage_page(request: web.Request) -> web.Response:
    days = parse_body(UsageQuery, dict(request.query)).days
    key_usage, caller_usage = await read_all(request.config_dict[REDIS], days)
    dates = [d["date"] for d in key_usage[0].daily] if key_usage else []
    used = [u for u in key_usage if u.totals["requests"]]
    drawn = await asyncio.to_thread(_charts, dates, used) if used else []
    tiers: dict[str, dict[str, int]] = {}
    for u in key_usage:
        tier = tiers.setdefault(u.tier, dict.fromkeys(_COUNTS, 0))
        for f in _COUNTS:
            tier[f] += u.totals[f]
    return render(
        request,
        "usage.html",
        title="Usage",
        days=days,
        charts=drawn,
        rows=[(u, d) for d in _newest_first(dates) for u in used if _day(u, d)["requests"]],
        day_of=_day,
        tiers=sorted(tiers.items()),
        keys=key_usage,
        callers=caller_usage,
    )


def _charts(dates: list[str], used: list[OwnerUsage]) -> list[tuple[str, str]]:
    """(title, SVG) of each chart."""
    names = [u.name for u in used]
    # two keys may share a name: their series apart, by id
    labels = [f"{u.name} ({u.id[:8]})" if names.count(u.name) > 1 else u.name for u in used]
    labelled = list(zip(labels, used, strict=True))
    tokens = {label: [d["total_tokens"] for d in u.daily] for label, u in labelled}
    requests = {label: [d["requests"] for d in u.daily] for label, u in labelled}
    prompt, cached, completion = (
        [sum(day[f] for day in same_day) for same_day in zip(*(u.daily for u in used), strict=True)]
        for f in ("prompt_tokens", "cached_tokens", "completion_tokens")
    )
    kinds = {
        "prompt, not cached": [p - c for p, c in zip(prompt, cached, strict=True)],
        "prompt, cached": cached,
        "completion": completion,
    }
    return [
        (title, draw(title, dates, series, unit))
        for title, draw, series, unit in (
            ("Tokens per day, by key", charts.stacked_bars, tokens, "tokens"),
            ("Requests per day, by key", charts.lines, requests, "requests"),
            ("Tokens per day, by kind, all keys", charts.stacked_bars, kinds, "tokens"),
        )
    ]


def _newest_first(dates: list[str]) -> list[str]:
    return sorted(dates, reverse=True)


def _day(usage: OwnerUsage, date: str) -> dict[str, Any]:
    return next(d for d in usage.daily if d["date"] == date)


async def usage_csv(request: web.Request) -> web.StreamResponse:
    """One row per owner per day with requests: keys' and internal callers'."""
    days = parse_body(UsageQuery, dict(request.query)).days
    key_usage, caller_usage = await read_all(request.config_dict[REDIS], days)
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(["date", "kind", "id", "name", "tier", *_COUNTS])
    for u in [*key_usage, *caller_usage]:
        for day in u.daily:
            if day["requests"]:
                writer.writerow([day["date"], u.kind, u.id, u.name, u.tier, *map(day.get, _COUNTS)])
    return secure(
        web.Response(
            text=out.getvalue(),
            content_type="text/csv",
            charset="utf-8",
            headers={"Content-Disposition": f'attachment; filename="usage-{days}d.csv"'},
        )
    )
