"""Stopping background tasks reliably."""

from __future__ import annotations

import asyncio

_RECANCEL_S = 0.1


async def cancel_and_wait(task: asyncio.Task[object]) -> None:
    """Cancels ``task`` and waits until it has ended, cancelling again while it runs:
    on Python 3.11 a cancellation that lands as a call's own timeout fires (a Redis
    call's socket timeout, say) can be turned into that TimeoutError and swallowed,
    leaving a loop that catches it running forever."""
    while not task.done():
        task.cancel()
        await asyncio.wait([task], timeout=_RECANCEL_S)
    if not task.cancelled() and (error := task.exception()) is not None:
        raise error
