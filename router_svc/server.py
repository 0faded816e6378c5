"""The Router gRPC service: registry RPCs, worker choice (RouteStream) and, for internal
callers, the relayed Generate / Complete with failover, served over the same ``Worker.Serve``
client the gateway uses."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

import grpc
from grpc_health.v1 import health_pb2
from grpc_health.v1.health import aio as health_aio
from opentelemetry import trace

from infermesh.authz import peer_of, refuse, require_address_host
from infermesh.bidi import RETRY_AFTER_MS
from infermesh.channels import WorkerChannels
from infermesh.failover import StreamFailedError, stream_from_first
from infermesh.grpc_server import create_grpc_server
from infermesh.names import precision_name
from infermesh.pb import common_pb2, router_pb2, router_pb2_grpc
from infermesh.redis_client import redis_client
from infermesh.serve_client import ReaderTooSlowError, ServeClient
from infermesh.tasks import cancel_and_wait
from router_svc import route_stream
from router_svc.cache_events import CacheEventSubscriptions
from router_svc.caller_usage import CallerUsage
from router_svc.config import MAX_WEIGHT, PRIORITIES, RouterConfig
from router_svc.fair_queue import FairQueue, QueueRefusedError
from router_svc.fleet import Fleet, WorkerEntry
from router_svc.kv_pull import Attempts
from router_svc.prefix_index import PrefixIndex
from router_svc.registry import (
    RegistrationError,
    Registry,
    RegistryUnavailableError,
    WorkerOwnedError,
)
from router_svc.routing import Chooser, Decision, FleetFullError, RouteError, RouteRequest
from telemetry import metrics

logger = logging.getLogger(__name__)

_SERVICE_NAME = router_pb2.DESCRIPTOR.services_by_name["Router"].full_name


class RouterServicer(router_pb2_grpc.RouterServicer):
    def __init__(
        self,
        config: RouterConfig,
        registry: Registry,
        channels: WorkerChannels,
        serve_client: ServeClient,
        usage: CallerUsage,
        index: PrefixIndex | None = None,
    ) -> None:
        self._config = config
        self._registry = registry
        self._usage = usage
        self._fleet = registry.fleet
        self._channels = channels
        self._serve_client = serve_client
        self._chooser = Chooser(config.routing, index)
        self._queue: FairQueue[list[WorkerEntry]] | None = (
            FairQueue(config.fair_queue, self._place) if config.fair_queue.enabled else None
        )

    async def Register(
        self,
        request: router_pb2.RegisterRequest,
        context: grpc.aio.ServicerContext[router_pb2.RegisterRequest, router_pb2.RegisterResponse],
    ) -> router_pb2.RegisterResponse:
        await require_address_host(context, "router", "Register", request.worker.address)
        try:
            await self._registry.register(request.worker, request.load, peer_of(context).uri)
        except WorkerOwnedError as e:
            await refuse(context, "router", "Register", "owner", str(e))
        except RegistrationError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except RegistryUnavailableError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        return router_pb2.RegisterResponse(
            heartbeat_interval_ms=round(self._config.registry.heartbeat_interval_s * 1000),
            ttl_ms=self._config.registry.ttl_ms,
        )

    async def Heartbeat(
        self,
        request: router_pb2.HeartbeatRequest,
        context: grpc.aio.ServicerContext[
            router_pb2.HeartbeatRequest, router_pb2.HeartbeatResponse
        ],
    ) -> router_pb2.HeartbeatResponse:
        registered = self._fleet.get(request.worker_id)
        # Workers that share one certificate identity are told apart by the hosts their
        # certificates name; distinct identities by the id's owner, checked in Redis.
        if registered is not None:
            await require_address_host(context, "router", "Heartbeat", registered.info.address)
        try:
            known = await self._registry.heartbeat(
                request.worker_id, request.load, peer_of(context).uri
            )
        except WorkerOwnedError as e:
            await refuse(context, "router", "Heartbeat", "owner", str(e))
        except RegistrationError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except RegistryUnavailableError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        self.slots_changed()
        return router_pb2.HeartbeatResponse(registered=known)

    async def ListModels(
        self,
        request: router_pb2.ListModelsRequest,
        context: grpc.aio.ServicerContext[
            router_pb2.ListModelsRequest, router_pb2.ListModelsResponse
        ],
    ) -> router_pb2.ListModelsResponse:
        await self._check_registry(context)
        models: dict[str, router_pb2.Model] = {}
        for entry in self._fleet.entries():
            for name in entry.info.models:
                model = models.setdefault(
                    name, router_pb2.Model(id=name, created=int(entry.registered_at))
                )
                model.workers += 1
                model.created = min(model.created, int(entry.registered_at))
        listed = sorted(models.values(), key=lambda m: m.id)
        return router_pb2.ListModelsResponse(models=listed)

    async def ListWorkers(
        self,
        request: router_pb2.ListWorkersRequest,
        context: grpc.aio.ServicerContext[
            router_pb2.ListWorkersRequest, router_pb2.ListWorkersResponse
        ],
    ) -> router_pb2.ListWorkersResponse:
        await self._check_registry(context)
        return router_pb2.ListWorkersResponse(
            workers=[
                router_pb2.WorkerStatus(
                    worker=e.info,
                    load=e.load,
                    last_heartbeat_age_s=self._fleet.age_s(e),
                    ejected=self._fleet.ejected(e),
                )
                for e in self._fleet.entries()
            ]
        )

    async def Generate(
        self,
        request: common_pb2.GenerateRequest,
        context: grpc.aio.ServicerContext[common_pb2.GenerateRequest, common_pb2.GenerateResponse],
    ) -> AsyncIterator[common_pb2.GenerateResponse]:
        attempts = await self._queued(request, context)
        owner = self._usage.owner(context)
        delivered = common_pb2.Usage()
        # the worker's slot is free before the caller hears of a failure, so the caller's
        # next request finds it free
        failure: tuple[grpc.StatusCode, str] | None = None
        try:
            async with contextlib.aclosing(
                self._relayed(attempts, request, context, stream=True)
            ) as chunks:
                async for chunk in chunks:
                    _add_delivered(delivered, chunk)
                    yield chunk
        except StreamFailedError as e:
            failure = (e.code, e.details)
        except ReaderTooSlowError as e:
            failure = (grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        finally:
            self._release(attempts[0])
            # a stream that delivered anything counts, one that failed before it does not
            if owner and (delivered.prompt_tokens or delivered.completion_tokens):
                self._usage.count(owner, delivered)
        if failure is not None:
            await context.abort(*failure)

    async def Complete(
        self,
        request: common_pb2.GenerateRequest,
        context: grpc.aio.ServicerContext[common_pb2.GenerateRequest, common_pb2.GenerateResponse],
    ) -> common_pb2.GenerateResponse:
        attempts = await self._queued(request, context)
        failure: tuple[grpc.StatusCode, str] | None = None
        try:
            async with contextlib.aclosing(
                self._relayed(attempts, request, context, stream=False)
            ) as replies:
                reply = await anext(replies)
        except StreamFailedError as e:
            failure = (e.code, e.details)
        finally:
            self._release(attempts[0])
        if failure is not None:
            await context.abort(*failure)
        owner = self._usage.owner(context)
        if owner:
            self._usage.count(owner, reply.usage)
        return reply

    async def Tokenize(
        self,
        request: common_pb2.GenerateRequest,
        context: grpc.aio.ServicerContext[common_pb2.GenerateRequest, common_pb2.TokenizeResponse],
    ) -> common_pb2.TokenizeResponse:
        """Asks the workers the request would be routed to, in order, until one answers; a
        worker's answer (a count, or its refusal of the request) is the caller's."""
        attempts = await self._decide(request, context, routed=False)
        error: grpc.aio.AioRpcError | None = None
        for worker in attempts:
            stub = self._channels.stub(worker.info.address)
            try:
                reply: common_pb2.TokenizeResponse = await stub.Tokenize(
                    request, timeout=context.time_remaining()
                )
                return reply
            except grpc.aio.AioRpcError as e:
                error = e
                if e.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND):
                    break  # the request's own fault: another worker would say the same
        assert error is not None, "decide() returns at least one worker"
        await context.abort(error.code(), error.details() or "")

    async def RouteStream(
        self,
        requests: AsyncIterator[router_pb2.RouteStreamRequest],
        context: grpc.aio.ServicerContext[
            router_pb2.RouteStreamRequest, router_pb2.RouteStreamResponse
        ],
    ) -> AsyncGenerator[router_pb2.RouteStreamResponse, None]:
        async with contextlib.aclosing(route_stream.answer(self, requests, context)) as responses:
            async for response in responses:
                yield response

    def report_failure(self, request: router_pb2.ReportFailureRequest) -> None:
        """Counts a routed worker's failure that a caller saw; ValueError for a bad code."""
        code = getattr(grpc.StatusCode, request.code, None)
        if not isinstance(code, grpc.StatusCode):
            raise ValueError(f"code must be a gRPC status name, got {request.code!r}")
        worker = self._fleet.get(request.worker_id)
        if worker is not None:
            self._failed(worker, code, request.details, started=False)

    def ask(
        self, request: common_pb2.GenerateRequest, wait_s: float
    ) -> asyncio.Future[list[WorkerEntry]]:
        """The workers for a caller that reports the request's end (``released``): at once,
        or with fair queueing once a worker has a free slot; fails as ``decide`` raises, or
        with QueueRefusedError. Cancelling it takes the ask out of the queue."""
        decided: asyncio.Future[list[WorkerEntry]]
        try:
            _check_standing(request)
        except RouteError as e:
            decided = asyncio.get_running_loop().create_future()
            decided.set_exception(e)
            return decided
        if self._queue is None:
            decided = asyncio.get_running_loop().create_future()
            try:
                placed = self._place(request, free_only=False)
            except Exception as e:
                decided.set_exception(e)
            else:
                assert placed is not None, "not free_only: the full workers count too"
                decided.set_result(placed)
        else:
            decided = self._queue.submit(request, request.tier, wait_s)
        return decided

    def routes(self, attempts: list[WorkerEntry]) -> list[common_pb2.Route]:
        """The workers of a decision as a route stream answers them (the first with its
        pull)."""
        routes = [_route(w, with_address=True) for w in attempts]
        if isinstance(attempts, Attempts) and attempts.pull is not None:
            routes[0].pull.CopyFrom(attempts.pull.proto())
        return routes

    def released(self, worker_id: str) -> None:
        """A request ``ask`` routed to ``worker_id`` ended, or its caller did not send it."""
        worker = self._fleet.get(worker_id)
        if worker is not None:
            self._release(worker)

    def _release(self, worker: WorkerEntry) -> None:
        """A request placed on ``worker`` ended, or was not sent: its slot is free again."""
        self._fleet.ended(worker)
        self.slots_changed()

    def slots_changed(self) -> None:
        """A worker's slot may have freed: queued asks may go now."""
        if self._queue is not None:
            self._queue.dispatch()

    def _place(
        self, request: common_pb2.GenerateRequest, *, free_only: bool = True
    ) -> list[WorkerEntry] | None:
        """``decide`` among the workers with a free slot (``free_only``), the first counted
        in flight until the request's end is reported; None when every one is full."""
        try:
            attempts = self.decide(request, free_only=free_only)
        except FleetFullError:
            return None
        trace.get_current_span().set_attribute("infermesh.route.worker_id", attempts[0].worker_id)
        self._fleet.started(attempts[0])
        return attempts

    def decide(
        self, request: common_pb2.GenerateRequest, *, free_only: bool = False, routed: bool = True
    ) -> list[WorkerEntry]:
        """The workers to try, best first, with the reasons on the current span; raises
        RouteError or RegistryUnavailableError (``free_only``: among the workers with a free
        slot, FleetFullError when none has). ``routed``: the request will be served (not only
        counted), so the prefix tokens its first worker saves it count."""
        self._registry.check_available()
        decision = self._chooser.choose(
            self._fleet,
            RouteRequest.of(request, self._config.routing.prefix_bytes),
            free_only=free_only,
        )
        _record_decision(trace.get_current_span(), decision)
        if routed:
            metrics.ROUTER_DECISIONS.labels(self._config.routing.policy, decision.basis).inc()
            metrics.ROUTER_PHASE_PLANS.labels(decision.phases.plan, decision.phases.term).inc()
            if request.prefix_hashes:
                _count_saved(decision)
            self._fleet.queued_prefill(decision.workers[0], decision.prefill_s)
            if decision.pull is not None and decision.pull.compute:
                self._fleet.queued_prefill(decision.pull.holder, decision.pull.prefill_s)
        attempts = Attempts(
            decision.workers[: 2 if self._config.routing.retry_before_first_token else 1]
        )
        attempts.pull = decision.pull
        return attempts

    async def _decide(
        self,
        request: common_pb2.GenerateRequest,
        context: grpc.aio.ServicerContext[Any, Any],
        routed: bool = True,
    ) -> list[WorkerEntry]:
        await self._check_registry(context)
        try:
            return self.decide(request, routed=routed)
        except RouteError as e:
            await context.abort(e.code, str(e))
            raise  # abort raises; this keeps the type checker informed

    async def _queued(
        self, request: common_pb2.GenerateRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> list[WorkerEntry]:
        """The workers for a relayed request, the first counted in flight (``_release`` it),
        through the fair queue when it is on. An internal caller's tenant is its certificate
        identity and its tier, weight and priority are what ``[internal_callers]`` gives that
        identity, never what its request says."""
        try:
            _check_standing(request)
        except RouteError as e:
            await context.abort(e.code, str(e))
        peer = peer_of(context)
        if peer.role == "client":
            standing = self._config.internal_callers.standing(peer.identity)
            request.tenant = self._usage.owner(context)
            request.tier, request.weight = standing.tier, standing.weight
            request.priority = standing.priority
        if self._queue is None:
            attempts = await self._decide(request, context)
            self._fleet.started(attempts[0])
            return attempts
        await self._check_registry(context)
        try:
            attempts = await self._queue.submit(
                request, request.tier, context.time_remaining() or 0.0
            )
        except QueueRefusedError as e:
            await context.abort(
                e.code, str(e), trailing_metadata=((RETRY_AFTER_MS, str(e.retry_after_ms)),)
            )
            raise
        except RouteError as e:
            await context.abort(e.code, str(e))
            raise
        except RegistryUnavailableError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{e}; retry later")
            raise
        return attempts

    def _relayed(
        self,
        attempts: list[WorkerEntry],
        request: common_pb2.GenerateRequest,
        context: grpc.aio.ServicerContext[Any, Any],
        *,
        stream: bool,
    ) -> AsyncGenerator[common_pb2.GenerateResponse, None]:
        """The first of ``attempts`` that serves the request, relayed; StreamFailedError
        when none does (a worker's failure after its first chunk: its own status)."""
        pull = attempts.pull if isinstance(attempts, Attempts) else None
        return stream_from_first(
            attempts,
            lambda worker: self._relay(
                worker,
                request,
                context,
                stream=stream,
                pull=pull.proto() if pull is not None and worker is attempts[0] else None,
            ),
            self._failed,
            lambda worker: worker.worker_id,
        )

    async def _relay(
        self,
        worker: WorkerEntry,
        request: common_pb2.GenerateRequest,
        context: grpc.aio.ServicerContext[Any, Any],
        *,
        stream: bool,
        pull: common_pb2.KVPull | None,
    ) -> AsyncGenerator[common_pb2.GenerateResponse, None]:
        """The worker's chunks (or, not ``stream``, its whole answer) over its Serve stream
        (its prompt's blocks ``pull`` names taken from a peer first), the first stamped with
        the route, within the caller's remaining deadline and, after the first chunk, the
        stall timeout; closing this iterator cancels the request."""
        caps = worker.info.capabilities
        span = trace.get_current_span()
        span.set_attribute("infermesh.route.worker_id", worker.worker_id)
        span.set_attribute("infermesh.route.precision", common_pb2.Precision.Name(caps.precision))
        span.set_attribute("infermesh.route.device_name", caps.device_name)
        chunks = self._serve_client.chunks(
            worker.info.address,
            request,
            whole=not stream,
            timeout_s=context.time_remaining(),
            stall_s=self._config.routing.stall_timeout_s if stream else None,
            pull=pull,
        )
        async with contextlib.aclosing(chunks):
            first = True
            async for chunk in chunks:
                if first:
                    chunk.route.CopyFrom(_route(worker, with_address=False))
                    self._fleet.succeeded(worker)
                    first = False
                yield chunk

    def _failed(
        self, worker: WorkerEntry, code: grpc.StatusCode, details: str, started: bool
    ) -> None:
        """Counts a worker's failure toward its ejection (a busy worker is not broken)."""
        if code != grpc.StatusCode.RESOURCE_EXHAUSTED:
            routing = self._config.routing
            self._fleet.failed(worker, routing.failures_to_eject, routing.eject_cooldown_s)
        if not started:
            trace.get_current_span().add_event(
                "infermesh.route.failover",
                {"worker_id": worker.worker_id, "code": code.name, "details": details},
            )
            logger.warning(
                "worker %s failed before the first token (%s: %s)",
                worker.worker_id,
                code.name,
                details,
            )

    async def _check_registry(self, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        try:
            self._registry.check_available()
        except RegistryUnavailableError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{e}; retry later")


def _check_standing(request: common_pb2.GenerateRequest) -> None:
    """Raises RouteError (INVALID_ARGUMENT) for a fair-queue weight or priority out of range."""
    if request.weight > MAX_WEIGHT:
        raise RouteError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"weight {request.weight} is out of range (0..{MAX_WEIGHT}; 0: the tier's)",
        )
    if request.priority not in PRIORITIES:
        raise RouteError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"priority {request.priority} is out of range ({PRIORITIES[0]}..{PRIORITIES[-1]})",
        )


def _add_delivered(delivered: common_pb2.Usage, chunk: common_pb2.GenerateResponse) -> None:
    """What a relayed stream has delivered so far: the worker's usage once it reports it (its
    last chunk), until then the tokens streamed (a stream that fails midway is counted with
    them, as the gateway counts its keys')."""
    if chunk.HasField("usage"):
        delivered.CopyFrom(chunk.usage)
    else:
        delivered.completion_tokens += len(chunk.token_ids)


def _route(worker: WorkerEntry, *, with_address: bool) -> common_pb2.Route:
    caps = worker.info.capabilities
    return common_pb2.Route(
        worker_id=worker.worker_id,
        precision=caps.precision,
        device=caps.device,
        device_name=caps.device_name,
        gpu_kind=caps.gpu_kind,
        address=worker.info.address if with_address else "",
    )


def _count_saved(decision: Decision) -> None:
    metrics.PREFIX_TOKENS_SAVED.labels(decision.workers[0].worker_id).inc(decision.cached_tokens)
    metrics.PREFIX_TOKENS_SAVED_PER_REQUEST.observe(decision.cached_tokens)


def _record_decision(span: trace.Span, decision: Decision) -> None:
    """The choice and its reasons as span attributes: infermesh.route.order (first try, then
    the fallback), .policy, .candidates, .load and, for balanced, .kv_usage, .hardware,
    .prefix_home, .session and .cached_tokens (of the prompt, in the first worker's cache as
    the router's index predicts) and, for a request with prefix hashes, .queued_prefill_s (the
    prefill this router estimates the first worker still has queued ahead of it), .phase_plan
    and .phase_term (how its phases are served, and the term that decided it: phases.py)."""
    span.set_attribute("infermesh.route.order", [w.worker_id for w in decision.workers])
    for name, value in decision.reasons.items():
        span.set_attribute(f"infermesh.route.{name}", value)


class RunningRouter:
    """What create_server started besides the gRPC server: close it after the server stops."""

    def __init__(
        self,
        registry: Registry,
        channels: WorkerChannels,
        usage: CallerUsage,
        refresher: asyncio.Task[None],
        subscriptions: CacheEventSubscriptions,
        index: PrefixIndex,
        serve_client: ServeClient,
    ) -> None:
        self.registry = registry
        self._serve_client = serve_client
        self.index = index
        self._channels = channels
        self._usage = usage
        self._refresher = refresher
        self._subscriptions = subscriptions

    async def close(self) -> None:
        await cancel_and_wait(self._refresher)
        await self._subscriptions.close()
        await self._serve_client.close()
        await self._channels.close()
        await self._usage.close()
        await self.registry.close()


async def create_server(config: RouterConfig) -> tuple[grpc.aio.Server, int, RunningRouter]:
    """Starts the router on the configured address (port 0: a free port). Starts even when
    Redis is down: it answers UNAVAILABLE (health NOT_SERVING) until Redis is back."""
    # first: a compiled lookup that does not load is a config error, before anything is opened
    index = PrefixIndex(
        config.routing.index_max_blocks,
        config.routing.index_max_probes,
        compiled=config.routing.index == "compiled",
    )
    registry = Registry(config.redis, config.registry, Fleet(ttl_s=config.registry.ttl_s))
    channels = WorkerChannels(config.tls)
    # its own connections, without retries: a count retried after a lost reply would count twice
    usage = CallerUsage(
        redis_client(config.redis.url, timeout_s=config.redis.timeout_s, retries=False)
    )
    subscriptions = CacheEventSubscriptions(index, channels)
    if config.routing.cache_events:
        registry.fleet.watchers.append(subscriptions)
    serve_client = ServeClient(channels)
    servicer = RouterServicer(config, registry, channels, serve_client, usage, index)
    server, port, health = await create_grpc_server(
        f"{config.server.host}:{config.server.port}",
        lambda s, _port: router_pb2_grpc.add_RouterServicer_to_server(servicer, s),
        [_SERVICE_NAME],
        config.tls,
        "router",
    )
    refreshes = registry.run()
    await anext(refreshes)  # the first read, so that the router starts with the fleet Redis has
    refresher = asyncio.create_task(_follow_registry(refreshes, health, servicer.slots_changed))
    return (
        server,
        port,
        RunningRouter(registry, channels, usage, refresher, subscriptions, index, serve_client),
    )


async def _follow_registry(
    refreshes: AsyncIterator[bool],
    health: health_aio.HealthServicer,
    slots_changed: Callable[[], None],
) -> None:
    """Runs the registry's refresh loop; the health service follows Redis's reachability.
    A refresh brings other routers' load reports and new workers: queued asks may go."""
    serving: bool | None = None
    async for available in refreshes:
        slots_changed()
        if available != serving:
            serving = available
            status = (
                health_pb2.HealthCheckResponse.SERVING
                if available
                else health_pb2.HealthCheckResponse.NOT_SERVING
            )
            for name in ("", _SERVICE_NAME):
                await health.set(name, status)


async def serve(config: RouterConfig) -> None:
    server, port, router = await create_server(config)
    fleet = router.registry.fleet
    metrics.watch_fleet(
        lambda: (
            (
                e.info.capabilities.device_name or e.info.capabilities.device,
                precision_name(e.info.capabilities.precision),
            )
            for e in fleet.entries()
        )
    )
    metrics.watch_event_loop(asyncio.get_running_loop())
    metrics.serve_metrics(config.metrics)
    logger.info(
        "router listening on %s:%d (policy %s)", config.server.host, port, config.routing.policy
    )
    try:
        await server.wait_for_termination()
    finally:
        await server.stop(grace=2)
        await router.close()
