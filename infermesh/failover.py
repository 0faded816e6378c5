"""Which of a request's routed workers serves it: the failover rules of every generation
through the mesh (``infermesh.mesh_call``, the gateway's requests and the router's internal
callers alike), both reading the workers over ``Worker.Serve`` (``infermesh.serve_client``).

A worker that fails before its first chunk hands the request to the next one; a failure after
tokens were sent ends the stream with a clean error carrying the worker's own status, never a
second stream; an error that says the request itself is wrong ends it at once. A worker that
stays silent longer than the stall timeout after its first chunk (frozen, or its host gone
without closing the connection) fails like one that broke the connection (the Serve client
times it where chunks arrive); before the first chunk silence is queueing or prefill, and a
frozen worker is noticed by the channel's keepalive pings (``infermesh.channels``).
"""

from __future__ import annotations

import grpc

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


class StreamFailedError(Exception):
    """The generation failed on every worker tried; carries the status to answer with."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


def worker_failure(error: grpc.aio.AioRpcError | None) -> tuple[grpc.StatusCode, str]:
    """A worker's failure as a status: ``error``'s, or (None) a stream it ended unfinished;
    CANCELLED from a worker's side means it went away."""
    if error is None:
        return grpc.StatusCode.UNAVAILABLE, "the worker ended its stream unfinished"
    code, details = error.code(), error.details() or error.code().name
    if code == grpc.StatusCode.CANCELLED:
        code = grpc.StatusCode.UNAVAILABLE
    return code, details


class Failover:
    """The failures of one request's workers, tried in order."""

    __slots__ = ("_failures",)

    def __init__(self) -> None:
        self._failures: list[tuple[str, grpc.StatusCode, str]] = []

    @staticmethod
    def check_callers(code: grpc.StatusCode, details: str) -> None:
        """Raises StreamFailedError when the failure is the request's own: no worker is to
        hear of it, and no other is tried."""
        if code in CALLER_ERRORS:
            raise StreamFailedError(code, details)

    def failed(self, worker_id: str, code: grpc.StatusCode, details: str, started: bool) -> None:
        """Records the worker's failure (after ``check_callers``); raises StreamFailedError
        when it sent chunks already (the worker's own status, its message naming the worker),
        else returns: the next worker may take the request."""
        if started:
            raise StreamFailedError(code, f"worker {worker_id} failed mid-stream: {details}")
        self._failures.append((worker_id, code, details))

    def given_up(self) -> StreamFailedError:
        """The error once no worker served the request: RESOURCE_EXHAUSTED when each was
        busy, else UNAVAILABLE, naming each worker's failure."""
        return StreamFailedError(*_give_up_status(self._failures))


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
