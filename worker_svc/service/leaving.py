"""A worker whose engine died leaves the fleet at once: its health goes NOT_SERVING, it tells the
router it leaves (which drops its registration instead of waiting for the TTL), and the process
exits non-zero for its supervisor to start it again."""

from __future__ import annotations

import asyncio
import logging

import grpc
from grpc_health.v1.health import aio as health_aio

from infermesh.channels import CHANNEL_OPTIONS
from infermesh.pb import common_pb2, router_pb2, router_pb2_grpc
from infermesh.service_main import ServiceFailedError
from infermesh.tls import TlsSection, open_channel
from worker_svc.engine.api import InferenceEngine, MortalEngine

logger = logging.getLogger(__name__)

# How long the worker waits for the router to hear it leave before it exits anyway (the router
# then drops it when its registration expires)
_LEAVE_WAIT_S = 5.0


async def until_stopped_or_dead(server: grpc.aio.Server, engine: InferenceEngine) -> str | None:
    """Waits for the server to stop (None) or, for an engine that can die on its own, for the
    engine to die: the reason."""
    stopped = asyncio.ensure_future(server.wait_for_termination())
    if not isinstance(engine, MortalEngine):
        await stopped
        return None
    died = asyncio.ensure_future(engine.died())
    try:
        await asyncio.wait((stopped, died), return_when=asyncio.FIRST_COMPLETED)
    finally:
        # `stopped` is left to end with the server: cancelling it cancels gRPC's own shutdown
        died.cancel()
    return died.result() if died.done() and not died.cancelled() else None


async def leave_fleet(
    reason: str,
    health: health_aio.HealthServicer,
    router_address: str,
    info: common_pb2.WorkerInfo,
    tls: TlsSection,
) -> None:
    """Takes the worker out of the fleet for ``reason`` and raises ServiceFailedError with it:
    health NOT_SERVING for every service, then the router told (a heartbeat that leaves)."""
    logger.error("worker %s leaves the fleet: %s", info.worker_id, reason)
    await health.enter_graceful_shutdown()
    async with open_channel(router_address, tls, CHANNEL_OPTIONS) as channel:
        try:
            await router_pb2_grpc.RouterStub(channel).Heartbeat(
                router_pb2.HeartbeatRequest(worker_id=info.worker_id, leaving=True),
                timeout=_LEAVE_WAIT_S,
            )
        except grpc.aio.AioRpcError as e:
            logger.warning(
                "router %s did not hear %s leave (%s): it drops it when its registration expires",
                router_address,
                info.worker_id,
                e.code().name,
            )
    raise ServiceFailedError(f"worker {info.worker_id}: {reason}")
