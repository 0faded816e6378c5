"""The gateway's gRPC client of the router (infermesh.v1.Router).

One channel per process, opened in the app's cleanup context. Calls never wait
for a router that is not there: a request first waits at most
``connect_timeout_s`` for a connection, and RPCs run with
``wait_for_ready=False`` and a deadline. Failures come out as ``GatewayError``.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc
from aiohttp import web

import telemetry
from gateway.config import RouterSection
from gateway.errors import GatewayError, ServiceUnavailableError, from_grpc
from infermesh.pb import common_pb2, router_pb2, router_pb2_grpc

logger = logging.getLogger(__name__)

# Reconnect soon after the router comes back, rather than grpc's default of
# backing off for up to two minutes.
_CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 2000),
]


class RouterClient:
    """Calls the router for the gateway's handlers; safe to share across requests."""

    def __init__(self, config: RouterSection) -> None:
        self._config = config
        self._channel = grpc.aio.insecure_channel(
            config.address, options=_CHANNEL_OPTIONS,
            interceptors=telemetry.grpc_client_interceptors())
        self._stub = router_pb2_grpc.RouterStub(self._channel)

    async def close(self) -> None:
        await self._channel.close()

    async def generate(self, request: common_pb2.GenerateRequest,
                       ) -> AsyncIterator[common_pb2.GenerateResponse]:
        """The router's stream for ``request``; closing the iterator cancels the call."""
        await self._wait_connected()
        call = self._stub.Generate(request, timeout=self._config.request_timeout_s,
                                   wait_for_ready=False)
        try:
            async for chunk in call:
                yield chunk
        except grpc.aio.AioRpcError as e:
            raise self._error(e) from None
        finally:
            call.cancel()

    async def list_models(self) -> list[router_pb2.Model]:
        await self._wait_connected()
        try:
            reply = await self._stub.ListModels(router_pb2.ListModelsRequest(),
                                                timeout=self._config.control_timeout_s,
                                                wait_for_ready=False)
        except grpc.aio.AioRpcError as e:
            raise self._error(e) from None
        return list(reply.models)

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
        return ServiceUnavailableError("The inference router is unreachable; try again shortly",
                                       code="router_unavailable",
                                       retry_after_s=self._config.retry_after_s)

    def _error(self, error: grpc.aio.AioRpcError) -> GatewayError:
        reachable = (self._channel.get_state() == grpc.ChannelConnectivity.READY)
        mapped = from_grpc(error, router_reachable=reachable,
                           retry_after_s=self._config.retry_after_s)
        if mapped.status >= 500:
            logger.warning("router call failed: %s %s", error.code().name, error.details())
        return mapped


ROUTER = web.AppKey("router", RouterClient)
