from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc
import pytest

from bench.grpc_cancelled_reads import call_chunks
from infermesh.bidi import call_error
from infermesh.failover import Failover, StreamFailedError, worker_failure
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


def _broke(name: str, code: grpc.StatusCode) -> tuple[grpc.StatusCode, str]:
    return worker_failure(call_error(code, f"{name} broke"))


def test_a_worker_failing_before_its_first_chunk_hands_the_request_on() -> None:
    failover = Failover()
    code, details = _broke("a", grpc.StatusCode.UNAVAILABLE)
    Failover.check_callers(code, details)
    failover.failed("a", code, details, started=False)  # returns: the next worker may serve
    given_up = failover.given_up()
    assert given_up.code == grpc.StatusCode.UNAVAILABLE
    assert given_up.details == "no worker could serve the request (worker a: UNAVAILABLE a broke)"


def test_a_worker_failing_mid_stream_ends_it_with_its_own_status() -> None:
    with pytest.raises(StreamFailedError) as e:
        Failover().failed("a", *_broke("a", grpc.StatusCode.INTERNAL), started=True)
    assert e.value.code == grpc.StatusCode.INTERNAL
    assert e.value.details == "worker a failed mid-stream: a broke"


def test_the_requests_own_fault_is_not_tried_elsewhere() -> None:
    with pytest.raises(StreamFailedError) as e:
        Failover.check_callers(*_broke("a", grpc.StatusCode.INVALID_ARGUMENT))
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    Failover.check_callers(*_broke("a", grpc.StatusCode.UNAVAILABLE))  # a worker's: goes on


def test_a_worker_gone_or_ending_unfinished_is_unavailable() -> None:
    assert _broke("a", grpc.StatusCode.CANCELLED) == (grpc.StatusCode.UNAVAILABLE, "a broke")
    assert worker_failure(None) == (
        grpc.StatusCode.UNAVAILABLE,
        "the worker ended its stream unfinished",
    )


def test_every_worker_busy_is_resource_exhausted_naming_each() -> None:
    busy = grpc.StatusCode.RESOURCE_EXHAUSTED
    failover = Failover()
    for name in ("a", "b"):
        failover.failed(name, *_broke(name, busy), started=False)
    given_up = failover.given_up()
    assert given_up.code == busy
    assert "worker a: RESOURCE_EXHAUSTED a broke" in given_up.details
    assert "worker b: RESOURCE_EXHAUSTED b broke" in given_up.details
