"""The gateway's route stream against a real gRPC server: a stream that breaks, with whatever
status, fails the asks waiting on it as UNAVAILABLE, so that the gateway asks again rather than
answering a 502 for a decision no router made."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest

from gateway.mesh.route_stream_client import RouteStream
from infermesh.pb import common_pb2, router_pb2, router_pb2_grpc


class _BreakingRouter(router_pb2_grpc.RouterServicer):
    """Reads the first message of a route stream, then ends the call with ``code``."""

    def __init__(self, code: grpc.StatusCode) -> None:
        self.code = code

    async def RouteStream(
        self,
        request_iterator: AsyncIterator[router_pb2.RouteStreamRequest],
        context: grpc.aio.ServicerContext[
            router_pb2.RouteStreamRequest, router_pb2.RouteStreamResponse
        ],
    ) -> AsyncIterator[router_pb2.RouteStreamResponse]:
        async for _ in request_iterator:
            await context.abort(self.code, "broken on purpose")
        yield router_pb2.RouteStreamResponse()  # never reached: a stream handler


@pytest.mark.parametrize("code", [grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE])
async def test_an_ask_on_a_stream_that_breaks_fails_unavailable(code):
    server = grpc.aio.server()
    router_pb2_grpc.add_RouterServicer_to_server(_BreakingRouter(code), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stream = RouteStream(router_pb2_grpc.RouterStub(channel))
            decided = stream.ask(common_pb2.GenerateRequest(request_id="r", model="m"), 5.0)
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await asyncio.wait_for(decided, 5.0)
            await stream.close()
    finally:
        await server.stop(None)
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
    assert code.name in (failed.value.details() or "")
