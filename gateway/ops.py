"""The operations routes every gateway process answers without a key: ``GET /health`` (the
process is alive) and ``GET /metrics`` (Prometheus text exposition)."""

from __future__ import annotations

import prometheus_client
from aiohttp import web


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def metrics(request: web.Request) -> web.Response:
    """Prometheus text exposition of this process's metrics."""
    return web.Response(
        body=prometheus_client.generate_latest(),
        headers={"Content-Type": prometheus_client.CONTENT_TYPE_LATEST},
    )
