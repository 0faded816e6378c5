"""The engines' shared surface: the request front every engine puts a request through, and how
their chunks reach the gRPC server (drained in order, merged when they queued up)."""

from __future__ import annotations

import asyncio

import pytest

from worker_svc.engine.api import (
    EngineClosedError,
    EngineOverloadedError,
    GenerationChunk,
    GenerationRequest,
    InvalidArgumentError,
    SamplingParams,
    TokenLogprob,
    drain_chunks,
)
from worker_svc.engine.request_front import RequestFront


def _chunk(token: int, finish: str | None = None) -> GenerationChunk:
    return GenerationChunk(
        text=f"<{token}>",
        token_ids=[token],
        finish_reason=finish,  # type: ignore[arg-type]
        prompt_tokens=5,
        completion_tokens=token,
        queue_s=token / 10,
        logprobs=[TokenLogprob(token=f"<{token}>", logprob=-token)],
    )


async def test_chunks_queued_while_the_reader_was_busy_come_out_merged():
    queue: asyncio.Queue = asyncio.Queue()
    aborted = []
    chunks = drain_chunks(queue, lambda: aborted.append(True))
    queue.put_nowait(_chunk(1))
    first = await anext(chunks)
    assert first.token_ids == [1]  # a reader that keeps up gets every chunk as it comes
    for token in (2, 3):
        queue.put_nowait(_chunk(token))
    queue.put_nowait(_chunk(4, "length"))
    queue.put_nowait(_chunk(99))  # after the last chunk: never read
    merged = await anext(chunks)
    assert (merged.text, merged.token_ids, merged.finish_reason) == (
        "<2><3><4>",
        [2, 3, 4],
        "length",
    )
    assert (merged.completion_tokens, merged.queue_s) == (4, 0.2)
    assert [lp.logprob for lp in merged.logprobs] == [-2, -3, -4]
    with pytest.raises(StopAsyncIteration):
        await anext(chunks)
    assert not aborted


async def test_an_error_after_queued_chunks_comes_after_them():
    queue: asyncio.Queue = asyncio.Queue()
    aborted = []
    for item in (_chunk(1), _chunk(2), EngineClosedError("closed")):
        queue.put_nowait(item)
    seen = []
    with pytest.raises(EngineClosedError):
        async for chunk in drain_chunks(queue, lambda: aborted.append(True)):
            seen.append(chunk.token_ids)
    assert seen == [[1, 2]] and not aborted


async def test_a_reader_that_stops_early_aborts_the_generation():
    queue: asyncio.Queue = asyncio.Queue()
    aborted = []
    queue.put_nowait(_chunk(1))
    chunks = drain_chunks(queue, lambda: aborted.append(True))
    await anext(chunks)
    await chunks.aclose()
    assert aborted == [True]


def test_the_front_refuses_in_one_order_and_one_wording():
    front = RequestFront(vocab_size=32, max_model_len=64, max_parallel=1, max_waiting=1)
    good = GenerationRequest("r", None, "hi", SamplingParams())
    front.check(good)
    with pytest.raises(InvalidArgumentError, match="temperature must be >= 0"):
        front.check(GenerationRequest("r", None, "hi", SamplingParams(temperature=-1)))
    assert front.budget(10, None) == 54 and front.budget(10, 4) == 4
    with pytest.raises(InvalidArgumentError, match=r"10 \+ 60 > 64, decrease"):
        front.budget(10, 60)
    with front.admitted(), front.admitted():  # one running, one waiting
        assert front.live == 2
        with (
            pytest.raises(
                EngineOverloadedError,
                match=r"^the worker is full: 2 requests for 1 places \(max_parallel\) "
                r"and max_waiting 1; retry later$",
            ),
            front.admitted(),
        ):
            pass
        assert front.live == 2
    assert front.live == 0  # each request leaves, however it ends
    assert front.peak_live == 2  # the refused one never counted
    front.close()
    with pytest.raises(EngineClosedError, match=r"^the engine is closed$"):
        front.check(good)  # closed is said before anything else
