"""The gateway's long-lived ``Router.RouteStream``: route decisions and failure reports for
all of a gateway process's requests over one stream, so that a request costs the router a
message, not a call.

An ask is answered by its id; the router still makes every decision. A request asks ahead of
its admission check (``gateway.api.generation``), so that the two round trips overlap; when
admission refuses it, its decision goes back to the router as unused. The stream is opened
on first use and again after it broke; a break fails the asks waiting on it with UNAVAILABLE
(its own status in the details), whatever the status the stream ended with: no router decided
them, so they may be asked again (a router ending its streams when it loses its registry can
reach the gateway as gRPC's INTERNAL "Internal error from Core" under load).
"""

from __future__ import annotations

import asyncio
import itertools

import grpc
from opentelemetry import propagate

import telemetry
from infermesh.bidi import SharedCall, SharedCalls, call_error, check_size
from infermesh.pb import common_pb2, router_pb2, router_pb2_grpc

_PEER = "router"
_Decided = asyncio.Future[router_pb2.RouteDecision]


class _Call(SharedCall[router_pb2.RouteStreamRequest, router_pb2.RouteStreamResponse, _Decided]):
    """One RouteStream call; its waiting asks are futures of their decisions."""

    def __init__(self, stub: router_pb2_grpc.RouterStub) -> None:
        super().__init__(
            lambda messages: stub.RouteStream(messages, wait_for_ready=False),
            router_pb2.RouteStreamRequest,
            _PEER,
            "the router ended the route stream",
        )

    def _dispatch(self, message: router_pb2.RouteStreamResponse) -> None:
        for decision in message.decisions:
            waiter = self.waiting.pop(decision.id, None)
            if waiter is not None and not waiter.done():
                waiter.set_result(decision)
            elif decision.workers:  # its request is gone (cancelled, expired): not sent
                self.outgoing.message.unused.append(decision.workers[0].worker_id)
                self.outgoing.changed()

    def _fail(self, waiter: _Decided, error: grpc.aio.AioRpcError) -> None:
        if not waiter.done():
            waiter.set_exception(
                call_error(
                    grpc.StatusCode.UNAVAILABLE,
                    f"the route stream broke ({error.code().name}: {error.details()})",
                )
            )


def without_ids(request: common_pb2.GenerateRequest) -> common_pb2.GenerateRequest:
    """``request`` as the router routes it: its prefix hashes, not the prompt's token ids (an
    80k-token prompt's are 320 KB the router would parse for nothing; only the worker serves
    them)."""
    if request.prefix_hashes:
        request.ClearField("prompt_token_ids")
    return request


def _expire(decided: _Decided) -> None:
    if not decided.done():
        decided.set_exception(
            call_error(grpc.StatusCode.DEADLINE_EXCEEDED, "the router did not decide in time")
        )


class RouteStream:
    """Route asks and failure reports over one long-lived call; safe to share across
    requests."""

    def __init__(self, stub: router_pb2_grpc.RouterStub) -> None:
        self._calls = SharedCalls(lambda _: _Call(stub))
        self._ids = itertools.count(1)

    def ask(
        self, request: common_pb2.GenerateRequest, timeout_s: float, wait_s: float = 0.0
    ) -> asyncio.Future[router_pb2.RouteDecision]:
        """Sends the ask with the stream's next message; the future holds the router's
        decision (``infermesh.mesh_call.routes_of`` reads it), or fails: the stream's status when
        it breaks, DEADLINE_EXCEEDED after ``timeout_s`` more than the ``wait_s`` it may wait
        in the router's fair queue, RESOURCE_EXHAUSTED for a request too large for a message.
        Cancelling the future cancels the ask on the router."""
        loop = asyncio.get_running_loop()
        decided = loop.create_future()
        try:
            check_size(request)
        except grpc.aio.AioRpcError as e:
            decided.set_exception(e)
            return decided
        call = self._current()
        ask_id = next(self._ids)
        call.waiting[ask_id] = decided
        ask = call.outgoing.message.asks.add(
            id=ask_id, request=request, timeout_ms=round(wait_s * 1000)
        )
        without_ids(ask.request)
        if telemetry.tracing_enabled():
            propagate.inject(ask.trace_context)
        call.outgoing.changed()
        # a timer that fails the ask rather than asyncio.timeout around each wait: cheaper,
        # and the ask may be awaited later than it is sent
        expiry = loop.call_later(wait_s + timeout_s, _expire, decided)

        def done(_: asyncio.Future[router_pb2.RouteDecision]) -> None:
            expiry.cancel()
            if call.waiting.pop(ask_id, None) is not None and decided.cancelled():
                # its client left while it waited: out of the router's queue
                call.outgoing.message.cancel.append(ask_id)
                call.outgoing.changed()

        decided.add_done_callback(done)
        return decided

    def unused(self, decided: asyncio.Future[router_pb2.RouteDecision]) -> None:
        """Tells the router, once ``decided`` is decided, that its request was not sent to
        the workers it chose, so that they are not counted as busy with it."""

        def hand_back(_: asyncio.Future[router_pb2.RouteDecision]) -> None:
            if decided.cancelled() or decided.exception() is not None:
                return
            chosen = decided.result().workers
            if not chosen:
                return
            for call in self._calls.open(_PEER):  # none is opened just for this
                # the router counted the first choice only: the fallback is a spare
                call.outgoing.message.unused.append(chosen[0].worker_id)
                call.outgoing.changed()

        decided.add_done_callback(hand_back)

    def finished(self, end: router_pb2.RouteFinished) -> None:
        """Tells the router that a request it routed ended (however, with what it delivered),
        so that its worker's slot counts as free at once."""
        for call in self._calls.open(_PEER):  # the router forgets a broken stream's counts
            call.outgoing.message.ends.append(end)
            call.outgoing.message.finished.append(end.worker_id)  # for a router before `ends`
            call.outgoing.changed()

    def report_failure(self, failure: router_pb2.ReportFailureRequest) -> None:
        """Sends the report with the stream's next message; lost if the stream breaks before
        that, as with a ReportFailure call that failed."""
        call = self._current()
        call.outgoing.message.failures.append(failure)
        call.outgoing.changed()

    def _current(self) -> _Call:
        return self._calls.get(_PEER)

    async def close(self) -> None:
        await self._calls.close()
