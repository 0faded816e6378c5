"""The calling side of a long-lived bidirectional gRPC call that many requests share: the
gateway's route stream to the router and its Serve streams to the workers build on it.

``SharedCall`` is one such call: opened apart from any request's trace, a ``MessageBatcher`` as
its request iterator sending what requests add, one reader task, the requests waiting on it by
id (failed with the call's status when it breaks) and the stream metrics. ``SharedCalls`` keeps
them per peer, replacing a broken one and closing it in the background.
"""

from __future__ import annotations

import abc
import asyncio
import itertools
from collections.abc import AsyncIterator, Callable
from typing import Any, Generic, TypeVar, cast

import grpc
from google.protobuf.message import Message as ProtoMessage
from opentelemetry import context as otel_context

from infermesh.channels import GRPC_MESSAGE_LIMIT_BYTES
from telemetry.metrics import STREAM_BREAKS, STREAM_MESSAGES, STREAMS_OPEN

Message = TypeVar("Message", bound=ProtoMessage)
Outgoing = TypeVar("Outgoing", bound=ProtoMessage)
Incoming = TypeVar("Incoming", bound=ProtoMessage)
Waiter = TypeVar("Waiter")
Call = TypeVar("Call", bound="SharedCall[Any, Any, Any]")

# The mesh's gRPC message limit, less room for framing: what one message of a shared stream
# may hold. A message past the limit would end the whole stream, and with it every request on it.
MAX_MESSAGE_BYTES = GRPC_MESSAGE_LIMIT_BYTES - 64 * 1024


def check_size(request: ProtoMessage) -> None:
    """Fails one request too large for any message of a shared stream, alone, with the status
    and wording gRPC gives a call whose message is too large."""
    size = request.ByteSize()
    if size > MAX_MESSAGE_BYTES:
        raise call_error(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"Sent message larger than max ({size} vs. {MAX_MESSAGE_BYTES})",
        )


def split(message: Message, budget: int = MAX_MESSAGE_BYTES) -> list[Message]:
    """``message`` (of repeated fields only) as messages of at most ``budget`` bytes each, its
    items spread over them in order (each item itself within ``check_size``)."""
    if message.ByteSize() <= budget:
        return [message]
    parts = [type(message)()]
    size = 0
    for field, values in message.ListFields():
        for value in values:
            # its bytes, with room for its tag and length
            item = (value.ByteSize() if isinstance(value, ProtoMessage) else 10) + 8
            if size and size + item > budget:
                parts.append(type(message)())
                size = 0
            getattr(parts[-1], field.name).append(value)
            size += item
    return parts


class MessageBatcher(Generic[Message]):
    """Gathers what requests add between two writes into one message: callers add to
    ``message`` and call ``changed()``; ``messages()``, the call's request iterator, yields it
    whenever the call can take the next one, so a burst of requests costs one message, not one
    each (several when they would pass gRPC's message size limit). ``close()`` ends the
    iterator. Each message sent counts in ``infermesh_gateway_stream_messages`` under ``peer``.

    The call reads its messages from this iterator rather than being written to: grpc.aio
    (1.85) then ends its own task consuming them when the iterator ends. Written to, a call
    with client interceptors feeds such a task from a queue, and a peer that ends the call
    leaves that task and the generator it runs pending until they are collected ("Task was
    destroyed but it is pending!", "aclose(): asynchronous generator is already running")."""

    def __init__(self, new_message: Callable[[], Message], peer: str) -> None:
        self._new_message = new_message
        self._sent = STREAM_MESSAGES.labels(peer, "sent")
        self.message = new_message()
        self._send = asyncio.Event()
        self._closed = False

    def changed(self) -> None:
        self._send.set()

    def close(self) -> None:
        self._closed = True
        self._send.set()

    async def messages(self) -> AsyncIterator[Message]:
        while True:
            await self._send.wait()
            if self._closed:
                return
            self._send.clear()
            message, self.message = self.message, self._new_message()
            for part in split(message):
                yield part  # resumed once the call has written it
                self._sent.inc()


class SharedCall(abc.ABC, Generic[Outgoing, Incoming, Waiter]):
    """One long-lived bidirectional call that many requests share. What requests add to
    ``outgoing.message`` goes out in batches; each message received goes to ``_dispatch``;
    ``waiting`` holds what the open requests wait on, by their id on this call. When the call
    ends (``broken``) every request still waiting fails with its status (``ended``: the details
    when it ended without one), as a failed call of its own would. Streams open, breaks with
    requests on them and messages each way count under ``peer``."""

    def __init__(
        self,
        start: Callable[[AsyncIterator[Outgoing]], grpc.aio.StreamStreamCall[Any, Incoming]],
        new_message: Callable[[], Outgoing],
        peer: str,
        ended: str,
    ) -> None:
        self.waiting: dict[int, Waiter] = {}
        self.broken = False
        self._peer = peer
        self._ended = ended
        self._received = STREAM_MESSAGES.labels(peer, "received")
        STREAMS_OPEN.labels(peer).inc()
        # The call outlives the request that opened it: it, its span and its tasks belong to
        # no request's trace.
        token = otel_context.attach(otel_context.Context())
        try:
            self.outgoing = MessageBatcher(new_message, peer)
            self._call = start(self.outgoing.messages())
            self._reader = asyncio.create_task(self._read())
        finally:
            otel_context.detach(token)

    @abc.abstractmethod
    def _dispatch(self, message: Incoming) -> None:
        """Hands a message received to the requests it answers."""

    @abc.abstractmethod
    def _fail(self, waiter: Waiter, error: grpc.aio.AioRpcError) -> None:
        """Ends a request still waiting when the call broke."""

    async def _read(self) -> None:
        error = call_error(grpc.StatusCode.UNAVAILABLE, self._ended)
        try:
            while (message := await self._call.read()) is not grpc.aio.EOF:
                self._received.inc()
                self._dispatch(cast(Incoming, message))  # not EOF: a message
        except grpc.aio.AioRpcError as e:
            error = call_error(e.code(), e.details() or e.code().name)
        finally:
            self.broken = True
            STREAMS_OPEN.labels(self._peer).dec()
            waiting, self.waiting = self.waiting, {}
            if waiting:
                STREAM_BREAKS.labels(self._peer).inc()
            for waiter in waiting.values():
                self._fail(waiter, error)
            self.outgoing.close()

    async def close(self) -> None:
        self._call.cancel()
        await asyncio.gather(self._reader, return_exceptions=True)


class SharedCalls(Generic[Call]):
    """Up to ``per_peer`` shared calls to each peer (a worker's address, say), opened by
    ``start(peer)`` on first use, requests spread over them in turn. A broken call is dropped
    at the next use and closed in the background, so its replacement need not wait for it."""

    def __init__(self, start: Callable[[str], Call], per_peer: int = 1) -> None:
        self._start = start
        self._per_peer = per_peer
        self._calls: dict[str, list[Call]] = {}
        self._turn = itertools.count()
        self._closing: set[asyncio.Task[None]] = set()

    def get(self, peer: str) -> Call:
        """A call to ``peer`` to send a request on: a new one while there are fewer than
        ``per_peer`` unbroken, else the next in turn."""
        pool = self._calls.setdefault(peer, [])
        for broken in [c for c in pool if c.broken]:
            pool.remove(broken)
            task = asyncio.create_task(broken.close())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
        if len(pool) < self._per_peer:
            pool.append(self._start(peer))
            return pool[-1]
        return pool[next(self._turn) % len(pool)]

    def open(self, peer: str) -> list[Call]:
        """The calls to ``peer`` that have not broken; none is opened."""
        return [c for c in self._calls.get(peer, ()) if not c.broken]

    async def close(self) -> None:
        calls = [c for pool in self._calls.values() for c in pool]
        self._calls.clear()
        await asyncio.gather(*(c.close() for c in calls), *self._closing)


# Trailing metadata of a refusal that says when to try again (the router's fair queue):
# milliseconds, as RouteDecision.retry_after_ms.
RETRY_AFTER_MS = "retry-after-ms"


def call_error(
    code: grpc.StatusCode, details: str, retry_after_ms: int = 0
) -> grpc.aio.AioRpcError:
    """One request's end on a shared call, as the failed call of its own it stands for, so
    that callers handle both alike (``retry_after_ms``: in its trailing metadata)."""
    trailing = (
        grpc.aio.Metadata((RETRY_AFTER_MS, str(retry_after_ms)))
        if retry_after_ms
        else grpc.aio.Metadata()
    )
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailing, details)


def retry_after_ms(error: grpc.aio.AioRpcError) -> int:
    """The call's ``RETRY_AFTER_MS`` (0: none, or unreadable)."""
    for key, value in error.trailing_metadata() or ():
        if key == RETRY_AFTER_MS and isinstance(value, str) and value.isdigit():
            return int(value)
    return 0


_CODES = {code.value[0]: code for code in grpc.StatusCode}


def status_code(value: int) -> grpc.StatusCode:
    """The grpc.StatusCode of its number in a message (UNKNOWN for one grpc does not know)."""
    return _CODES.get(value, grpc.StatusCode.UNKNOWN)
