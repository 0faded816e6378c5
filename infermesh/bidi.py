"""The sending side of a long-lived bidirectional gRPC call that many requests share."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import grpc
from google.protobuf.message import Message as ProtoMessage

from telemetry.metrics import STREAM_MESSAGES

Message = TypeVar("Message", bound=ProtoMessage)

# gRPC's default limit on a received message (4 MiB), less room for framing: what one message
# of a shared stream may hold. A message past the limit would end the whole stream, and with it
# every request on it.
MAX_MESSAGE_BYTES = 4 * 1024 * 1024 - 64 * 1024


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
    ``message`` and call ``changed()``; one task writes it whenever the call can take the next
    one, so a burst of requests costs one message, not one each (several when they would pass
    gRPC's message size limit). Ends quietly when the call does (its reader sees why). Each
    message sent counts in ``infermesh_gateway_stream_messages`` under ``peer``."""

    def __init__(self, call: Any, new_message: Callable[[], Message], peer: str) -> None:
        self._call = call
        self._new_message = new_message
        self._sent = STREAM_MESSAGES.labels(peer, "sent")
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
                for part in split(message):
                    await self._call.write(part)
                    self._sent.inc()
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
