"""Streaming a generation from the first of the routed workers that can serve it.

Shared by the router's relay (Router.Generate) and the gateway's direct calls after
Router.Route: a worker that fails before its first chunk hands the request to the next
one; a failure after tokens were sent ends the stream with a clean error, never a second
stream; an error that says the request itself is wrong ends it at once. A worker that stays
silent longer than the stall timeout (frozen, or its host gone without closing the
connection) after its first chunk fails like one that broke the connection; before the
first chunk silence is queueing or prefill, and a frozen worker is noticed by the
channel's keepalive pings (``infermesh.channels``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeAlias, TypeVar, cast

import grpc

from infermesh.pb import common_pb2

# Errors that say the request itself is wrong, or the caller's deadline passed: another
# worker would not do better. (A caller that cancels ends its own task with CancelledError;
# a CANCELLED status from a worker means the worker went away.)
CALLER_ERRORS = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.OUT_OF_RANGE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
    }
)

Worker = TypeVar("Worker")
Reply = TypeVar("Reply")
Chunks: TypeAlias = AsyncGenerator[common_pb2.GenerateResponse, None]
T = TypeVar("T")


class StreamFailedError(Exception):
    """The generation failed on every worker tried; carries the status to answer with."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


async def stream_from_first(
    workers: Sequence[Worker],
    open_stream: Callable[[Worker], Chunks],
    on_failure: Callable[[Worker, grpc.StatusCode, str, bool], None],
    worker_id: Callable[[Worker], str],
    stall_timeout_s: float | None = None,
) -> Chunks:
    """The chunks of ``open_stream(worker)`` for the first of ``workers`` that serves the
    request. ``on_failure(worker, code, details, started)`` hears of each worker that
    failed (not of requests the caller got wrong). ``stall_timeout_s``: the longest wait
    for a worker's next chunk after its first; None: no limit (a unary call, whose one
    reply comes at the end). Raises StreamFailedError."""
    failures: list[tuple[str, grpc.StatusCode, str]] = []
    for worker in workers:
        started = finished = False
        try:
            async with contextlib.aclosing(open_stream(worker)) as chunks:
                while (
                    chunk := await _next_chunk(chunks, stall_timeout_s if started else None)
                ) is not None:
                    started = True
                    finished = chunk.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
                    yield chunk
            if finished:
                return
            code, details = grpc.StatusCode.UNAVAILABLE, "the worker ended its stream unfinished"
        except TimeoutError:
            assert stall_timeout_s is not None  # the only wait that is timed
            code, details = grpc.StatusCode.UNAVAILABLE, stall_details(stall_timeout_s)
        except grpc.aio.AioRpcError as e:
            code, details = e.code(), e.details() or e.code().name
            if code == grpc.StatusCode.CANCELLED:  # the worker's side: it went away
                code = grpc.StatusCode.UNAVAILABLE
        if code in CALLER_ERRORS:
            raise StreamFailedError(code, details)
        on_failure(worker, code, details, started)
        if started:
            raise StreamFailedError(
                code, f"worker {worker_id(worker)} failed mid-stream: {details}"
            )
        failures.append((worker_id(worker), code, details))
    raise StreamFailedError(*_give_up_status(failures))


def stall_details(stall_timeout_s: float) -> str:
    """What a stalled worker's failure says."""
    return f"the worker sent nothing for {stall_timeout_s:g} s (stalled)"


async def _next_chunk(
    chunks: AsyncIterator[common_pb2.GenerateResponse], timeout_s: float | None
) -> common_pb2.GenerateResponse | None:
    """The stream's next chunk, None at its end; TimeoutError past ``timeout_s``. Only the
    wait for the worker is timed, never the caller's handling of a chunk."""
    if timeout_s is None:
        return await anext(chunks, None)
    async with asyncio.timeout(timeout_s):
        return await anext(chunks, None)


def _give_up_status(
    failures: list[tuple[str, grpc.StatusCode, str]],
) -> tuple[grpc.StatusCode, str]:
    summary = "; ".join(f"worker {w}: {code.name} {details}" for w, code, details in failures)
    if failures and all(code == grpc.StatusCode.RESOURCE_EXHAUSTED for _, code, _ in failures):
        return (
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"no worker has capacity now; retry later ({summary})",
        )
    return grpc.StatusCode.UNAVAILABLE, f"no worker could serve the request ({summary})"


async def call_chunks(
    call: grpc.aio.UnaryStreamCall[Any, Reply] | grpc.aio.UnaryUnaryCall[Any, Reply], stream: bool
) -> AsyncGenerator[Reply, None]:
    """The chunks of a Generate call (``stream``) or the one reply of a Complete call, for
    stream_from_first; closing the iterator cancels the call if it still runs."""
    try:
        if not stream:
            yield await _uncancelled(call, cast(grpc.aio.UnaryUnaryCall[Any, Reply], call))
            return
        reads = cast(grpc.aio.UnaryStreamCall[Any, Reply], call)
        while (chunk := await _uncancelled(call, reads.read())) is not grpc.aio.EOF:
            yield cast(Reply, chunk)  # read() is typed as a reply or EOF, which ended the loop
    finally:
        call.cancel()


async def _uncancelled(call: grpc.aio.Call, read: Awaitable[T]) -> T:
    """``read`` of ``call``, never abandoned while in flight: a caller cancelled meanwhile
    cancels the call, waits for the read to end, then goes on cancelled. grpc.aio (1.85)
    keeps a few hundred bytes of native memory for every read whose awaiting task was
    cancelled before it completed (docs/RELIABILITY.md, "Soak"), as each client dropping a
    stream did to the gateway."""
    pending = asyncio.ensure_future(read)
    try:
        return await asyncio.shield(pending)
    except asyncio.CancelledError:
        call.cancel()
        await asyncio.gather(pending, return_exceptions=True)
        raise
