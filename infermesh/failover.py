"""Streaming a generation from the first of the routed workers that can serve it.

Shared by the gateway and the router's relay (Router.Generate / Complete for internal
callers), both reading the workers over ``Worker.Serve`` (``infermesh.serve_client``): a
worker that fails before its first chunk hands the request to the next one; a failure after
tokens were sent ends the stream with a clean error carrying the worker's own status, never a
second stream; an error that says the request itself is wrong ends it at once. A worker that
stays silent longer than the stall timeout after its first chunk (frozen, or its host gone
without closing the connection) fails like one that broke the connection (the Serve client
times it where chunks arrive); before the first chunk silence is queueing or prefill, and a
frozen worker is noticed by the channel's keepalive pings (``infermesh.channels``).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import TypeAlias, TypeVar

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
Chunks: TypeAlias = AsyncGenerator[common_pb2.GenerateResponse, None]


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
) -> Chunks:
    """The chunks of ``open_stream(worker)`` for the first of ``workers`` that serves the
    request. ``on_failure(worker, code, details, started)`` hears of each worker that
    failed (not of requests the caller got wrong). A worker's failure after its first chunk
    ends the stream with the worker's own status, its message naming the worker. Raises
    StreamFailedError."""
    failures: list[tuple[str, grpc.StatusCode, str]] = []
    for worker in workers:
        started = finished = False
        try:
            async with contextlib.aclosing(open_stream(worker)) as chunks:
                async for chunk in chunks:
                    started = True
                    finished = chunk.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
                    yield chunk
            if finished:
                return
            code, details = grpc.StatusCode.UNAVAILABLE, "the worker ended its stream unfinished"
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
