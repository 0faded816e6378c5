"""Batches through the official openai SDK, as the tests and bench/batches.py submit them: chat
lines, the JSONL file, its upload and the batch, the wait for its end, its output files."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from typing import Any, Final

import openai
from openai.types import Batch

from tests.helpers import MODEL

CHAT_URL: Final = "/v1/chat/completions"
_ENDED = ("completed", "failed", "expired", "cancelled")


def chat_line(custom_id: str, url: str = CHAT_URL, **body: Any) -> dict[str, Any]:
    """A batch line asking a short chat completion (``body`` overrides its fields)."""
    ask = {"model": MODEL, "messages": [{"role": "user", "content": custom_id}], "max_tokens": 4}
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": {**ask, **body}}


def jsonl(lines: Sequence[object]) -> bytes:
    """The lines as a JSONL file (a line given as bytes is written as it is)."""
    return b"".join(
        (line if isinstance(line, bytes) else json.dumps(line).encode()) + b"\n" for line in lines
    )


async def upload_lines(client: openai.AsyncOpenAI, lines: Sequence[object]) -> str:
    """The id of the uploaded file of ``lines``."""
    return (await client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")).id


async def submit(client: openai.AsyncOpenAI, lines: Sequence[object]) -> Batch:
    """A chat-completions batch of ``lines``, as created."""
    return await client.batches.create(
        input_file_id=await upload_lines(client, lines), endpoint=CHAT_URL, completion_window="24h"
    )


async def batch_ended(client: openai.AsyncOpenAI, batch_id: str, timeout_s: float = 20.0) -> Batch:
    """The batch once it has ended."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        batch = await client.batches.retrieve(batch_id)
        if batch.status in _ENDED:
            return batch
        assert asyncio.get_running_loop().time() < deadline, f"batch still {batch.status}"
        await asyncio.sleep(0.05)


async def jsonl_of(client: openai.AsyncOpenAI, file_id: str) -> list[dict[str, Any]]:
    """A file's JSON lines."""
    content = await client.files.content(file_id)
    return [json.loads(line) for line in content.content.splitlines()]
