"""One generation through the mesh: the one client path every caller runs, the gateway for
its HTTP requests and the router for its internal callers' ``Router.Generate`` / ``Complete``.

A call is routed on the router's decision as ``Router.RouteStream`` makes it (the gateway asks
over its route stream, the router asks itself), served on the chosen worker's long-lived
``Worker.Serve`` streams (``infermesh.serve_client``) with failover to the fallback before the
first chunk (``infermesh.failover``), and reported to the router once it ends, however it
ends, with what it delivered (``Router.finished``: ``RouteFinished``, as a route stream
reports it). The chunks pass one generator here: the
worker's buffer is read, counted and handed on in one step.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Callable
from typing import Protocol

import grpc

from infermesh.bidi import call_error, status_code
from infermesh.failover import Failover, worker_failure
from infermesh.pb import common_pb2, router_pb2
from infermesh.serve_client import OpenedRequest, ServeClient

logger = logging.getLogger(__name__)

_Decided = asyncio.Future[router_pb2.RouteDecision]


class Router(Protocol):
    """What a mesh call asks of the router: over the gateway's route stream, or the router's
    own decisions for its internal callers."""

    def ask(self, request: common_pb2.GenerateRequest) -> _Decided | None:
        """Asks for ``request``'s route ahead, while the caller does other work (None: it is
        asked when the call starts)."""
        ...

    async def decision(
        self, request: common_pb2.GenerateRequest, asked: _Decided | None
    ) -> router_pb2.RouteDecision:
        """The router's decision on ``request`` (``asked``: the ask made ahead)."""
        ...

    def unused(self, asked: _Decided) -> None:
        """The decision of a call that never started goes back: its workers are not busy."""
        ...

    def report_failure(self, failure: router_pb2.ReportFailureRequest) -> None:
        """A routed worker failed: the router counts it toward the worker's ejection."""
        ...

    def finished(self, end: router_pb2.RouteFinished) -> None:
        """A routed request ended, however: its worker's slot is free; ``end`` says which
        worker answered, whether it completed, and what it delivered."""
        ...


def routes_of(decision: router_pb2.RouteDecision) -> list[common_pb2.Route]:
    """The workers of a decision, best first; raises ``grpc.aio.AioRpcError`` with the
    router's status (and retry-after) when it has none."""
    if decision.code:
        raise call_error(status_code(decision.code), decision.details, decision.retry_after_ms)
    return list(decision.workers)


class MeshCall:
    """One request's generation: ``chunks`` (closing it cancels the request; a call never
    started hands its decision back with ``unused``), then ``route``, ``finish_reason`` and
    ``usage()``. Fails with ``grpc.aio.AioRpcError`` (the router's refusal),
    ``failover.StreamFailedError`` (the workers' outcome) or
    ``serve_client.ReaderTooSlowError``."""

    def __init__(
        self,
        router: Router,
        serve: ServeClient,
        request: common_pb2.GenerateRequest,
        *,
        stream: bool,
        timeout_s: Callable[[], float | None],
        stall_s: float | None,
    ) -> None:
        """``stream``: chunks as they come (else the whole answer, which may come as one
        chunk); ``timeout_s()``: how long the workers may take, asked once the route is
        decided (None: no limit); ``stall_s``: the longest silence after the first chunk."""
        self._router = router
        self._serve = serve
        self._request = request
        self._whole = not stream
        self._timeout_s = timeout_s
        self._stall_s = stall_s
        self.route: common_pb2.Route | None = None  # the worker answering, once it sent a chunk
        self.finish_reason = common_pb2.FINISH_REASON_UNSPECIFIED
        self._reported: common_pb2.Usage | None = None
        self._tokens = 0
        self._reasoning_tokens = 0  # of the chunks of reasoning alone
        self._asked = router.ask(request)
        self.chunks: AsyncGenerator[common_pb2.GenerateResponse, None] = self._chunks()

    def unused(self) -> None:
        """Hands back the decision of a call that never started (its request was refused)."""
        asked, self._asked = self._asked, None
        if asked is not None:
            self._router.unused(asked)

    def usage(self) -> common_pb2.Usage:
        """What the call delivered so far: the worker's report once it finished, else the
        prompt as the worker reported it with its first chunk and the tokens counted as they
        passed (a stream that failed midway, or whose reader left, counts what it sent)."""
        reported = self._reported
        if reported is not None and self.finish_reason:
            return reported
        return common_pb2.Usage(
            prompt_tokens=reported.prompt_tokens if reported is not None else 0,
            cached_prompt_tokens=reported.cached_prompt_tokens if reported is not None else 0,
            completion_tokens=self._tokens,
            reasoning_tokens=self._reasoning_tokens,
        )

    async def _chunks(self) -> AsyncGenerator[common_pb2.GenerateResponse, None]:
        asked, self._asked = self._asked, None
        routes = routes_of(await self._router.decision(self._request, asked))
        loop = asyncio.get_running_loop()
        timeout_s = self._timeout_s()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        failover = Failover()
        try:
            for route in routes:
                started = False
                error: grpc.aio.AioRpcError | None = None
                opened: OpenedRequest | None = None
                try:
                    opened = self._serve.open(
                        route.address,
                        self._request,
                        whole=self._whole,
                        timeout_s=None if deadline is None else max(deadline - loop.time(), 0.001),
                        stall_s=self._stall_s,
                        pull=route.pull if route.HasField("pull") else None,
                    )
                    while (chunk := await opened.next()) is not None:
                        if not started:
                            started, self.route = True, route
                        self._count(chunk)
                        yield chunk
                    if self.finish_reason:
                        return
                except grpc.aio.AioRpcError as e:
                    error = e
                finally:
                    if opened is not None:
                        opened.close()
                code, details = worker_failure(error)
                Failover.check_callers(code, details)
                self._failed(route, code, details, started)
                failover.failed(route.worker_id, code, details, started)
            raise failover.given_up()
        finally:
            self._router.finished(
                router_pb2.RouteFinished(
                    worker_id=routes[0].worker_id,
                    served_by=self.route.worker_id if self.route is not None else "",
                    completed=bool(self.finish_reason),
                    usage=self.usage(),
                )
            )

    def _count(self, chunk: common_pb2.GenerateResponse) -> None:
        self._tokens += len(chunk.token_ids)
        if chunk.reasoning_text and not chunk.text:
            self._reasoning_tokens += len(chunk.token_ids)
        if chunk.HasField("usage"):
            self._reported = chunk.usage
        if chunk.finish_reason:
            self.finish_reason = chunk.finish_reason

    def _failed(
        self, route: common_pb2.Route, code: grpc.StatusCode, details: str, started: bool
    ) -> None:
        logger.warning(
            "worker %s failed %s the first token (%s: %s)",
            route.worker_id,
            "after" if started else "before",
            code.name,
            details,
        )
        self._router.report_failure(
            router_pb2.ReportFailureRequest(
                worker_id=route.worker_id, code=code.name, details=details
            )
        )
