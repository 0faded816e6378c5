"""The sending side of a long-lived bidirectional gRPC call that many requests share."""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import grpc

Message = TypeVar("Message")


class MessageBatcher(Generic[Message]):
    """Gathers what requests add between two writes into one message: callers add to
    ``message`` and call ``changed()``; one task writes it whenever the call can take the next
    one, so a burst of requests costs one message, not one each. Ends quietly when the call
    does (its reader sees why)."""

    def __init__(self, call: Any, new_message: Callable[[], Message]) -> None:
        self._call = call
        self._new_message = new_message
        self.message = new_message()
        self._send = asyncio.Event()
        self._task = asyncio.create_task(self._write())

    def changed(self) -> None:
        self._send.set()

    async def _write(self) -> None:
        try:
            while True:
                await self._send.wait()
                self._send.clear()
                message, self.message = self.message, self._new_message()
                await self._call.write(message)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            pass

    async def close(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


def call_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    """One request's end on a shared call, as the failed call of its own it stands for, so
    that callers handle both alike."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


_CODES = {code.value[0]: code for code in grpc.StatusCode}


def status_code(value: int) -> grpc.StatusCode:
    """The grpc.StatusCode of its number in a message (UNKNOWN for one grpc does not know)."""
    return _CODES.get(value, grpc.StatusCode.UNKNOWN)
