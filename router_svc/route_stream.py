"""Router.RouteStream: route decisions and failure reports for many requests over one
long-lived stream, so that a gateway's request costs the router a message, not a call.

The asks of one message are decided in order (those that came without block hashes hashed
first, within a short bound: ``Decider.hash_prompts``) and those decided at once are answered in
one message; with fair queueing, an ask that waits for a free slot is answered by a later
message, when its turn comes or its wait ends, unless its caller cancels it first. A decision
is made as an internal caller's Router.Generate makes its own (the same ``Decider.ask``: the
same chooser, fair queue and count, the same span attributes, the same answer, ``decision``),
on a span of its own in the ask's trace, linked to the stream's span. The caller
reports each routed request's end (``ends``: which worker answered, whether it completed,
what it delivered; older callers ``finished``) and the decisions it did not use
(``unused``: it asked ahead of its own admission check), so the router's count of each
worker's requests stays exact; what the stream routed and never reported is released when
the stream ends. A router that cannot reach its registry backs no decision: it ends its streams
with UNAVAILABLE (``OpenStreams.end_all``, and any stream on which it is asked one), so that its
callers ask another router.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import Any, Protocol

import grpc
from opentelemetry import propagate, trace

from infermesh.pb import common_pb2, router_pb2
from infermesh.tasks import cancel_and_wait
from router_svc.fair_queue import QueueRefusedError
from router_svc.fleet import WorkerEntry
from router_svc.registry import RegistryUnavailableError
from router_svc.routing import RouteError

_tracer = trace.get_tracer(__name__)

_Decided = asyncio.Future[list[WorkerEntry]]


class Decider(Protocol):
    """What a stream asks of the router (its servicer)."""

    async def hash_prompts(self, requests: Sequence[common_pb2.GenerateRequest]) -> None:
        """Adds their block hashes to the requests that came without, when it can in a short
        bound; the others go on as they came."""
        ...

    def ask(self, request: common_pb2.GenerateRequest, wait_s: float) -> _Decided:
        """The workers for ``request``, the first counted until ``released``: at once or once
        a slot frees; fails with RouteError, RegistryUnavailableError or QueueRefusedError.
        Cancelling it takes the ask out of the queue."""
        ...

    def routes(self, attempts: list[WorkerEntry]) -> list[common_pb2.Route]:
        """A decision's workers, with their addresses, as the stream answers them."""
        ...

    def report_failure(self, request: router_pb2.ReportFailureRequest) -> None:
        """Counts a routed worker's failure; ValueError for a code that is no status name."""
        ...

    def released(self, worker_id: str) -> None:
        """A request routed to ``worker_id`` ended, or was not sent."""
        ...

    def finished(self, end: router_pb2.RouteFinished) -> None:
        """A routed request ended (``released``), as its caller reports it."""
        ...


class OpenStreams:
    """The route streams a router answers now, so that it can end them all: when its registry
    becomes unreachable, it can back no decision, and a caller whose stream ends asks another
    router (``infermesh.channels.router_channel_options``)."""

    def __init__(self) -> None:
        self._streams: set[_Stream] = set()

    def add(self, stream: _Stream) -> None:
        self._streams.add(stream)

    def discard(self, stream: _Stream) -> None:
        self._streams.discard(stream)

    def end_all(self, reason: str) -> None:
        """Ends every open stream with UNAVAILABLE and ``reason``; their waiting asks with it."""
        for stream in self._streams:
            stream.end(reason)


async def decisions(
    servicer: Decider,
    requests: AsyncIterator[router_pb2.RouteStreamRequest],
    context: grpc.aio.ServicerContext[Any, Any],
    streams: OpenStreams,
) -> AsyncGenerator[router_pb2.RouteStreamResponse, None]:
    """Answers one RouteStream call, among ``streams`` while it is open."""
    stream = _Stream(servicer)
    streams.add(stream)
    reader = asyncio.create_task(stream.read(requests))
    # a caller that cancels ends its requests like one done writing: only the call's end
    # tells the two apart, and its queued asks must not wait on
    context.add_done_callback(stream.abandon)  # type: ignore[arg-type]  # the stubs' type matches no callable
    try:
        while True:
            decisions = await stream.next_decisions(reader)
            if stream.ended is not None:
                await context.abort(grpc.StatusCode.UNAVAILABLE, stream.ended)
            if decisions is None:
                if reader.done():
                    reader.result()  # the caller's stream failed: so does this one
                return
            yield router_pb2.RouteStreamResponse(decisions=decisions)
    finally:
        streams.discard(stream)
        reader.cancel()
        stream.close()  # before any await: a cancelled call's task may not get past one
        await cancel_and_wait(reader)


class _Stream:
    """One RouteStream call's state: its asks waiting for a decision, the decisions ready to
    send, and the requests it routed that are not released yet, by worker."""

    def __init__(self, servicer: Decider) -> None:
        self._servicer = servicer
        self._waiting: dict[int, _Decided] = {}
        self._ready: list[router_pb2.RouteDecision] = []
        self._wake = asyncio.Event()
        self._routed: collections.Counter[str] = collections.Counter()
        self._abandoned = False
        self.ended: str | None = None  # why the router ends the stream (UNAVAILABLE)
        stream_span = trace.get_current_span().get_span_context()
        self._links = [trace.Link(stream_span)] if stream_span.is_valid else []

    async def read(self, requests: AsyncIterator[router_pb2.RouteStreamRequest]) -> None:
        try:
            async for message in requests:
                # the asks of a message stay one batch, decided in order: the few without
                # block hashes are hashed first (bounded), the next message waits meanwhile
                await self._servicer.hash_prompts([ask.request for ask in message.asks])
                self._take(message)
        finally:
            self._wake.set()

    async def next_decisions(
        self, reader: asyncio.Task[None]
    ) -> list[router_pb2.RouteDecision] | None:
        """The decisions ready since the last call; None once the caller is done and every
        ask is answered."""
        while not self._ready or self.ended is not None:
            if self._abandoned or self.ended is not None:
                return None
            if reader.done() and (not self._waiting or reader.exception() is not None):
                return None
            self._wake.clear()
            await self._wake.wait()
        ready, self._ready = self._ready, []
        return ready

    def abandon(self, _: grpc.aio.ServicerContext[Any, Any]) -> None:
        """The call ended: no decision will be read."""
        self._abandoned = True
        self._wake.set()

    def end(self, reason: str) -> None:
        """The router ends the call with UNAVAILABLE: its decisions not sent are not sent."""
        self.ended = reason
        self._wake.set()

    def close(self) -> None:
        for decided in self._waiting.values():
            if not decided.cancel() and not decided.cancelled() and not decided.exception():
                # placed just now, its decision not sent yet: the slot is free again
                self._routed[decided.result()[0].worker_id] += 1
        self._waiting.clear()  # the rest are cancelled: their caller is gone
        for worker_id, count in self._routed.items():
            for _ in range(count):
                self._servicer.released(worker_id)
        self._routed.clear()

    def _take(self, message: router_pb2.RouteStreamRequest) -> None:
        for ask_id in message.cancel:
            decided = self._waiting.pop(ask_id, None)
            if decided is not None:
                decided.cancel()
        # a caller that reports ends lists them in finished too, for routers before ends
        finished = () if message.ends else message.finished
        for worker_id in (*message.unused, *finished):
            if self._routed[worker_id] > 0:  # a stream releases only what it routed
                self._routed[worker_id] -= 1
                self._servicer.released(worker_id)
        for end in message.ends:
            if self._routed[end.worker_id] > 0:
                self._routed[end.worker_id] -= 1
                self._servicer.finished(end)
        for failure in message.failures:
            # a report the router cannot read changes nothing; the caller goes on
            with contextlib.suppress(ValueError):
                self._servicer.report_failure(failure)
        for ask in message.asks:
            self._ask(ask)

    def _ask(self, ask: router_pb2.RouteAsk) -> None:
        parent = propagate.extract(dict(ask.trace_context))
        span = _tracer.start_span(
            "infermesh.v1.Router/Route",
            context=parent,
            kind=trace.SpanKind.SERVER,
            links=self._links,
        )
        with trace.use_span(span, end_on_exit=False):
            decided = self._servicer.ask(ask.request, ask.timeout_ms / 1000)
        if decided.done():
            span.end()
            self._decided(ask.id, decided)
            return
        self._waiting[ask.id] = decided

        def done(_: _Decided) -> None:
            span.end()
            if self._waiting.pop(ask.id, None) is decided:
                self._decided(ask.id, decided)

        decided.add_done_callback(done)

    def _decided(self, ask_id: int, decided: _Decided) -> None:
        if decided.cancelled():
            return  # its caller left: no decision
        if isinstance(decided.exception(), RegistryUnavailableError):
            # no decision it cannot back: the stream ends, and its caller asks another router
            self.end(f"{decided.exception()}; the router cannot reach its registry, ask another")
            return
        self._ready.append(self._decision(ask_id, decided))
        self._wake.set()

    def _decision(self, ask_id: int, decided: _Decided) -> router_pb2.RouteDecision:
        answered = decision(self._servicer, ask_id, decided)
        if answered.workers:
            self._routed[answered.workers[0].worker_id] += 1
        return answered


def decision(servicer: Decider, ask_id: int, decided: _Decided) -> router_pb2.RouteDecision:
    """The decision ``decided`` (done, not cancelled) answers ask ``ask_id`` with: its workers,
    or the status of the router's refusal."""
    error = decided.exception()
    if error is None:
        return router_pb2.RouteDecision(id=ask_id, workers=servicer.routes(decided.result()))
    if isinstance(error, QueueRefusedError):
        return router_pb2.RouteDecision(
            id=ask_id,
            code=error.code.value[0],
            details=str(error),
            retry_after_ms=error.retry_after_ms,
        )
    if isinstance(error, RouteError):
        return router_pb2.RouteDecision(id=ask_id, code=error.code.value[0], details=str(error))
    if isinstance(error, RegistryUnavailableError):
        return router_pb2.RouteDecision(
            id=ask_id,
            code=grpc.StatusCode.UNAVAILABLE.value[0],
            details=f"{error}; retry later",
        )
    raise error
