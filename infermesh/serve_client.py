"""The client of ``Worker.Serve``, the one way a generation reaches a worker (every mesh
call's, ``infermesh.mesh_call``: the gateway's requests and the router's internal callers'):
many requests multiplexed over a few long-lived bidirectional streams per worker, so that a
request costs messages, not calls.

A request is opened on a stream by a stream-local id (its open carries the generation request,
its deadline and trace context) and cancelled by that id when its reader stops early. One reader
task per stream hands each chunk to its request's buffer; what requests opened and cancelled
meanwhile goes out as one message whenever the stream can take the next (the shared-call client
of ``infermesh.bidi``). Per-request flow control: a request's buffer holds at most
``buffered_chunks`` chunks its reader has not taken; past that (a client reading slower
than the worker writes) that request ends with ``ReaderTooSlowError`` and is cancelled on the
worker, while the stream and its other requests go on. A stream that breaks fails every request
still open on it with the stream's status, as a failed call would (``infermesh.failover`` then
tries the fallback worker before the first chunk, and ends the request cleanly after it).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
from collections.abc import AsyncGenerator

import grpc
from opentelemetry import propagate

import telemetry
from infermesh.bidi import SharedCall, SharedCalls, call_error, check_size, status_code
from infermesh.channels import WorkerChannels
from infermesh.failover import stall_details
from infermesh.pb import common_pb2, worker_pb2, worker_pb2_grpc
from telemetry.metrics import SLOW_CLIENTS, STREAM_REQUESTS_OPEN

_PEER = "worker"


# A request's chunks its reader has not taken yet, at most, by default.
BUFFERED_CHUNKS = 4096


class ReaderTooSlowError(Exception):
    """A request's reader took its chunks so slowly that the request's buffer overflowed."""


class _Request:
    """One request's chunks as they arrive, until its last chunk or its error.

    Stalls are timed here, where chunks arrive, rather than around each read of the reader:
    a worker silent for ``stall_s`` after its first chunk fails the request, however fast
    or slow its client reads; one timer per stall period, not one per chunk."""

    __slots__ = (
        "_chunks",
        "_error",
        "_last_arrival",
        "_limit",
        "_loop",
        "_stall_s",
        "_timer",
        "_waiter",
        "finished",
        "id",
    )

    def __init__(self, request_id: int, limit: int, stall_s: float | None) -> None:
        self.id = request_id
        self._chunks: collections.deque[common_pb2.GenerateResponse] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None
        self._error: BaseException | None = None
        self._limit = limit
        self._loop = asyncio.get_running_loop()
        self._stall_s = stall_s
        self._last_arrival = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self.finished = False  # its last chunk or error arrived: nothing to cancel

    def push(self, chunk: common_pb2.GenerateResponse) -> bool:
        """Buffers ``chunk``; False when the buffer overflowed (the request then failed)."""
        if len(self._chunks) >= self._limit:
            self.fail(
                ReaderTooSlowError(
                    f"The client read the stream too slowly: more than {self._limit} chunks waited "
                    "for it, so the request was ended"
                )
            )
            return False
        self._chunks.append(chunk)
        if chunk.finish_reason:
            self.finished = True
            self.stop_timer()
        elif self._stall_s is not None:
            self._last_arrival = self._loop.time()
            if self._timer is None:
                self._timer = self._loop.call_at(self._last_arrival + self._stall_s, self._check)
        self._wake()
        return True

    def _check(self) -> None:
        """The stall timer: re-armed while chunks keep coming, else the request fails."""
        assert self._stall_s is not None  # armed only with a stall timeout
        due = self._last_arrival + self._stall_s
        if self._loop.time() < due:
            self._timer = self._loop.call_at(due, self._check)
            return
        self._timer = None
        self.fail(call_error(grpc.StatusCode.UNAVAILABLE, stall_details(self._stall_s)))

    def stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def fail(self, error: BaseException) -> None:
        self._error = error
        self.stop_timer()
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def next(self) -> common_pb2.GenerateResponse | None:
        """The next chunk; None after the last; raises the request's error."""
        while not self._chunks:
            if self._error is not None:
                raise self._error
            if self.finished:
                return None
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        return self._chunks.popleft()


class _ServeCall(SharedCall[worker_pb2.StreamRequest, worker_pb2.StreamResponse, _Request]):
    """One ``Worker.Serve`` call; its waiting requests buffer their chunks."""

    def __init__(self, stub: worker_pb2_grpc.WorkerStub, buffered_chunks: int) -> None:
        self._buffered_chunks = buffered_chunks
        self._ids = itertools.count(1)
        super().__init__(
            lambda messages: stub.Serve(messages, wait_for_ready=False),
            worker_pb2.StreamRequest,
            _PEER,
            "the worker ended the stream",
        )

    def open(
        self,
        request: common_pb2.GenerateRequest,
        *,
        whole: bool,
        timeout_s: float | None,
        stall_s: float | None,
        pull: common_pb2.KVPull | None,
    ) -> _Request:
        if self.broken:
            raise call_error(grpc.StatusCode.UNAVAILABLE, "the worker's stream is closed")
        check_size(request)
        opened = _Request(next(self._ids), self._buffered_chunks, stall_s)
        self.waiting[opened.id] = opened
        STREAM_REQUESTS_OPEN.inc()
        # timeout_ms 0: no deadline
        timeout_ms = 0 if timeout_s is None else max(1, round(timeout_s * 1000))
        message = self.outgoing.message.open.add(
            id=opened.id, request=request, whole=whole, timeout_ms=timeout_ms, pull=pull
        )
        if telemetry.tracing_enabled():
            propagate.inject(message.trace_context)
        self.outgoing.changed()
        return opened

    def cancel(self, opened: _Request) -> None:
        if self._forget(opened.id) is not None and not self.broken:
            self.outgoing.message.cancel.append(opened.id)
            self.outgoing.changed()

    def _forget(self, request_id: int) -> _Request | None:
        opened = self.waiting.pop(request_id, None)
        if opened is not None:
            STREAM_REQUESTS_OPEN.dec()
        return opened

    def _dispatch(self, message: worker_pb2.StreamResponse) -> None:
        for entry in message.chunks:
            opened = self.waiting.get(entry.id)
            if opened is None:  # cancelled meanwhile
                continue
            if entry.code:
                self._forget(entry.id)
                opened.finished = True
                opened.fail(call_error(status_code(entry.code), entry.details))
            elif not opened.push(entry.chunk):
                SLOW_CLIENTS.inc()
                self.cancel(opened)
            elif opened.finished:
                self._forget(entry.id)

    def _fail(self, waiter: _Request, error: grpc.aio.AioRpcError) -> None:
        STREAM_REQUESTS_OPEN.dec()
        waiter.fail(error)


class OpenedRequest:
    """One request open on a Serve stream: ``next()`` is its next chunk (None after the last;
    it raises the request's error), ``close`` ends it (on the worker too, unless its last
    chunk came)."""

    __slots__ = ("_expiry", "_opened", "_stream", "next")

    def __init__(self, stream: _ServeCall, opened: _Request, timeout_s: float | None) -> None:
        self._stream = stream
        self._opened = opened
        self.next = opened.next  # the buffer's own reader: no frame between it and the caller
        self._expiry = (
            None
            if timeout_s is None
            else asyncio.get_running_loop().call_later(
                timeout_s,
                opened.fail,
                call_error(grpc.StatusCode.DEADLINE_EXCEEDED, "the request's deadline passed"),
            )
        )

    async def chunks(self) -> AsyncGenerator[common_pb2.GenerateResponse, None]:
        """The chunks as an iterator, closed with it (early: the request is cancelled on the
        worker)."""
        try:
            while (chunk := await self.next()) is not None:
                yield chunk
        finally:
            self.close()

    def close(self) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
        self._opened.stop_timer()
        if not self._opened.finished:
            self._stream.cancel(self._opened)


class ServeClient:
    """Up to ``per_worker`` streams per worker address, opened on first use and replaced
    when broken, requests spread over them in turn; safe to share across requests."""

    def __init__(
        self,
        channels: WorkerChannels,
        *,
        per_worker: int = 1,
        buffered_chunks: int = BUFFERED_CHUNKS,
    ) -> None:
        self._streams: SharedCalls[_ServeCall] = SharedCalls(
            lambda address: _ServeCall(channels.stub(address), buffered_chunks), per_worker
        )

    def open(
        self,
        address: str,
        request: common_pb2.GenerateRequest,
        *,
        whole: bool,
        timeout_s: float | None,
        stall_s: float | None = None,
        pull: common_pb2.KVPull | None = None,
    ) -> OpenedRequest:
        """Opens the request on a stream to the worker at ``address`` (``whole``: only the
        last chunk, the whole completion; ``pull``: the prompt's blocks it is to take from a
        peer first); read it with ``next`` and ``close`` it however it ends, or read its
        ``chunks``. It fails as a
        call of its own would: ``grpc.aio.AioRpcError`` with the worker's status,
        DEADLINE_EXCEEDED after ``timeout_s`` (None: no deadline), UNAVAILABLE when the worker
        sends nothing for ``stall_s`` after its first chunk (None: no limit);
        ``ReaderTooSlowError`` past the buffer."""
        stream = self._streams.get(address)
        opened = stream.open(request, whole=whole, timeout_s=timeout_s, stall_s=stall_s, pull=pull)
        return OpenedRequest(stream, opened, timeout_s)

    def streams(self, address: str) -> int:
        """How many streams to the worker at ``address`` are open."""
        return len(self._streams.open(address))

    async def close(self) -> None:
        await self._streams.close()
