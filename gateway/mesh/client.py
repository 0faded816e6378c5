"""The gateway's gRPC client of the router (infermesh.v1.Router) and, after the router
chose, of the workers.

Every generation travels one way, the mesh call every caller of the mesh runs
(``infermesh.mesh_call``): the router chooses on the gateway's long-lived route stream
(``Router.RouteStream``: ``gateway.mesh.route_stream_client``; this client is the call's
``Router``), then the gateway streams from the chosen worker over its long-lived
``Worker.Serve`` streams (``infermesh.serve_client``), trying the fallback worker when the
first fails before its first chunk and reporting each failure to the router on the route
stream. One channel to the router per process, one per worker, opened
lazily (over mutual TLS with ``[tls]``, see ``infermesh.tls``) and closed in the app's
cleanup context. Calls never wait for a peer that is not there: a request first waits at
most ``connect_timeout_s`` for the router, and RPCs run with ``wait_for_ready=False`` and a
deadline. Failures come out as ``GatewayError``.

On the route stream an ask may wait in the router's fair queue (``[fair_queue]``) for as long
as the request may take; a request that ends reports its worker ``finished``, so the router
frees its slot at once, and one whose client leaves while it waits cancels its ask. The
router's refusals (its queues full) carry a retry-after, which becomes the 429 / 503's
``Retry-After``.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import grpc

from gateway.config import RouterSection
from gateway.http.errors import ClientTooSlowError, GatewayError, ServiceUnavailableError, from_grpc
from gateway.mesh.route_stream_client import RouteStream
from infermesh.bidi import retry_after_ms
from infermesh.channels import WorkerChannels, router_channel_options
from infermesh.failover import StreamFailedError
from infermesh.mesh_call import MeshCall
from infermesh.pb import common_pb2, router_pb2, router_pb2_grpc
from infermesh.prompt_tokens import worker_text_files
from infermesh.serve_client import ReaderTooSlowError, ServeClient
from infermesh.tls import TlsSection, open_channel, warn_plaintext

logger = logging.getLogger(__name__)

_Decided = asyncio.Future[router_pb2.RouteDecision]
CALL_ERRORS = (grpc.aio.AioRpcError, StreamFailedError, ReaderTooSlowError)
"""What a mesh call fails with: ``MeshClient.gateway_error`` maps each to its answer."""
_REASK_PAUSE_S = 0.02  # between a route ask's break and asking again


class MeshClient:
    """Calls the router (and the workers it chooses) for the gateway's handlers; safe to
    share across requests."""

    def __init__(self, config: RouterSection, tls: TlsSection) -> None:
        self._config = config
        if tls.plaintext:
            warn_plaintext("gateway")
        self._channel = open_channel(config.address, tls, router_channel_options(config.address))
        self._stub = router_pb2_grpc.RouterStub(self._channel)
        self._workers = WorkerChannels(tls)
        self._streams = ServeClient(
            self._workers,
            per_worker=config.streams_per_worker,
            buffered_chunks=config.stream_buffer_chunks,
        )
        self._route_stream = RouteStream(self._stub)

    @property
    def serve_client(self) -> ServeClient:
        """The long-lived streams to workers."""
        return self._streams

    async def close(self) -> None:
        await self._streams.close()
        await self._route_stream.close()
        await self._workers.close()
        await self._channel.close()

    def call(self, request: common_pb2.GenerateRequest, *, stream: bool) -> MeshCall:
        """The generation (``infermesh.mesh_call``); its failures come out as
        ``gateway_error`` maps them. The router is asked at once (on the route stream, when it
        is connected), while the caller does other work (admission) before it reads the
        chunks."""
        return MeshCall(
            self,
            self._streams,
            request,
            stream=stream,
            timeout_s=lambda: self._config.request_timeout_s,
            stall_s=self._config.stall_timeout_s if stream else None,
        )

    def gateway_error(self, error: Exception) -> Exception:
        """The GatewayError a mesh call's failure (one of ``CALL_ERRORS``) answers with; any
        other error unchanged."""
        if isinstance(error, grpc.aio.AioRpcError):
            return self._error(error.code(), error.details(), retry_after_ms(error))
        if isinstance(error, StreamFailedError):
            return self._error(error.code, error.details, from_router=False)
        if isinstance(error, ReaderTooSlowError):
            return ClientTooSlowError(str(error))
        return error

    async def tokenize(self, request: common_pb2.GenerateRequest) -> int:
        """The request's prompt tokens as a worker serving its model counts (and bills) them."""
        reply: common_pb2.TokenizeResponse = await self._control(self._stub.Tokenize, request)
        return reply.prompt_tokens

    async def list_models(self) -> list[router_pb2.Model]:
        return list(
            (await self._control(self._stub.ListModels, router_pb2.ListModelsRequest())).models
        )

    async def list_workers(self) -> list[router_pb2.WorkerStatus]:
        return list(
            (await self._control(self._stub.ListWorkers, router_pb2.ListWorkersRequest())).workers
        )

    async def text_files(self, address: str) -> dict[str, bytes]:
        """The tokenizer's files of the worker at ``address`` (Worker.TextFiles), over this
        gateway's channel to it; grpc.aio.AioRpcError or ValueError when they do not come."""
        return await worker_text_files(self._workers.stub(address), self._config.request_timeout_s)

    async def _control(self, rpc: Any, request: Any) -> Any:
        """A unary call that is not a generation: bounded by control_timeout_s, errors mapped.
        Each is a read, asked once more when the router was unavailable (it went away: the
        channel's next connection may reach another router of ``[router] address``)."""
        tries = 2
        while True:
            tries -= 1
            await self._wait_connected()
            try:
                return await rpc(
                    request, timeout=self._config.control_timeout_s, wait_for_ready=False
                )
            except grpc.aio.AioRpcError as e:
                if not tries or e.code() != grpc.StatusCode.UNAVAILABLE:
                    raise self._error(e.code(), e.details()) from None

    def ask(self, request: common_pb2.GenerateRequest) -> _Decided | None:
        """The route stream's ask, sent at once when the router is connected; it may wait in
        the router's fair queue for as long as the request may take."""
        if self._channel.get_state(try_to_connect=True) != grpc.ChannelConnectivity.READY:
            return None
        return self._route_stream.ask(
            request, self._config.control_timeout_s, wait_s=self._config.request_timeout_s
        )

    async def decision(
        self, request: common_pb2.GenerateRequest, asked: _Decided | None
    ) -> router_pb2.RouteDecision:
        """The router's decision; when the route stream broke under the ask (the router died,
        or it cannot reach its registry and ended the stream), no router answered it and no
        worker has the request, so it is asked again on the channel's next connection, to
        another router of ``[router] address`` or the same one restarted, for up to
        ``connect_timeout_s`` from the first break (the ask may have waited in the router's fair
        queue for much longer). Past that, the last break's status: a router that answers
        (its registry unreachable) is a 503 ``service_unavailable``, none answering
        ``router_unavailable``."""
        loop = asyncio.get_running_loop()
        deadline: float | None = None
        while True:
            if asked is None:
                await self._wait_connected()
                asked = self.ask(request)
                if asked is None:
                    continue  # the channel broke again meanwhile
            try:
                return await asked
            except grpc.aio.AioRpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
                if deadline is None:
                    deadline = loop.time() + self._config.connect_timeout_s
                elif loop.time() >= deadline:
                    raise self._error(e.code(), e.details()) from None
            # a router that cannot back decisions refuses a new stream at once, until the
            # channel's health check moves on from it: no spin meanwhile
            await asyncio.sleep(_REASK_PAUSE_S)
            asked = None

    def unused(self, asked: _Decided) -> None:
        self._route_stream.unused(asked)

    def report_failure(self, failure: router_pb2.ReportFailureRequest) -> None:
        """Tells the router (with the route stream's next message), so that it ejects a worker
        that keeps failing."""
        self._route_stream.report_failure(failure)

    def finished(self, end: router_pb2.RouteFinished) -> None:
        """The router frees the slot at once (the gateway settles its keys' usage itself)."""
        self._route_stream.finished(end)

    async def _wait_connected(self) -> None:
        """Returns once the channel is READY; a 503 when it fails or takes too long."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._config.connect_timeout_s
        state = self._channel.get_state(try_to_connect=True)
        while state != grpc.ChannelConnectivity.READY:
            remaining = deadline - loop.time()
            if state == grpc.ChannelConnectivity.TRANSIENT_FAILURE or remaining <= 0:
                raise self._unreachable()
            try:
                await asyncio.wait_for(self._channel.wait_for_state_change(state), remaining)
            except TimeoutError:
                raise self._unreachable() from None
            state = self._channel.get_state(try_to_connect=True)

    def _unreachable(self) -> GatewayError:
        return ServiceUnavailableError(
            "The inference router is unreachable; try again shortly",
            code="router_unavailable",
            retry_after_s=self._config.retry_after_s,
        )

    def _error(
        self,
        code: grpc.StatusCode,
        details: str | None,
        retry_after_ms: int = 0,
        *,
        from_router: bool = True,
    ) -> GatewayError:
        """``from_router``: the router's own status, where UNAVAILABLE may mean the router
        itself is gone; otherwise the outcome of the workers it chose. ``retry_after_ms``: the
        router's estimate (its fair queue's), else ``[router] retry_after_s``."""
        reachable = not from_router or self._channel.get_state() == grpc.ChannelConnectivity.READY
        mapped = from_grpc(
            code,
            details or "",
            router_reachable=reachable,
            retry_after_s=-(-retry_after_ms // 1000)
            if retry_after_ms
            else self._config.retry_after_s,
            from_workers=not from_router,
        )
        if mapped.status >= 500:
            logger.warning("generation failed: %s %s", code.name, details)
        return mapped
