from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator

import grpc
import pytest

from bench.grpc_cancelled_reads import call_chunks
from infermesh.bidi import call_error
from infermesh.failover import StreamFailedError, stream_from_first
from infermesh.pb import common_pb2

_METHOD = "/test.Slow/Generate"


class _SlowStream:
    """A server that sends one chunk, then (``then``) nothing until the call ends, the
    second chunk, or an error; records a cancellation."""

    def __init__(self) -> None:
        self.cancelled = asyncio.Event()
        self.then = "wait"

    async def generate(
        self,
        request: common_pb2.GenerateRequest,
        context: grpc.aio.ServicerContext[common_pb2.GenerateRequest, common_pb2.GenerateResponse],
    ) -> AsyncIterator[common_pb2.GenerateResponse]:
        yield common_pb2.GenerateResponse(token_ids=[1])
        if self.then == "abort":
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy")
        if self.then == "end":
            yield common_pb2.GenerateResponse(token_ids=[2])
            return
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise


@pytest.fixture
async def slow() -> AsyncIterator[tuple[_SlowStream, grpc.aio.Channel]]:
    servicer = _SlowStream()
    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        [
            grpc.method_handlers_generic_handler(
                "test.Slow",
                {
                    "Generate": grpc.unary_stream_rpc_method_handler(
                        servicer.generate,
                        request_deserializer=common_pb2.GenerateRequest.FromString,
                        response_serializer=common_pb2.GenerateResponse.SerializeToString,
                    )
                },
            )
        ]
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    yield servicer, channel
    await channel.close()
    await server.stop(None)


def _call(
    channel: grpc.aio.Channel,
) -> grpc.aio.UnaryStreamCall[common_pb2.GenerateRequest, common_pb2.GenerateResponse]:
    rpc: grpc.aio.UnaryStreamMultiCallable[common_pb2.GenerateRequest, common_pb2.GenerateResponse]
    rpc = channel.unary_stream(
        _METHOD,
        request_serializer=common_pb2.GenerateRequest.SerializeToString,
        response_deserializer=common_pb2.GenerateResponse.FromString,
    )
    return rpc(common_pb2.GenerateRequest(), timeout=30)


async def test_a_consumer_cancelled_while_a_read_is_in_flight_cancels_the_call(slow) -> None:
    servicer, channel = slow
    call = _call(channel)
    first = asyncio.Event()

    async def consume() -> None:
        async with contextlib.aclosing(call_chunks(call, stream=True)) as chunks:
            async for chunk in chunks:
                assert list(chunk.token_ids) == [1]
                first.set()  # the loop's next step starts the read that never ends

    consumer = asyncio.create_task(consume())
    await first.wait()
    await asyncio.sleep(0.05)  # the consumer now awaits the second chunk
    consumer.cancel()
    with pytest.raises(asyncio.CancelledError):
        await consumer
    assert call.done() and await call.code() == grpc.StatusCode.CANCELLED
    await asyncio.wait_for(servicer.cancelled.wait(), 5)  # the server heard of it


async def test_chunks_are_the_stream_s_until_it_ends(slow) -> None:
    servicer, channel = slow
    servicer.then = "end"
    assert [list(c.token_ids) async for c in call_chunks(_call(channel), stream=True)] == [[1], [2]]


async def test_a_failed_call_raises_its_status_after_the_chunks_sent(slow) -> None:
    servicer, channel = slow
    servicer.then = "abort"
    received = []
    with pytest.raises(grpc.aio.AioRpcError) as failure:
        async for chunk in call_chunks(_call(channel), stream=True):
            received.append(list(chunk.token_ids))
    assert received == [[1]]
    assert failure.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


class _Failover:
    """stream_from_first over made-up workers, each ``(chunks sent, then its failure)`` (None:
    it finishes); records the workers opened, the failures heard of and the chunks."""

    def __init__(self, workers: dict[str, tuple[int, grpc.StatusCode | None]]) -> None:
        self.workers = workers
        self.opened: list[str] = []
        self.failures: list[tuple[str, str, bool]] = []
        self.chunks: list[common_pb2.GenerateResponse] = []

    async def run(self) -> None:
        async for chunk in stream_from_first(
            list(self.workers), self._stream, self._failed, lambda name: name
        ):
            self.chunks.append(chunk)

    async def _stream(self, name: str) -> AsyncGenerator[common_pb2.GenerateResponse, None]:
        self.opened.append(name)
        sent, then = self.workers[name]
        for i in range(sent):
            yield common_pb2.GenerateResponse(token_ids=[i])
        if then is not None:
            raise call_error(then, f"{name} broke")
        yield common_pb2.GenerateResponse(finish_reason=common_pb2.FINISH_REASON_STOP)

    def _failed(self, name: str, code: grpc.StatusCode, details: str, started: bool) -> None:
        self.failures.append((name, code.name, started))


async def test_a_worker_failing_before_its_first_chunk_hands_the_request_on() -> None:
    failover = _Failover({"a": (0, grpc.StatusCode.UNAVAILABLE), "b": (2, None)})
    await failover.run()
    assert failover.opened == ["a", "b"] and failover.failures == [("a", "UNAVAILABLE", False)]
    assert len(failover.chunks) == 3
    assert failover.chunks[-1].finish_reason == common_pb2.FINISH_REASON_STOP


async def test_a_worker_failing_mid_stream_ends_it_with_its_own_status() -> None:
    failover = _Failover({"a": (2, grpc.StatusCode.INTERNAL), "b": (2, None)})
    with pytest.raises(StreamFailedError) as e:
        await failover.run()
    assert e.value.code == grpc.StatusCode.INTERNAL
    assert e.value.details == "worker a failed mid-stream: a broke"
    assert failover.opened == ["a"] and failover.failures == [("a", "INTERNAL", True)]
    assert len(failover.chunks) == 2


async def test_the_requests_own_fault_is_not_tried_elsewhere() -> None:
    failover = _Failover({"a": (0, grpc.StatusCode.INVALID_ARGUMENT), "b": (2, None)})
    with pytest.raises(StreamFailedError) as e:
        await failover.run()
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert failover.opened == ["a"] and failover.failures == []


async def test_every_worker_busy_is_resource_exhausted_naming_each() -> None:
    busy = grpc.StatusCode.RESOURCE_EXHAUSTED
    with pytest.raises(StreamFailedError) as e:
        await _Failover({"a": (0, busy), "b": (0, busy)}).run()
    assert e.value.code == busy
    assert "worker a: RESOURCE_EXHAUSTED a broke" in e.value.details
    assert "worker b: RESOURCE_EXHAUSTED b broke" in e.value.details
