"""The gateway's gRPC client of the router (infermesh.v1.Router) and, after the router
chose, of the workers.

Every generation travels one way: the router chooses on the gateway's long-lived route stream
(``Router.RouteStream``: ``gateway.mesh.route_stream_client``), then the gateway streams from
the chosen worker over its long-lived ``Worker.Serve`` streams (``infermesh.serve_client``), trying
the
fallback worker when the first fails before its first chunk and reporting each failure to the
router on the route stream. One channel to the router per process, one per worker, opened
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
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import grpc
from aiohttp import web

from gateway.config import RouterSection
from gateway.http.errors import ClientTooSlowError, GatewayError, ServiceUnavailableError, from_grpc
from gateway.mesh.route_stream_client import RouteStream
from gateway.mesh.route_stream_client import workers as route_workers
from infermesh.bidi import retry_after_ms
from infermesh.channels import WorkerChannels, router_channel_options
from infermesh.failover import StreamFailedError, stream_from_first
from infermesh.pb import common_pb2, router_pb2, router_pb2_grpc, worker_pb2
from infermesh.serve_client import ReaderTooSlowError, ServeClient
from infermesh.text.text_files import assembled
from infermesh.tls import TlsSection, open_channel, warn_plaintext

logger = logging.getLogger(__name__)

_REASK_PAUSE_S = 0.02  # between a route ask's break and asking again


class MeshCall:
    """One generation through the mesh: its chunks and, once the first came, its route."""

    chunks: AsyncGenerator[common_pb2.GenerateResponse, None]
    route: common_pb2.Route | None = None
    # the router's decision when it was asked ahead; taken when the call starts
    decided: asyncio.Future[router_pb2.RouteDecision] | None = None

    def __aiter__(self) -> AsyncIterator[common_pb2.GenerateResponse]:
        return self.chunks


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
        """The generation, its route known once the first chunk came; closing its chunks
        cancels the call. Not ``stream``: the caller needs only the whole answer (which
        may then come as one chunk). The router is asked at once (on the route stream, when
        it is connected), while the caller does other work (admission) before it reads the
        chunks; a call that never starts hands its decision back with ``unused``."""
        call = MeshCall()
        if self._channel.get_state(try_to_connect=True) == grpc.ChannelConnectivity.READY:
            call.decided = self._ask(request)
        call.chunks = self._chunks(request, stream, call)
        return call

    def unused(self, call: MeshCall) -> None:
        """Hands back the decision of a call that never started (its request was refused)."""
        decided, call.decided = call.decided, None
        if decided is not None:
            self._route_stream.unused(decided)

    async def _chunks(
        self,
        request: common_pb2.GenerateRequest,
        stream: bool,
        call: MeshCall,
    ) -> AsyncGenerator[common_pb2.GenerateResponse, None]:
        await self._wait_connected()
        chunks = self._served(request, stream, call)
        try:
            async for chunk in chunks:
                yield chunk
        except grpc.aio.AioRpcError as e:
            raise self._error(e.code(), e.details(), retry_after_ms(e)) from None
        except StreamFailedError as e:
            raise self._error(e.code, e.details, from_router=False) from None
        except ReaderTooSlowError as e:
            raise ClientTooSlowError(str(e)) from None
        finally:
            await chunks.aclose()

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
        call = self._workers.stub(address).TextFiles(
            worker_pb2.TextFilesRequest(),
            timeout=self._config.request_timeout_s,
            wait_for_ready=False,
        )
        return assembled([(chunk.name, chunk.data) async for chunk in call])

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

    async def _served(
        self,
        request: common_pb2.GenerateRequest,
        stream: bool,
        call: MeshCall,
    ) -> AsyncGenerator[common_pb2.GenerateResponse, None]:
        decided, call.decided = call.decided, None
        if decided is None:  # not asked ahead: the channel was not connected then
            decided = self._ask(request)
        workers = route_workers(await self._decision(request, decided))
        deadline = asyncio.get_running_loop().time() + self._config.request_timeout_s
        stall_s = self._config.stall_timeout_s if stream else None
        try:
            async for chunk in stream_from_first(
                workers,
                lambda route: self._from_worker(route, request, stream, deadline, stall_s, call),
                self._report_failure,
                lambda route: route.worker_id,
            ):
                yield chunk
        finally:
            # one report per routed request, however it ends: its slot is free again
            self._route_stream.finished(workers[0].worker_id)

    async def _decision(
        self,
        request: common_pb2.GenerateRequest,
        decided: asyncio.Future[router_pb2.RouteDecision],
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
            try:
                return await decided
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
            await self._wait_connected()
            decided = self._ask(request)

    def _ask(self, request: common_pb2.GenerateRequest) -> asyncio.Future[router_pb2.RouteDecision]:
        """The route stream's ask for ``request``, which may wait in the router's fair queue
        for as long as the request may take."""
        return self._route_stream.ask(
            request, self._config.control_timeout_s, wait_s=self._config.request_timeout_s
        )

    async def _from_worker(
        self,
        route: common_pb2.Route,
        request: common_pb2.GenerateRequest,
        stream: bool,
        deadline: float,
        stall_s: float | None,
        call: MeshCall,
    ) -> AsyncGenerator[common_pb2.GenerateResponse, None]:
        timeout = max(deadline - asyncio.get_running_loop().time(), 0.001)
        # stalls are timed where the chunks arrive (infermesh.serve_client), not here
        chunks = self._streams.chunks(
            route.address,
            request,
            whole=not stream,
            timeout_s=timeout,
            stall_s=stall_s,
            pull=route.pull if route.HasField("pull") else None,
        )
        async with contextlib.aclosing(chunks):
            async for chunk in chunks:
                call.route = route  # the worker that answered: the fallback, if the first failed
                yield chunk

    def _report_failure(
        self, route: common_pb2.Route, code: grpc.StatusCode, details: str, started: bool
    ) -> None:
        """Tells the router (with the route stream's next message), so that it ejects a worker
        that keeps failing."""
        logger.warning(
            "worker %s failed %s the first token (%s: %s)",
            route.worker_id,
            "after" if started else "before",
            code.name,
            details,
        )
        self._route_stream.report_failure(
            router_pb2.ReportFailureRequest(
                worker_id=route.worker_id, code=code.name, details=details
            )
        )

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


MESH = web.AppKey("mesh", MeshClient)
