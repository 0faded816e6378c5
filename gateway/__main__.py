"""``python -m gateway [--config PATH]``: runs the gateway until SIGINT/SIGTERM.

The config file may also be named by ``INFERMESH_GATEWAY_CONFIG``; every key
can be overridden as ``INFERMESH_GATEWAY_<SECTION>_<KEY>``.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import sys

from aiohttp import web

import telemetry
from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.http.middleware import AccessLogger
from gateway.http.server import GatewayRunner
from gateway.http.siblings import start_siblings, stop_siblings
from infermesh.config import load_config
from infermesh.service_main import service_main

logger = logging.getLogger("gateway")

_SHUTDOWN_TIMEOUT_S = 10.0


def load(path: str | None) -> GatewayConfig:
    return load_config(GatewayConfig, path, "infermesh_gateway")


async def serve(config: GatewayConfig) -> None:
    """Serves until cancelled, then drains requests for up to ``_SHUTDOWN_TIMEOUT_S``; with
    ``[server] processes`` > 1, beside that many - 1 sibling processes on the same port."""
    telemetry.instrument_redis()
    siblings = start_siblings(config.server.processes - 1)
    runner = GatewayRunner(
        create_app(config),
        config.server,
        access_log_class=AccessLogger,
        handler_cancellation=True,
        shutdown_timeout=_SHUTDOWN_TIMEOUT_S,
    )
    await runner.setup()
    gc.freeze()  # start-up's objects stay out of every later collection
    try:
        try:
            await web.TCPSite(
                runner,
                config.server.host,
                config.server.port,
                reuse_port=config.server.processes > 1,
            ).start()
        except OSError as e:
            logger.error("cannot listen on %s:%d: %s", config.server.host, config.server.port, e)
            raise
        # the TCP site's (the process's own Unix socket is a site too: gateway.http.loopback)
        host, port = next(a for a in runner.addresses if isinstance(a, tuple))[:2]
        logger.info(
            "gateway listening on http://%s:%d/v1 (router %s)", host, port, config.router.address
        )
        await asyncio.Event().wait()
    finally:
        try:
            await runner.cleanup()
        finally:
            await stop_siblings(siblings, _SHUTDOWN_TIMEOUT_S + 5)


def main(argv: list[str] | None = None) -> int:
    return service_main("gateway", load, serve, sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    sys.exit(main())
