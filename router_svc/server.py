"""The Router gRPC service: registry RPCs, worker choice (RouteStream) and, for internal
callers, Generate / Complete: each a mesh call (``infermesh.mesh_call``), the client path the
gateway runs, routed on this router's own decisions."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health_pb2
from grpc_health.v1.health import aio as health_aio
from opentelemetry import trace
from prometheus_client import REGISTRY

from infermesh.authz import peer_of, refuse, require_address_host
from infermesh.bidi import RETRY_AFTER_MS, retry_after_ms
from infermesh.channels import WorkerChannels
from infermesh.failover import StreamFailedError
from infermesh.grpc_server import create_grpc_server
from infermesh.mesh_call import MeshCall
from infermesh.names import precision_name
from infermesh.pb import common_pb2, router_pb2, router_pb2_grpc
from infermesh.prompt_tokens import PromptTokens, worker_text_files
from infermesh.redis_client import redis_client
from infermesh.serve_client import ReaderTooSlowError, ServeClient
from infermesh.tasks import cancel_and_wait
from router_svc import route_stream
from router_svc.cache_events import CacheEventSubscriptions
from router_svc.caller_usage import CallerUsage
from router_svc.config import MAX_WEIGHT, PRIORITIES, RouterConfig
from router_svc.fair_queue import FairQueue
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
from router_svc.scaling import ScalingSignals
from telemetry import metrics

logger = logging.getLogger(__name__)

_SERVICE_NAME = router_pb2.DESCRIPTOR.services_by_name["Router"].full_name
# The longest an ask without block hashes waits for its prompt's tokens (a tokenizer load under
# way, a long prompt tokenized in a thread) before it is decided on its text, as "unhashed"
_TOKENIZE_WAIT_S = 0.5
# How often the router looks at its workers' tokenizer digests again (a model not seen yet: at
# once, on its first ask)
_TOKENIZER_REFRESH_S = 30.0
# The longest a worker's tokenizer files may take to come
_TEXT_FILES_TIMEOUT_S = 30.0


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
        # the prompts of asks that come without block hashes, tokenized here
        fleet_files = _FleetFiles(self)
        # every prompt in a thread: a 1,500-token chat takes ~1.5 ms to render and tokenize,
        # some 60 decisions' time on the event loop
        self.tokens = PromptTokens(
            fleet_files, _TOKENIZER_REFRESH_S, _TOKENIZE_WAIT_S, thread_chars=0
        )
        fleet_files.tokens = self.tokens
        self._fleet.watchers.append(fleet_files)
        self.route_streams = route_stream.OpenStreams()
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
                request.worker_id, request.load, peer_of(context).uri, request.leaving
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
        return router_pb2.ListWorkersResponse(workers=self.worker_statuses())

    def worker_statuses(self) -> list[router_pb2.WorkerStatus]:
        """The fleet's workers as ListWorkers answers them."""
        return [
            router_pb2.WorkerStatus(
                worker=e.info,
                load=e.load,
                last_heartbeat_age_s=self._fleet.age_s(e),
                ejected=self._fleet.ejected(e),
            )
            for e in self._fleet.entries()
        ]

    async def text_files(self, address: str) -> dict[str, bytes]:
        """The tokenizer's files of the worker at ``address`` (Worker.TextFiles)."""
        return await worker_text_files(self._channels.stub(address), _TEXT_FILES_TIMEOUT_S)

    async def Generate(
        self,
        request: common_pb2.GenerateRequest,
        context: grpc.aio.ServicerContext[common_pb2.GenerateRequest, common_pb2.GenerateResponse],
    ) -> AsyncIterator[common_pb2.GenerateResponse]:
        call = await self._mesh_call(request, context, stream=True)
        failure: tuple[grpc.StatusCode, str, int] | None = None
        try:
            async with contextlib.aclosing(call.chunks) as chunks:
                async for chunk in chunks:
                    if call.route is not None and not chunk.HasField("route"):
                        _stamp_route(chunk, call.route)
                    yield chunk
        except _CALL_ERRORS as e:
            # the mesh call freed the worker's slot before the caller hears of the failure,
            # so the caller's next request finds it free
            failure = _status_of(e)
        if failure is not None:
            await _abort(context, failure)

    async def Complete(
        self,
        request: common_pb2.GenerateRequest,
        context: grpc.aio.ServicerContext[common_pb2.GenerateRequest, common_pb2.GenerateResponse],
    ) -> common_pb2.GenerateResponse:
        call = await self._mesh_call(request, context, stream=False)
        reply = common_pb2.GenerateResponse()
        failure: tuple[grpc.StatusCode, str, int] | None = None
        try:
            async with contextlib.aclosing(call.chunks) as chunks:
                async for chunk in chunks:
                    reply = chunk  # the whole answer: one chunk
        except _CALL_ERRORS as e:
            failure = _status_of(e)
        if failure is not None:
            await _abort(context, failure)
        if call.route is not None:
            _stamp_route(reply, call.route)
        return reply

    async def _mesh_call(
        self,
        request: common_pb2.GenerateRequest,
        context: grpc.aio.ServicerContext[Any, Any],
        *,
        stream: bool,
    ) -> MeshCall:
        """An internal caller's request as a mesh call (``infermesh.mesh_call``, the path the
        gateway's requests take), routed on this router's own decisions. Its tenant is the
        caller's certificate identity and its tier, weight and priority are what
        ``[internal_callers]`` gives that identity, never what its request says."""
        try:
            _check_standing(request)
        except RouteError as e:
            await context.abort(e.code, str(e))
        owner = self._usage.owner(context)
        if owner:
            standing = self._config.internal_callers.standing(peer_of(context).identity)
            request.tenant = owner
            request.tier, request.weight = standing.tier, standing.weight
            request.priority = standing.priority
        await self._check_registry(context)
        return MeshCall(
            _OwnDecisions(self, owner, context.time_remaining() or 0.0),
            self._serve_client,
            request,
            stream=stream,
            timeout_s=context.time_remaining,
            stall_s=self._config.routing.stall_timeout_s if stream else None,
        )

    def _count_usage(self, owner: str, usage: common_pb2.Usage) -> None:
        """Counts an internal caller's request under ``owner``, when it delivered anything (a
        stream that failed midway counts what it sent, one that failed before does not)."""
        if owner and (usage.prompt_tokens or usage.completion_tokens):
            self._usage.count(owner, usage)

    def finished(self, end: router_pb2.RouteFinished, owner: str = "") -> None:
        """A routed request ended, as every mesh call reports it (a gateway's on its route
        stream, an internal caller's here): its slot is free, a completed one ends its
        worker's failures in a row, and an internal caller's usage is counted under its
        identity (``owner``; a gateway settles its keys' own)."""
        self.released(end.worker_id)
        served_by = self._fleet.get(end.served_by) if end.completed else None
        if served_by is not None:
            self._fleet.succeeded(served_by)
        self._count_usage(owner, end.usage)

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
        # a router that cannot read its registry backs no decision: the caller's channel
        # moves to one that can (its health check says NOT_SERVING meanwhile)
        await self._check_registry(context)
        decisions = route_stream.decisions(self, requests, context, self.route_streams)
        async with contextlib.aclosing(decisions) as responses:
            async for response in responses:
                yield response

    def report_failure(self, request: router_pb2.ReportFailureRequest) -> None:
        """Counts a routed worker's failure that a caller saw; ValueError for a bad code."""
        code = getattr(grpc.StatusCode, request.code, None)
        if not isinstance(code, grpc.StatusCode):
            raise ValueError(f"code must be a gRPC status name, got {request.code!r}")
        worker = self._fleet.get(request.worker_id)
        if worker is not None:
            self._failed(worker, code, request.details)

    def ask(
        self, request: common_pb2.GenerateRequest, wait_s: float
    ) -> asyncio.Future[list[WorkerEntry]]:
        """The workers for a caller that reports the request's end (``released``): at once,
        or with fair queueing once a worker has a free slot; fails as ``decide`` raises, or
        with QueueRefusedError. Cancelling it takes the ask out of the queue. A request with a
        prompt but no block hashes (``hash_prompts`` could not make them) is counted."""
        decided: asyncio.Future[list[WorkerEntry]]
        try:
            _check_standing(request)
        except RouteError as e:
            decided = asyncio.get_running_loop().create_future()
            decided.set_exception(e)
            return decided
        if not request.prefix_hashes and (request.messages or request.prompt):
            metrics.ROUTER_UNHASHED_ASKS.inc()
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

    async def hash_prompts(self, requests: Sequence[common_pb2.GenerateRequest]) -> None:
        """Adds their prompts' ids, tokenizer digest and block hashes to those of ``requests``
        that came without, as the gateway does (tokenized in threads, all at once), waiting
        _TOKENIZE_WAIT_S at most: past it, or for a prompt that cannot be tokenized here, a
        request goes on as it came (and ``ask`` decides it unhashed)."""
        unhashed = [r for r in requests if not r.prefix_hashes and (r.messages or r.prompt)]
        if not unhashed:
            return
        fills = [asyncio.ensure_future(self.tokens.fill(r)) for r in unhashed]
        _, late = await asyncio.wait(fills, timeout=_TOKENIZE_WAIT_S)
        for fill in late:
            await cancel_and_wait(fill)

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

    def queued_by_model(self) -> collections.Counter[str]:
        """Requests waiting in the fair queue, by model (none without fair queueing)."""
        return collections.Counter() if self._queue is None else self._queue.waiting_by_model()

    def queue_wait_s(self, ahead: int) -> float:
        """Seconds a request with ``ahead`` requests before it waits in the fair queue, at the
        recent rate slots free."""
        return 0.0 if self._queue is None else self._queue.retry_after_ms(ahead) / 1000

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

    def _failed(self, worker: WorkerEntry, code: grpc.StatusCode, details: str) -> None:
        """Counts a worker's failure toward its ejection (a busy worker is not broken)."""
        if code != grpc.StatusCode.RESOURCE_EXHAUSTED:
            routing = self._config.routing
            self._fleet.failed(worker, routing.failures_to_eject, routing.eject_cooldown_s)
        trace.get_current_span().add_event(
            "infermesh.route.failover",
            {"worker_id": worker.worker_id, "code": code.name, "details": details},
        )
        logger.warning("worker %s failed (%s: %s)", worker.worker_id, code.name, details)

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


_CALL_ERRORS = (grpc.aio.AioRpcError, StreamFailedError, ReaderTooSlowError)


def _status_of(error: Exception) -> tuple[grpc.StatusCode, str, int]:
    """What a failed mesh call (one of ``_CALL_ERRORS``) answers its caller: the router's
    refusal (with its retry-after, ms), the workers' outcome, or a reader too slow."""
    if isinstance(error, grpc.aio.AioRpcError):
        return error.code(), error.details() or "", retry_after_ms(error)
    if isinstance(error, StreamFailedError):
        return error.code, error.details, 0
    return grpc.StatusCode.RESOURCE_EXHAUSTED, str(error), 0


async def _abort(
    context: grpc.aio.ServicerContext[Any, Any], failure: tuple[grpc.StatusCode, str, int]
) -> None:
    code, details, retry_ms = failure
    trailing = ((RETRY_AFTER_MS, str(retry_ms)),) if retry_ms else ()
    await context.abort(code, details, trailing_metadata=trailing)


def _stamp_route(chunk: common_pb2.GenerateResponse, route: common_pb2.Route) -> None:
    """Names the worker that answered on a chunk for the caller: not its address or pull."""
    chunk.route.CopyFrom(route)
    chunk.route.ClearField("address")
    chunk.route.ClearField("pull")


class _FleetFiles:
    """The router's fleet as its ``PromptTokens`` learns the workers' tokenizers from it: looked
    at again as each worker joins (a fleet watcher), so that a new model's first ask finds its
    tokenizer known."""

    def __init__(self, servicer: RouterServicer) -> None:
        self._servicer = servicer
        self.tokens: PromptTokens | None = None

    def joined(self, entry: WorkerEntry) -> None:
        if self.tokens is not None:
            self.tokens.learn()

    def left(self, entry: WorkerEntry) -> None:
        """Nothing to forget at once: the next look drops tokenizers no worker reports."""

    async def list_workers(self) -> list[router_pb2.WorkerStatus]:
        return self._servicer.worker_statuses()

    async def text_files(self, address: str) -> dict[str, bytes]:
        return await self._servicer.text_files(address)


class _OwnDecisions:
    """This router's own decisions, as an internal caller's mesh call asks for them
    (``infermesh.mesh_call.Router``): asked, placed and answered as ``Router.RouteStream``
    answers a gateway's ask (``route_stream.decision``), and, once the call ends, its slot
    freed and its usage counted under its caller's identity (``owner``; "": none)."""

    def __init__(self, servicer: RouterServicer, owner: str, wait_s: float) -> None:
        self._servicer = servicer
        self._owner = owner
        self._wait_s = wait_s

    def ask(self, request: common_pb2.GenerateRequest) -> None:
        return None  # nothing to overlap the decision with: asked when the call starts

    async def decision(
        self, request: common_pb2.GenerateRequest, asked: asyncio.Future[Any] | None
    ) -> router_pb2.RouteDecision:
        await self._servicer.hash_prompts([request])
        decided = self._servicer.ask(request, self._wait_s)
        with contextlib.suppress(Exception):  # a refusal is answered as the route stream does
            await decided
        return route_stream.decision(self._servicer, 0, decided)

    def unused(self, asked: asyncio.Future[router_pb2.RouteDecision]) -> None:
        """Never called: nothing is asked ahead."""

    def report_failure(self, failure: router_pb2.ReportFailureRequest) -> None:
        self._servicer.report_failure(failure)

    def finished(self, end: router_pb2.RouteFinished) -> None:
        self._servicer.finished(end, self._owner)


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
        scaling: ScalingSignals,
        tokens: PromptTokens,
    ) -> None:
        self.registry = registry
        self._tokens = tokens
        self.scaling = scaling  # the autoscaling series, registered by serve()
        self._serve_client = serve_client
        self.index = index
        self._channels = channels
        self._usage = usage
        self._refresher = refresher
        self._subscriptions = subscriptions

    async def close(self) -> None:
        await cancel_and_wait(self._refresher)
        await self._tokens.close()
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
    refresher = asyncio.create_task(_follow_registry(refreshes, health, servicer))
    return (
        server,
        port,
        RunningRouter(
            registry,
            channels,
            usage,
            refresher,
            subscriptions,
            index,
            serve_client,
            ScalingSignals(registry.fleet, servicer.queued_by_model, servicer.queue_wait_s),
            servicer.tokens,
        ),
    )


async def _follow_registry(
    refreshes: AsyncIterator[bool],
    health: health_aio.HealthServicer,
    servicer: RouterServicer,
) -> None:
    """Runs the registry's refresh loop; the health service follows Redis's reachability.
    A refresh brings other routers' load reports and new workers: queued asks may go. When
    Redis becomes unreachable, the router says NOT_SERVING and ends its route streams: it
    cannot back a decision (its fleet view may be stale, its workers' heartbeats cannot be
    written), and the gateways' channels ask a router that can."""
    serving: bool | None = None
    async for available in refreshes:
        servicer.slots_changed()
        if available != serving:
            serving = available
            status = (
                health_pb2.HealthCheckResponse.SERVING
                if available
                else health_pb2.HealthCheckResponse.NOT_SERVING
            )
            for name in ("", _SERVICE_NAME):
                await health.set(name, status)
            if not available:
                servicer.route_streams.end_all("the router cannot reach its registry; ask another")


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
    metrics.watch_links(fleet.measured_links)
    metrics.watch_event_loop(asyncio.get_running_loop())
    REGISTRY.register(router.scaling)
    metrics.serve_metrics(config.metrics)
    logger.info(
        "router listening on %s:%d (policy %s)", config.server.host, port, config.routing.policy
    )
    try:
        await server.wait_for_termination()
    finally:
        await server.stop(grace=2)
        await router.close()
