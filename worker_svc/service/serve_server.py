"""Worker.Serve: many generations over one long-lived bidirectional stream.

The caller opens requests by a stream-local id and cancels them by id; each open request
runs as a task of its own, its chunks collected in one outbox per stream. The outbox is
written as one message whenever the stream can take one, so the chunks of one engine step
for all of the stream's requests leave together (several steps' when the caller reads
slower than the engine steps, a request's chunks still one per step). The outbox is
bounded: past it a request waits to add its chunk, and the engine merges what queued up
for it meanwhile, so a stalled reader costs memory for at most the bound.

Each request is a span of its own in the trace it came with (its open's trace context),
linked to the stream's span, not one span per message.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any, Protocol

import grpc
from google.protobuf.message import DecodeError
from opentelemetry import propagate, trace

from infermesh.pb import common_pb2, worker_pb2
from worker_svc.engine.api import EngineClosedError, GenerationChunk, merge_chunks
from worker_svc.service.wire import RequestFailedError, to_proto

logger = logging.getLogger(__name__)

# Chunks waiting in a stream's outbox before its requests wait for room.
OUTBOX_CHUNKS = 4096

_tracer = trace.get_tracer(__name__)


class ChunkSource(Protocol):
    """Where a stream's requests are served: the worker's servicer, as its unary calls are."""

    def chunks(
        self, request: common_pb2.GenerateRequest, pull: common_pb2.KVPull | None = None
    ) -> AsyncGenerator[GenerationChunk, None]:
        """The engine's chunks for ``request`` (its prompt's blocks ``pull`` names taken from
        their peer first); a request the worker cannot serve raises RequestFailedError with
        its status."""
        ...


class _Outbox:
    """The chunks of a stream's requests waiting to be written, in order; bounded."""

    def __init__(self, limit: int) -> None:
        self._chunks: list[worker_pb2.StreamChunk] = []
        self._limit = limit
        self._ready = asyncio.Event()
        self._room = asyncio.Event()
        self._room.set()

    async def put(self, chunk: worker_pb2.StreamChunk) -> None:
        while len(self._chunks) >= self._limit:
            self._room.clear()
            await self._room.wait()
        self._chunks.append(chunk)
        self._ready.set()

    def put_nowait(self, chunk: worker_pb2.StreamChunk) -> None:
        """For a request's last word (its error), which must not wait."""
        self._chunks.append(chunk)
        self._ready.set()

    async def take(self) -> list[worker_pb2.StreamChunk]:
        await self._ready.wait()
        chunks, self._chunks = self._chunks, []
        self._ready.clear()
        self._room.set()
        return chunks

    def wake(self) -> None:
        """Lets a ``take`` return (with nothing) so its caller can look whether to end."""
        self._ready.set()


class StreamSession:
    """One Serve call: reads opens and cancels, runs the requests, yields the outbox."""

    def __init__(
        self,
        servicer: ChunkSource,
        requests: AsyncIterator[bytes],
        outbox_chunks: int = OUTBOX_CHUNKS,
    ) -> None:
        self._servicer = servicer
        self._requests = requests
        self._outbox = _Outbox(outbox_chunks)
        self._running: dict[int, asyncio.Task[None]] = {}
        self._reading = True
        self._stream_span = trace.get_current_span().get_span_context()

    async def responses(self) -> AsyncGenerator[worker_pb2.StreamResponse, None]:
        """The stream's messages until the caller has closed its side and every request
        ended; closing this iterator cancels the requests still running."""
        reader = asyncio.create_task(self._read())
        try:
            while self._reading or self._running:
                chunks = await self._outbox.take()
                if chunks:
                    yield worker_pb2.StreamResponse(chunks=chunks)
            await reader  # raises what ended the reading, if it failed
        finally:
            reader.cancel()
            tasks = list(self._running.values())
            for task in tasks:
                task.cancel()
            await asyncio.gather(reader, *tasks, return_exceptions=True)

    async def _read(self) -> None:
        try:
            async for data in self._requests:
                message = worker_pb2.StreamRequest.FromString(data)
                for request_id in message.cancel:
                    task = self._running.get(request_id)
                    if task is not None:
                        task.cancel()
                for opened in message.open:
                    if opened.id in self._running:
                        self._outbox.put_nowait(
                            _failure(
                                opened.id,
                                grpc.StatusCode.INVALID_ARGUMENT,
                                f"request id {opened.id} is already open on this stream",
                            )
                        )
                        continue
                    self._running[opened.id] = asyncio.create_task(self._serve(opened))
        finally:
            self._reading = False
            self._outbox.wake()

    async def _serve(self, opened: worker_pb2.OpenRequest) -> None:
        parent = propagate.extract(dict(opened.trace_context))
        links = [trace.Link(self._stream_span)] if self._stream_span.is_valid else []
        try:
            with _tracer.start_as_current_span(
                "infermesh.v1.Worker/Serve request",
                context=parent,
                kind=trace.SpanKind.SERVER,
                links=links,
            ):
                async with asyncio.timeout(opened.timeout_ms / 1000 if opened.timeout_ms else None):
                    await self._generate(opened)
        except RequestFailedError as e:
            self._outbox.put_nowait(_failure(opened.id, e.code, e.details))
        except TimeoutError:
            self._outbox.put_nowait(
                _failure(
                    opened.id, grpc.StatusCode.DEADLINE_EXCEEDED, "the request's deadline passed"
                )
            )
        except EngineClosedError as e:
            self._outbox.put_nowait(_failure(opened.id, grpc.StatusCode.UNAVAILABLE, str(e)))
        except Exception as e:  # an engine's bug: that request fails, the stream goes on
            logger.exception("request %d failed", opened.id)
            self._outbox.put_nowait(
                _failure(opened.id, grpc.StatusCode.INTERNAL, f"the worker failed: {e!r}")
            )
        finally:
            del self._running[opened.id]
            self._outbox.wake()

    async def _generate(self, opened: worker_pb2.OpenRequest) -> None:
        pull = opened.pull if opened.HasField("pull") else None
        async with contextlib.aclosing(self._servicer.chunks(opened.request, pull)) as chunks:
            if opened.whole:
                whole = merge_chunks([chunk async for chunk in chunks])
                await self._outbox.put(worker_pb2.StreamChunk(id=opened.id, chunk=to_proto(whole)))
                return
            async for chunk in chunks:
                await self._outbox.put(worker_pb2.StreamChunk(id=opened.id, chunk=to_proto(chunk)))


def _failure(request_id: int, code: grpc.StatusCode, details: str) -> worker_pb2.StreamChunk:
    return worker_pb2.StreamChunk(id=request_id, code=code.value[0], details=details)


def serve_handler(servicer: ChunkSource) -> grpc.RpcMethodHandler[Any, Any]:
    """The Serve method's handler; it parses the caller's messages itself, so that one that
    does not parse ends the stream with INVALID_ARGUMENT rather than grpc's UNKNOWN."""

    async def serve(
        requests: AsyncIterator[bytes],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[worker_pb2.StreamResponse]:
        session = StreamSession(servicer, requests)
        try:
            async with contextlib.aclosing(session.responses()) as responses:
                async for response in responses:
                    yield response
        except DecodeError as e:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"malformed StreamRequest ({e}); strings must be UTF-8",
            )

    return grpc.stream_stream_rpc_method_handler(
        serve, response_serializer=worker_pb2.StreamResponse.SerializeToString
    )
