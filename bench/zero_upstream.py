"""A zero-latency OpenAI-compatible upstream, the reference that bench/gateway_mesh.py puts
LiteLLM's proxy in front of (and loads directly, as the ``upstream`` path).

    .venv/bin/python bench/zero_upstream.py --port 8100

Chat completions only. As an engine does, one step loop emits one token to every running
sequence per step (a step costs nothing: the loop only yields to the event loop between
steps), and a streamed answer is one SSE event per token. Every answer is ``max_tokens``
tokens long.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import AsyncIterator

import uvloop
from aiohttp import web

_WORD = " tok"


class StepLoop:
    """Every running sequence's queue gets one token per step."""

    def __init__(self) -> None:
        self._running: dict[asyncio.Queue[int], int] = {}  # queue -> tokens still to emit
        self._wake = asyncio.Event()

    def start(self, tokens: int) -> asyncio.Queue[int]:
        queue: asyncio.Queue[int] = asyncio.Queue()
        self._running[queue] = tokens
        self._wake.set()
        return queue

    def stop(self, queue: asyncio.Queue[int]) -> None:
        self._running.pop(queue, None)

    async def run(self) -> None:
        while True:
            if not self._running:
                self._wake.clear()
                await self._wake.wait()
            for queue, left in list(self._running.items()):
                queue.put_nowait(left - 1)  # tokens left after this one
                if left == 1:
                    del self._running[queue]
                else:
                    self._running[queue] = left - 1
            await asyncio.sleep(0)


async def _chat(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    steps: StepLoop = request.app[STEPS]
    max_tokens = int(body.get("max_tokens") or 16)
    prompt_tokens = sum(len(str(m.get("content", "")).split()) for m in body["messages"])
    created, ident, model = int(time.time()), "chatcmpl-zero", body["model"]
    usage = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": max_tokens,
        "total_tokens": prompt_tokens + max_tokens,
    }
    queue = steps.start(max_tokens)
    try:
        if not body.get("stream"):
            while await queue.get():
                pass
            return web.json_response(
                {
                    "id": ident,
                    "object": "chat.completion",
                    "created": created,
                    "model": model,
                    "choices": [
                        {
                            "index": 0,
                            "finish_reason": "length",
                            "message": {"role": "assistant", "content": _WORD * max_tokens},
                        }
                    ],
                    "usage": usage,
                }
            )
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        frame = {"id": ident, "object": "chat.completion.chunk", "created": created, "model": model}
        while True:
            left = await queue.get()
            choice = {
                "index": 0,
                "delta": {"content": _WORD},
                "finish_reason": None if left else "length",
            }
            await response.write(
                b"data: " + json.dumps({**frame, "choices": [choice]}).encode() + b"\n\n"
            )
            if not left:
                break
        if (body.get("stream_options") or {}).get("include_usage"):
            await response.write(
                b"data: " + json.dumps({**frame, "choices": [], "usage": usage}).encode() + b"\n\n"
            )
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response
    finally:
        steps.stop(queue)


async def _models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": "zero", "object": "model"}]})


STEPS = web.AppKey("steps", StepLoop)


async def _step_loop(app: web.Application) -> AsyncIterator[None]:
    app[STEPS] = StepLoop()
    task = asyncio.create_task(app[STEPS].run())
    yield
    task.cancel()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    app = web.Application()
    app.cleanup_ctx.append(_step_loop)
    app.router.add_post("/v1/chat/completions", _chat)
    app.router.add_get("/v1/models", _models)
    uvloop.install()
    web.run_app(app, host="127.0.0.1", port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
