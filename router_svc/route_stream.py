"""Router.RouteStream: route decisions and failure reports for many requests over one
long-lived stream, so that a gateway's request costs the router a message, not a call.

The asks of one message are decided together, in order, and answered in one message; a
decision is made exactly as Route makes it (the same chooser, the same span attributes), on
a span of its own in the ask's trace, linked to the stream's span. A caller that asked
ahead of its own admission check names the workers of decisions it did not use, so the
router stops counting them as routed.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Protocol

import grpc
from opentelemetry import propagate, trace

from infermesh.pb import common_pb2, router_pb2
from router_svc.registry import RegistryUnavailableError
from router_svc.routing import RouteError

_tracer = trace.get_tracer(__name__)


class Decider(Protocol):
    """What a stream asks of the router (its servicer): the calls Route and ReportFailure
    make, one per ask or report."""

    def route(self, request: common_pb2.GenerateRequest) -> router_pb2.RouteResponse:
        """The workers for ``request``, counted as routed to; raises RouteError or
        RegistryUnavailableError."""
        ...

    def report_failure(self, request: router_pb2.ReportFailureRequest) -> None:
        """Counts a routed worker's failure; ValueError for a code that is no status name."""
        ...

    def unused(self, worker_id: str) -> None:
        """A decision that routed to ``worker_id`` was not used."""
        ...


async def answer(
    servicer: Decider,
    requests: AsyncIterator[router_pb2.RouteStreamRequest],
) -> AsyncGenerator[router_pb2.RouteStreamResponse, None]:
    stream_span = trace.get_current_span().get_span_context()
    links = [trace.Link(stream_span)] if stream_span.is_valid else []
    async for message in requests:
        for worker_id in message.unused:
            servicer.unused(worker_id)
        for failure in message.failures:
            # a report the router cannot read changes nothing; the caller goes on
            with contextlib.suppress(ValueError):
                servicer.report_failure(failure)
        if message.asks:
            yield router_pb2.RouteStreamResponse(
                decisions=[_decide(servicer, ask, links) for ask in message.asks]
            )


def _decide(
    servicer: Decider, ask: router_pb2.RouteAsk, links: list[trace.Link]
) -> router_pb2.RouteDecision:
    parent = propagate.extract(dict(ask.trace_context))
    with _tracer.start_as_current_span(
        "infermesh.v1.Router/Route", context=parent, kind=trace.SpanKind.SERVER, links=links
    ):
        try:
            reply = servicer.route(ask.request)
        except RouteError as e:
            return router_pb2.RouteDecision(id=ask.id, code=e.code.value[0], details=str(e))
        except RegistryUnavailableError as e:
            return router_pb2.RouteDecision(
                id=ask.id, code=grpc.StatusCode.UNAVAILABLE.value[0], details=f"{e}; retry later"
            )
        return router_pb2.RouteDecision(id=ask.id, workers=reply.workers)
