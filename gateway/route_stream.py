"""The gateway's long-lived ``Router.RouteStream``: route decisions and failure reports for
all of a gateway process's requests over one stream, so that a request costs the router a
message, not a call.

An ask is answered by its id; the router still makes every decision. A request asks ahead of
its admission check (``gateway.generation``), so that the two round trips overlap; when
admission refuses it, its decision goes back to the router as unused. The stream is opened
on first use and again after it broke; a break fails the asks waiting on it with its status,
as failed Route calls would.
"""

from __future__ import annotations

import asyncio
import itertools

import grpc
from opentelemetry import context as otel_context
from opentelemetry import propagate

import telemetry
from infermesh.bidi import MessageBatcher, call_error, check_size, status_code
from infermesh.pb import common_pb2, router_pb2, router_pb2_grpc
from telemetry.metrics import STREAM_BREAKS, STREAM_MESSAGES, STREAMS_OPEN

_PEER = "router"


class _Call:
    """One RouteStream call and the asks waiting for its decisions."""

    def __init__(self, stub: router_pb2_grpc.RouterStub) -> None:
        self.waiting: dict[int, asyncio.Future[router_pb2.RouteDecision]] = {}
        self.broken = False
        self._received = STREAM_MESSAGES.labels(_PEER, "received")
        STREAMS_OPEN.labels(_PEER).inc()
        # The stream outlives the request that opened it: its call and tasks belong to no
        # request's trace.
        token = otel_context.attach(otel_context.Context())
        try:
            self._call = stub.RouteStream(wait_for_ready=False)
            self.outgoing = MessageBatcher(self._call, router_pb2.RouteStreamRequest, _PEER)
            self._reader = asyncio.create_task(self._read())
        finally:
            otel_context.detach(token)

    async def _read(self) -> None:
        error = call_error(grpc.StatusCode.UNAVAILABLE, "the router ended the route stream")
        try:
            while (response := await self._call.read()) is not grpc.aio.EOF:
                self._received.inc()
                for decision in response.decisions:
                    waiter = self.waiting.pop(decision.id, None)
                    if waiter is not None and not waiter.done():
                        waiter.set_result(decision)
        except grpc.aio.AioRpcError as e:
            error = call_error(e.code(), e.details() or e.code().name)
        finally:
            self.broken = True
            STREAMS_OPEN.labels(_PEER).dec()
            waiting, self.waiting = self.waiting, {}
            if waiting:
                STREAM_BREAKS.labels(_PEER).inc()
            for waiter in waiting.values():
                if not waiter.done():
                    waiter.set_exception(error)
            await self.outgoing.close()

    async def close(self) -> None:
        self._call.cancel()
        await asyncio.gather(self._reader, return_exceptions=True)


def workers(decision: router_pb2.RouteDecision) -> list[common_pb2.Route]:
    """The workers of a decision, best first; raises ``grpc.aio.AioRpcError`` with the
    router's status when it has none."""
    if decision.code:
        raise call_error(status_code(decision.code), decision.details)
    return list(decision.workers)


def _expire(decided: asyncio.Future[router_pb2.RouteDecision]) -> None:
    if not decided.done():
        decided.set_exception(
            call_error(grpc.StatusCode.DEADLINE_EXCEEDED, "the router did not decide in time")
        )


class RouteStream:
    """Route asks and failure reports over one long-lived call; safe to share across
    requests."""

    def __init__(self, stub: router_pb2_grpc.RouterStub) -> None:
        self._stub = stub
        self._call: _Call | None = None
        self._ids = itertools.count(1)
        self._closing: set[asyncio.Task[None]] = set()

    def ask(
        self, request: common_pb2.GenerateRequest, timeout_s: float
    ) -> asyncio.Future[router_pb2.RouteDecision]:
        """Sends the ask with the stream's next message; the future holds the router's
        decision (``workers`` reads it as Route's answer), or fails: the stream's status when
        it breaks, DEADLINE_EXCEEDED after ``timeout_s``."""
        check_size(request)
        call = self._current()
        ask_id = next(self._ids)
        loop = asyncio.get_running_loop()
        decided = loop.create_future()
        call.waiting[ask_id] = decided
        ask = call.outgoing.message.asks.add(id=ask_id, request=request)
        if telemetry.tracing_enabled():
            propagate.inject(ask.trace_context)
        call.outgoing.changed()
        # a timer that fails the ask rather than asyncio.timeout around each wait: cheaper,
        # and the ask may be awaited later than it is sent
        expiry = loop.call_later(timeout_s, _expire, decided)

        def done(_: asyncio.Future[router_pb2.RouteDecision]) -> None:
            expiry.cancel()
            call.waiting.pop(ask_id, None)

        decided.add_done_callback(done)
        return decided

    def unused(self, decided: asyncio.Future[router_pb2.RouteDecision]) -> None:
        """Tells the router, once ``decided`` is decided, that its request was not sent to
        the workers it chose, so that they are not counted as busy with it."""

        def hand_back(_: asyncio.Future[router_pb2.RouteDecision]) -> None:
            if decided.cancelled() or decided.exception() is not None:
                return
            chosen = decided.result().workers
            if chosen and self._call is not None and not self._call.broken:
                self._call.outgoing.message.unused.extend(w.worker_id for w in chosen)
                self._call.outgoing.changed()

        decided.add_done_callback(hand_back)

    def report_failure(self, failure: router_pb2.ReportFailureRequest) -> None:
        """Sends the report with the stream's next message; lost if the stream breaks before
        that, as with a ReportFailure call that failed."""
        call = self._current()
        call.outgoing.message.failures.append(failure)
        call.outgoing.changed()

    def _current(self) -> _Call:
        if self._call is not None and self._call.broken:
            task = asyncio.create_task(self._call.close())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
            self._call = None
        if self._call is None:
            self._call = _Call(self._stub)
        return self._call

    async def close(self) -> None:
        if self._call is not None:
            await self._call.close()
            self._call = None
        await asyncio.gather(*self._closing)
