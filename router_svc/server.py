"""The Router gRPC service: registry RPCs and the relayed Generate stream."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc
from opentelemetry import trace

import telemetry
from infermesh.grpc_server import create_grpc_server
from infermesh.pb import common_pb2, router_pb2, router_pb2_grpc, worker_pb2_grpc
from router_svc.config import RouterConfig
from router_svc.registry import Registry, RegistrationError, WorkerEntry
from router_svc.routing import Chooser, RouteError, candidates

logger = logging.getLogger(__name__)

# Errors that say the request itself is wrong: another worker would refuse it too.
_CALLER_ERRORS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE,
                  grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED}


class WorkerChannels:
    """One gRPC channel per worker address, reused across requests."""

    def __init__(self) -> None:
        self._channels: dict[str, grpc.aio.Channel] = {}

    def stub(self, address: str) -> worker_pb2_grpc.WorkerStub:
        channel = self._channels.get(address)
        if channel is None:
            channel = grpc.aio.insecure_channel(
                address, interceptors=telemetry.grpc_client_interceptors())
            self._channels[address] = channel
        return worker_pb2_grpc.WorkerStub(channel)

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self._channels.values()))
        self._channels.clear()


class RouterServicer(router_pb2_grpc.RouterServicer):
    def __init__(self, config: RouterConfig, registry: Registry, channels: WorkerChannels) -> None:
        self._config = config
        self._registry = registry
        self._channels = channels
        self._chooser = Chooser(config.routing.policy)  # type: ignore[arg-type]

    async def Register(self, request: router_pb2.RegisterRequest,
                       context: grpc.aio.ServicerContext) -> router_pb2.RegisterResponse:
        try:
            self._registry.register(request.worker, request.load)
        except RegistrationError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return router_pb2.RegisterResponse(
            heartbeat_interval_ms=self._config.registry.heartbeat_interval_ms,
            ttl_ms=self._config.registry.ttl_ms)

    async def Heartbeat(self, request: router_pb2.HeartbeatRequest,
                        context: grpc.aio.ServicerContext) -> router_pb2.HeartbeatResponse:
        try:
            known = self._registry.heartbeat(request.worker_id, request.load)
        except RegistrationError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return router_pb2.HeartbeatResponse(registered=known)

    async def ListModels(self, request: router_pb2.ListModelsRequest,
                         context: grpc.aio.ServicerContext) -> router_pb2.ListModelsResponse:
        models: dict[str, router_pb2.Model] = {}
        for entry in self._registry.live().values():
            for name in entry.info.models:
                model = models.setdefault(name, router_pb2.Model(
                    id=name, created=int(entry.registered_at)))
                model.workers += 1
                model.created = min(model.created, int(entry.registered_at))
        return router_pb2.ListModelsResponse(models=sorted(models.values(), key=lambda m: m.id))

    async def ListWorkers(self, request: router_pb2.ListWorkersRequest,
                          context: grpc.aio.ServicerContext) -> router_pb2.ListWorkersResponse:
        return router_pb2.ListWorkersResponse(workers=[
            router_pb2.WorkerStatus(worker=e.info, load=e.load,
                                    last_heartbeat_age_s=self._registry.age_s(e))
            for e in self._registry.live().values()])

    async def Generate(self, request: common_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[common_pb2.GenerateResponse]:
        span = trace.get_current_span()
        try:
            eligible = candidates(list(self._registry.live().values()), request.model,
                                  request.precision)
        except RouteError as e:
            await context.abort(e.code, str(e))
        ranked = self._chooser.rank(eligible)
        span.set_attribute("infermesh.route.candidates", [w.worker_id for w in ranked])
        attempts = ranked[:2] if self._config.routing.retry_before_first_token else ranked[:1]
        last_error = "no worker answered"
        for worker in attempts:
            started = False
            try:
                async for chunk in self._relay(worker, request, context):
                    started = True
                    yield chunk
                return
            except grpc.aio.AioRpcError as e:
                if started or e.code() in _CALLER_ERRORS:
                    await context.abort(e.code(), e.details() or "worker failed")
                last_error = f"worker {worker.worker_id}: {e.code().name} {e.details()}"
                logger.warning("retrying elsewhere before the first token: %s", last_error)
        await context.abort(grpc.StatusCode.UNAVAILABLE,
                            f"no worker could serve the request ({last_error})")

    async def _relay(self, worker: WorkerEntry, request: common_pb2.GenerateRequest,
                     context: grpc.aio.ServicerContext) -> AsyncIterator[common_pb2.GenerateResponse]:
        """The worker's stream, its first chunk stamped with the route."""
        caps = worker.info.capabilities
        span = trace.get_current_span()
        span.set_attribute("infermesh.route.worker_id", worker.worker_id)
        span.set_attribute("infermesh.route.precision", common_pb2.Precision.Name(caps.precision))
        remaining = context.time_remaining()
        call = self._channels.stub(worker.info.address).Generate(request, timeout=remaining)
        worker.in_flight += 1
        try:
            first = True
            async for chunk in call:
                if first:
                    chunk.route.CopyFrom(common_pb2.Route(
                        worker_id=worker.worker_id, precision=caps.precision, device=caps.device))
                    first = False
                yield chunk
        finally:
            worker.in_flight -= 1
            call.cancel()


async def create_server(config: RouterConfig) -> tuple[grpc.aio.Server, int, WorkerChannels]:
    """Starts the router on the configured address (port 0: a free port)."""
    registry = Registry(ttl_s=config.registry.ttl_ms / 1000)
    channels = WorkerChannels()
    servicer = RouterServicer(config, registry, channels)
    server, port, _ = await create_grpc_server(
        f"{config.server.host}:{config.server.port}",
        lambda s, _port: router_pb2_grpc.add_RouterServicer_to_server(servicer, s),
        [router_pb2.DESCRIPTOR.services_by_name["Router"].full_name])
    return server, port, channels


async def serve(config: RouterConfig) -> None:
    server, port, channels = await create_server(config)
    logger.info("router listening on %s:%d (policy %s)", config.server.host, port,
                config.routing.policy)
    try:
        await server.wait_for_termination()
    finally:
        await server.stop(grace=2)
        await channels.close()
