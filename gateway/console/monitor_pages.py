"""The Fleet page (the router's workers, as ``GET /admin/fleet`` lists them) and the Recent
requests page (gateway.recent), their trace ids linked to Jaeger when ``[console] jaeger_url``
is set."""

from __future__ import annotations

from typing import Annotated

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

from gateway.admin import worker_json
from gateway.console.render import render
from gateway.mesh_client import MESH
from gateway.recent import CONSOLE_CONFIG, RECENT
from gateway.validation import parse_body


class RecentQuery(BaseModel):
    model_config = ConfigDict(extra="ignore")
    key: Annotated[str, Field(pattern="^([0-9a-f]{64})?$")] = ""
    count: Annotated[int, Field(ge=1, le=1000)] = 50


def add_routes(router: web.UrlDispatcher) -> None:
    router.add_get("/fleet", fleet_page)
    router.add_get("/requests", recent_page)


async def fleet_page(request: web.Request) -> web.Response:
    workers = await request.config_dict[MESH].list_workers()
    rows = [worker_json(w) for w in sorted(workers, key=lambda w: w.worker.worker_id)]
    return render(request, "fleet.html", title="Fleet", workers=rows)


async def recent_page(request: web.Request) -> web.Response:
    query = parse_body(RecentQuery, dict(request.query))
    entries = await request.config_dict[RECENT].read(query.key or None, query.count)
    return render(
        request,
        "recent.html",
        title="Recent requests",
        entries=entries,
        key=query.key,
        count=query.count,
        jaeger_url=request.config_dict[CONSOLE_CONFIG].jaeger_url.rstrip("/"),
    )
