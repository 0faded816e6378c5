"""The Fleet page (the router's workers, as ``GET /admin/fleet`` lists them) and the Recent
requests page (gateway.accounts.recent), their trace ids linked to Jaeger when
``[console] jaeger_url`` is set."""

from __future__ import annotations

import logging
from typing import Annotated

import aiohttp
from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

from gateway.accounts.admin import worker_json
from gateway.accounts.recent import recent_requests
from gateway.config import CONFIG
from gateway.console.render import render
from gateway.console.router_metrics import RouterFigures, read_router_figures
from gateway.http.validation import parse_body
from gateway.mesh.state import MESH
from infermesh.redact import redact_url, redact_urls_in
from telemetry import metrics

logger = logging.getLogger(__name__)


class RecentQuery(BaseModel):
    model_config = ConfigDict(extra="ignore")
    # not "key": key-like query parameters are refused (gateway.http.middleware)
    key_id: Annotated[str, Field(pattern="^([0-9a-f]{64})?$")] = ""
    count: Annotated[int, Field(ge=1, le=1000)] = 50


def add_routes(router: web.UrlDispatcher) -> None:
    router.add_get("/fleet", fleet_page)
    router.add_get("/requests", recent_page)


async def fleet_page(request: web.Request) -> web.Response:
    workers = await request.config_dict[MESH].list_workers()
    rows = [worker_json(w) for w in sorted(workers, key=lambda w: w.worker.worker_id)]
    url = request.config_dict[CONFIG].console.router_metrics_url
    figures: RouterFigures | None = None
    figures_error = ""
    if url:
        try:
            figures = await read_router_figures(url)
        except (aiohttp.ClientError, TimeoutError, ValueError) as e:
            logger.warning("console: the router's metrics at %s: %s", redact_url(url), _why(e))
            figures_error = (
                f"The router's metrics at {redact_url(url)} could not be read ({_why(e)})."
            )
    return render(
        request,
        "fleet.html",
        title="Fleet",
        workers=rows,
        figures=figures,
        figures_error=figures_error,
        reasoning_tokens=_reasoning_tokens(),
    )


def _why(error: Exception) -> str:
    """``error`` as the page and the log may show it: its type and message with every URL in it
    redacted, never its repr (an aiohttp error's repr shows the request's Authorization header,
    the metrics URL's user and password in Basic form)."""
    text = redact_urls_in(str(error))
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _reasoning_tokens() -> dict[str, int]:
    """The reasoning tokens this gateway process served, per model, since it started."""
    return {
        sample.labels["model"]: round(sample.value)
        for family in metrics.REASONING_TOKENS.collect()
        for sample in family.samples
        if sample.name.endswith("_total")
    }


async def recent_page(request: web.Request) -> web.Response:
    query = parse_body(RecentQuery, dict(request.query))
    entries = await recent_requests(request).read(query.key_id or None, query.count)
    return render(
        request,
        "recent.html",
        title="Recent requests",
        entries=entries,
        key_id=query.key_id,
        count=query.count,
        jaeger_url=request.config_dict[CONFIG].console.jaeger_url.rstrip("/"),
    )
