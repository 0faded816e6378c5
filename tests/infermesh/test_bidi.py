"""The calling side of the shared streams: messages kept within gRPC's size limit; one call
that many requests wait on, failed together when it breaks; calls per peer, a broken one
replaced."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import grpc
import prometheus_client
import pytest

from infermesh.bidi import MAX_MESSAGE_BYTES, SharedCall, SharedCalls, check_size, split
from infermesh.pb import common_pb2, worker_pb2

_PEER = "test-echo"
_METHOD = "/test.Echo/Chat"
_OPEN, _BREAKS = "infermesh_gateway_streams_open", "infermesh_gateway_stream_breaks_total"


def _open(request_id: int, prompt_bytes: int) -> worker_pb2.OpenRequest:
    return worker_pb2.OpenRequest(
        id=request_id, request=common_pb2.GenerateRequest(model="m", prompt="x" * prompt_bytes)
    )


def test_a_message_past_the_limit_is_split_in_order_within_it():
    message = worker_pb2.StreamRequest(
        open=[_open(i, MAX_MESSAGE_BYTES // 3) for i in range(1, 6)], cancel=[7, 8]
    )
    parts = split(message)
    assert len(parts) > 1 and all(p.ByteSize() <= MAX_MESSAGE_BYTES for p in parts)
    assert [o.id for p in parts for o in p.open] == [1, 2, 3, 4, 5]
    assert [c for p in parts for c in p.cancel] == [7, 8]
    small = worker_pb2.StreamRequest(open=[_open(1, 10)])
    assert split(small) == [small]


def test_a_request_past_the_limit_is_refused_as_grpc_would():
    check_size(_open(1, 1000).request)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        check_size(_open(1, MAX_MESSAGE_BYTES).request)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "larger than max" in e.value.details()


async def _echo(
    requests: AsyncIterator[worker_pb2.StreamRequest], context: grpc.aio.ServicerContext[Any, Any]
) -> AsyncIterator[worker_pb2.StreamResponse]:
    """Answers each open with its prompt, but "wait"; an open whose prompt is "break" ends the
    call."""
    async for message in requests:
        for opened in message.open:
            prompt = opened.request.prompt
            if prompt == "break":
                await context.abort(grpc.StatusCode.UNAVAILABLE, "told to break")
            if prompt != "wait":
                chunk = worker_pb2.StreamChunk(
                    id=opened.id, chunk=common_pb2.GenerateResponse(text=prompt)
                )
                yield worker_pb2.StreamResponse(chunks=[chunk])


@asynccontextmanager
async def _echo_channel() -> AsyncIterator[grpc.aio.Channel]:
    server = grpc.aio.server()
    handler = grpc.stream_stream_rpc_method_handler(
        _echo,
        request_deserializer=worker_pb2.StreamRequest.FromString,
        response_serializer=worker_pb2.StreamResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("test.Echo", {"Chat": handler}),)
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield channel
    finally:
        await server.stop(None)


_Answer = asyncio.Future[str]


class _EchoCall(SharedCall[worker_pb2.StreamRequest, worker_pb2.StreamResponse, _Answer]):
    def __init__(self, channel: grpc.aio.Channel) -> None:
        chat = channel.stream_stream(
            _METHOD,
            request_serializer=worker_pb2.StreamRequest.SerializeToString,
            response_deserializer=worker_pb2.StreamResponse.FromString,
        )
        super().__init__(chat, worker_pb2.StreamRequest, _PEER, "the echo ended")
        self._ids = 0

    def ask(self, prompt: str) -> _Answer:
        self._ids += 1
        answer: _Answer = asyncio.get_running_loop().create_future()
        self.waiting[self._ids] = answer
        self.outgoing.message.open.add(
            id=self._ids, request=common_pb2.GenerateRequest(prompt=prompt)
        )
        self.outgoing.changed()
        return answer

    def _dispatch(self, message: worker_pb2.StreamResponse) -> None:
        for entry in message.chunks:
            self.waiting.pop(entry.id).set_result(entry.chunk.text)

    def _fail(self, waiter: _Answer, error: grpc.aio.AioRpcError) -> None:
        waiter.set_exception(error)


def _value(name: str) -> float:
    return prometheus_client.REGISTRY.get_sample_value(name, {"peer": _PEER}) or 0.0


async def test_requests_on_one_call_are_answered_and_fail_together_when_it_breaks():
    async with _echo_channel() as channel:
        opened, breaks = _value(_OPEN), _value(_BREAKS)
        call = _EchoCall(channel)
        assert _value(_OPEN) == opened + 1
        first, second = call.ask("one"), call.ask("two")
        assert (await first, await second) == ("one", "two")
        waiting = call.ask("wait")  # never answered
        broke = call.ask("break")
        for answer in (waiting, broke):
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await answer
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            assert e.value.details() == "told to break"
        assert call.broken and call.waiting == {}
        assert _value(_OPEN) == opened
        assert _value(_BREAKS) == breaks + 1
        await call.close()


async def test_calls_per_peer_are_shared_in_turn_and_a_broken_one_is_replaced():
    async with _echo_channel() as channel:
        started: list[_EchoCall] = []

        def start(peer: str) -> _EchoCall:
            started.append(_EchoCall(channel))
            return started[-1]

        calls: SharedCalls[_EchoCall] = SharedCalls(start, per_peer=2)
        a, b = calls.get("w1"), calls.get("w1")
        assert a is not b and {calls.get("w1"), calls.get("w1")} == {a, b}
        assert calls.get("w2") not in (a, b)  # each peer its own
        with pytest.raises(grpc.aio.AioRpcError):
            await a.ask("break")
        assert calls.open("w1") == [b]  # none opened by looking
        replacement = calls.get("w1")
        assert replacement not in (a, b) and len(started) == 4
        assert await replacement.ask("again") == "again"
        await calls.close()
        assert all(call.broken for call in started)  # closed: each call ended
