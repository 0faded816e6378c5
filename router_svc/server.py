"""The Router gRPC service: registry RPCs and the relayed Generate stream with failover."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc
from grpc_health.v1 import health_pb2
from grpc_health.v1.health import aio as health_aio
from opentelemetry import trace

import telemetry
from infermesh.grpc_server import create_grpc_server
from infermesh.tasks import cancel_and_wait
from infermesh.pb import common_pb2, router_pb2, router_pb2_grpc, worker_pb2_grpc
from router_svc.config import RouterConfig
from router_svc.fleet import Fleet, WorkerEntry
from router_svc.registry import Registry, RegistrationError, RegistryUnavailableError
from infermesh.names import precision_name
from router_svc.routing import Chooser, Decision, RouteError, RouteRequest
from telemetry import metrics

logger = logging.getLogger(__name__)

# Errors that say the request itself is wrong, or the caller's deadline passed: another
# worker would not do better. (A caller that cancels ends this handler with CancelledError; a
# CANCELLED status from a worker means the worker went away.)
_CALLER_ERRORS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE,
                  grpc.StatusCode.DEADLINE_EXCEEDED}
_SERVICE_NAME = router_pb2.DESCRIPTOR.services_by_name["Router"].full_name


class IncompleteStreamError(Exception):
    """A worker ended its stream without a last chunk (finish_reason)."""


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
        self._fleet = registry.fleet
        self._channels = channels
        self._chooser = Chooser(config.routing)

    async def Register(self, request: router_pb2.RegisterRequest,
                       context: grpc.aio.ServicerContext) -> router_pb2.RegisterResponse:
        try:
            await self._registry.register(request.worker, request.load)
        except RegistrationError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except RegistryUnavailableError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        return router_pb2.RegisterResponse(
            heartbeat_interval_ms=self._config.registry.heartbeat_interval_ms,
            ttl_ms=self._config.registry.ttl_ms)

    async def Heartbeat(self, request: router_pb2.HeartbeatRequest,
                        context: grpc.aio.ServicerContext) -> router_pb2.HeartbeatResponse:
        try:
            known = await self._registry.heartbeat(request.worker_id, request.load)
        except RegistrationError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except RegistryUnavailableError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        return router_pb2.HeartbeatResponse(registered=known)

    async def ListModels(self, request: router_pb2.ListModelsRequest,
                         context: grpc.aio.ServicerContext) -> router_pb2.ListModelsResponse:
        await self._check_registry(context)
        models: dict[str, router_pb2.Model] = {}
        for entry in self._fleet.entries():
            for name in entry.info.models:
                model = models.setdefault(name, router_pb2.Model(
                    id=name, created=int(entry.registered_at)))
                model.workers += 1
                model.created = min(model.created, int(entry.registered_at))
        return router_pb2.ListModelsResponse(models=sorted(models.values(), key=lambda m: m.id))

    async def ListWorkers(self, request: router_pb2.ListWorkersRequest,
                          context: grpc.aio.ServicerContext) -> router_pb2.ListWorkersResponse:
        await self._check_registry(context)
        return router_pb2.ListWorkersResponse(workers=[
            router_pb2.WorkerStatus(worker=e.info, load=e.load,
                                    last_heartbeat_age_s=self._fleet.age_s(e))
            for e in self._fleet.entries()])

    async def Generate(self, request: common_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[common_pb2.GenerateResponse]:
        span = trace.get_current_span()
        await self._check_registry(context)
        try:
            decision = self._chooser.choose(
                self._fleet, RouteRequest.of(request, self._config.routing.prefix_bytes))
        except RouteError as e:
            await context.abort(e.code, str(e))
        _record_decision(span, decision)
        attempts = decision.workers[:2 if self._config.routing.retry_before_first_token else 1]
        failures: list[tuple[WorkerEntry, grpc.StatusCode, str]] = []
        for worker in attempts:
            started = False
            try:
                async for chunk in self._relay(worker, request, context):
                    started = True
                    yield chunk
                return
            except grpc.aio.AioRpcError as e:
                code, details = e.code(), e.details() or e.code().name
                if code == grpc.StatusCode.CANCELLED:  # the worker's side: it went away
                    code = grpc.StatusCode.UNAVAILABLE
            except IncompleteStreamError as e:
                code, details = grpc.StatusCode.UNAVAILABLE, str(e)
            if code in _CALLER_ERRORS:
                await context.abort(code, details)
            self._count_failure(worker, code)
            if started:  # tokens were sent: a clean error end, never a second stream
                await context.abort(code, f"worker {worker.worker_id} failed mid-stream: {details}")
            failures.append((worker, code, details))
            span.add_event("infermesh.route.failover", {
                "worker_id": worker.worker_id, "code": code.name, "details": details})
            logger.warning("worker %s failed before the first token (%s: %s)",
                           worker.worker_id, code.name, details)
        await context.abort(*_give_up_status(failures))

    async def _relay(self, worker: WorkerEntry, request: common_pb2.GenerateRequest,
                     context: grpc.aio.ServicerContext) -> AsyncIterator[common_pb2.GenerateResponse]:
        """The worker's stream, its first chunk stamped with the route. The worker call
        carries the caller's remaining deadline; closing this iterator cancels it."""
        caps = worker.info.capabilities
        span = trace.get_current_span()
        span.set_attribute("infermesh.route.worker_id", worker.worker_id)
        span.set_attribute("infermesh.route.precision", common_pb2.Precision.Name(caps.precision))
        span.set_attribute("infermesh.route.device_name", caps.device_name)
        call = self._channels.stub(worker.info.address).Generate(
            request, timeout=context.time_remaining())
        self._fleet.started(worker)
        try:
            first, finished = True, False
            async for chunk in call:
                if first:
                    chunk.route.CopyFrom(common_pb2.Route(
                        worker_id=worker.worker_id, precision=caps.precision, device=caps.device))
                    self._fleet.succeeded(worker)
                    first = False
                finished = chunk.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
                yield chunk
            if not finished:
                raise IncompleteStreamError(f"worker {worker.worker_id} ended its stream unfinished")
        finally:
            self._fleet.ended(worker)
            call.cancel()

    def _count_failure(self, worker: WorkerEntry, code: grpc.StatusCode) -> None:
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:  # busy, not broken
            return
        routing = self._config.routing
        self._fleet.failed(worker, routing.failures_to_eject, routing.eject_cooldown_ms / 1000)

    async def _check_registry(self, context: grpc.aio.ServicerContext) -> None:
        try:
            self._registry.check_available()
        except RegistryUnavailableError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{e}; retry later")


def _record_decision(span: trace.Span, decision: Decision) -> None:
    """The choice and its reasons as span attributes: infermesh.route.order (first try, then
    the fallback), .policy, .candidates, .load and, for balanced, .kv_usage, .hardware and
    .prefix_home."""
    span.set_attribute("infermesh.route.order", [w.worker_id for w in decision.workers])
    for name, value in decision.reasons.items():
        span.set_attribute(f"infermesh.route.{name}", value)


def _give_up_status(failures: list[tuple[WorkerEntry, grpc.StatusCode, str]]) -> tuple[grpc.StatusCode, str]:
    summary = "; ".join(f"worker {w.worker_id}: {code.name} {details}" for w, code, details in failures)
    if failures and all(code == grpc.StatusCode.RESOURCE_EXHAUSTED for _, code, _ in failures):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, f"no worker has capacity now; retry later ({summary})"
    return grpc.StatusCode.UNAVAILABLE, f"no worker could serve the request ({summary})"


class RunningRouter:
    """What create_server started besides the gRPC server: close it after the server stops."""

    def __init__(self, registry: Registry, channels: WorkerChannels, refresher: asyncio.Task[None]) -> None:
        self.registry = registry
        self._channels = channels
        self._refresher = refresher

    async def close(self) -> None:
        await cancel_and_wait(self._refresher)
        await self._channels.close()
        await self.registry.close()


async def create_server(config: RouterConfig) -> tuple[grpc.aio.Server, int, RunningRouter]:
    """Starts the router on the configured address (port 0: a free port). Starts even when
    Redis is down: it answers UNAVAILABLE (health NOT_SERVING) until Redis is back."""
    registry = Registry(config.redis, config.registry, Fleet(ttl_s=config.registry.ttl_ms / 1000))
    channels = WorkerChannels()
    servicer = RouterServicer(config, registry, channels)
    server, port, health = await create_grpc_server(
        f"{config.server.host}:{config.server.port}",
        lambda s, _port: router_pb2_grpc.add_RouterServicer_to_server(servicer, s), [_SERVICE_NAME])
    refreshes = registry.run()
    await anext(refreshes)  # the first read, so that the router starts with the fleet Redis has
    refresher = asyncio.create_task(_follow_registry(refreshes, health))
    return server, port, RunningRouter(registry, channels, refresher)


async def _follow_registry(refreshes: AsyncIterator[bool], health: health_aio.HealthServicer) -> None:
    """Runs the registry's refresh loop; the health service follows Redis's reachability."""
    serving: bool | None = None
    async for available in refreshes:
        if available != serving:
            serving = available
            status = (health_pb2.HealthCheckResponse.SERVING if available
                      else health_pb2.HealthCheckResponse.NOT_SERVING)
            for name in ("", _SERVICE_NAME):
                await health.set(name, status)


async def serve(config: RouterConfig) -> None:
    server, port, router = await create_server(config)
    fleet = router.registry.fleet
    metrics.watch_fleet(lambda: ((e.info.capabilities.device_name or e.info.capabilities.device,
                                  precision_name(e.info.capabilities.precision))
                                 for e in fleet.entries()))
    metrics.serve_metrics(config.metrics)
    logger.info("router listening on %s:%d (policy %s)", config.server.host, port,
                config.routing.policy)
    try:
        await server.wait_for_termination()
    finally:
        await server.stop(grace=2)
        await router.close()
