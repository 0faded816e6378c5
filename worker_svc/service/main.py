"""The worker's process: the Worker gRPC server over its engine, its registration with the
router, its metrics, and a clean stop."""

from __future__ import annotations

import asyncio
import logging

import grpc

from infermesh.grpc_server import create_grpc_server
from infermesh.pb import worker_pb2
from telemetry import metrics
from worker_svc.config import WorkerConfig
from worker_svc.engine.api import InferenceEngine
from worker_svc.engine.factory import load_engine
from worker_svc.service.leaving import leave_fleet, until_stopped_or_dead
from worker_svc.service.registration import Registration, worker_info
from worker_svc.service.server import WorkerServicer, add_worker_servicer

logger = logging.getLogger(__name__)


async def create_server(
    config: WorkerConfig, engine: InferenceEngine
) -> tuple[grpc.aio.Server, WorkerServicer]:
    """Starts the Worker service for ``engine`` (port 0: a free port)."""
    servicer: WorkerServicer | None = None

    def add(server: grpc.aio.Server, port: int) -> None:
        nonlocal servicer
        address = config.server.advertise_address or f"{config.server.host}:{port}"
        servicer = WorkerServicer(engine, worker_info(config, engine, address), config.tls)
        add_worker_servicer(servicer, server)

    server, _, health = await create_grpc_server(
        f"{config.server.host}:{config.server.port}",
        add,
        [worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name],
        config.tls,
        "worker",
    )
    assert servicer is not None, "create_grpc_server did not add the servicer"
    servicer.health = health
    return server, servicer


async def serve(config: WorkerConfig) -> None:
    """Runs the worker ``config`` describes until its server stops (SIGTERM, SIGINT) or its
    engine dies (then it leaves the fleet and raises ServiceFailedError)."""
    engine = await load_engine(config)
    server, servicer = await create_server(config, engine)
    info = servicer.info
    logger.info(
        "worker %s listening on %s serving %s on %s in %s",
        info.worker_id,
        info.address,
        config.model.served_name,
        engine.capabilities.device,
        engine.capabilities.precision,
    )
    metrics.watch_worker_load(servicer.load)
    metrics.watch_event_loop(asyncio.get_running_loop())
    metrics.serve_metrics(config.metrics)
    reporter = asyncio.create_task(Registration(config.router.address, servicer, config.tls).run())
    try:
        died = await until_stopped_or_dead(server, engine)
        if died is not None:
            reporter.cancel()
            assert servicer.health is not None, "create_server sets it"
            await leave_fleet(died, servicer.health, config.router.address, info, config.tls)
    finally:
        reporter.cancel()
        engine.cache_events.end_subscriptions()
        await server.stop(grace=2)
        await servicer.close()
        await engine.close()
