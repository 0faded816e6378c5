"""The operations routes every gateway process answers without a key: ``GET /health`` (the
process is alive) and ``GET /metrics`` (Prometheus text exposition, without the per-key
series); and the ``[metrics]`` side port, which serves every metric, the per-key ones too (the
keys' names, tiers and token volumes are the operator's business, not the public API's)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Iterator

import prometheus_client
from aiohttp import web
from prometheus_client.registry import Collector

from infermesh.config import MetricsSection
from telemetry.metrics import PER_KEY_FAMILIES

logger = logging.getLogger(__name__)


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


class _Public(Collector):
    """The process's metrics less the per-key families."""

    def collect(self) -> Iterator[prometheus_client.Metric]:
        return (
            family
            for family in prometheus_client.REGISTRY.collect()
            if family.name not in PER_KEY_FAMILIES
        )


_PUBLIC = _Public()


async def metrics(request: web.Request) -> web.Response:
    """Prometheus text exposition of this process's metrics, less the per-key series."""
    return _exposition(_PUBLIC)


async def all_metrics(request: web.Request) -> web.Response:
    """Every metric of this process, the per-key series too: the side port's only route."""
    return _exposition(prometheus_client.REGISTRY)


def _exposition(registry: Collector) -> web.Response:
    return web.Response(
        body=prometheus_client.generate_latest(registry),
        headers={"Content-Type": prometheus_client.CONTENT_TYPE_LATEST},
    )


def metrics_port(
    config: MetricsSection, reuse_port: bool
) -> Callable[[web.Application], AsyncIterator[None]]:
    """A cleanup context serving ``all_metrics`` on ``[metrics]`` host:port while the app
    runs (port 0: none); ``reuse_port``: sibling processes share the port, as the API's."""

    async def serve(app: web.Application) -> AsyncIterator[None]:
        if not config.port:
            yield
            return
        side = web.Application()
        side.router.add_get("/metrics", all_metrics)
        runner = web.AppRunner(side, access_log=None)
        await runner.setup()
        try:
            await web.TCPSite(runner, config.host, config.port, reuse_port=reuse_port).start()
            logger.info("metrics on http://%s:%d/metrics", config.host, config.port)
            yield
        finally:
            await runner.cleanup()

    return serve
