"""Raw HTTP/1.1 exchanges over a socket, for the tests and bench scripts that send what no
HTTP client library would (malformed requests, bytes trickled one at a time)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any


@dataclasses.dataclass(frozen=True)
class RawResponse:
    status: int
    headers: dict[str, str]  # names lowercased; the last of repeated ones
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


async def read_response(reader: asyncio.StreamReader) -> RawResponse:
    """One response with a Content-Length body (or a body up to EOF without one)."""
    head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
    status = int(head[0].split(" ")[1])
    headers = {}
    for line in head[1:]:
        name, _, value = line.partition(":")
        if name:
            headers[name.strip().lower()] = value.strip()
    length = headers.get("content-length")
    body = await (reader.readexactly(int(length)) if length is not None else reader.read())
    return RawResponse(status, headers, body)


async def exchange(
    port: int, data: bytes, *, timeout_s: float = 10.0, host: str = "127.0.0.1"
) -> RawResponse:
    """Sends ``data`` and reads one response."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(data)
        await writer.drain()
        return await asyncio.wait_for(read_response(reader), timeout_s)
    finally:
        writer.close()


def request(
    method: str,
    path: str,
    headers: list[tuple[str, str]] | None = None,
    body: bytes = b"",
    *,
    host: str = "127.0.0.1",
) -> bytes:
    """A request's bytes, Connection: close; a Content-Length when there is a body and
    ``headers`` names none."""
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}", "Connection: close"]
    names = {name.lower() for name, _ in headers or []}
    if body and "content-length" not in names and "transfer-encoding" not in names:
        lines.append(f"Content-Length: {len(body)}")
    lines += [f"{name}: {value}" for name, value in headers or []]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("utf-8", "surrogateescape") + body
