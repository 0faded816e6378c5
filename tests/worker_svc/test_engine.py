"""The async engine on the tiny checkpoint: sampling, finishing, concurrency, cancellation, errors."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from worker_svc.engine import Engine, GenerationChunk, GenerationRequest, InvalidRequestError, SamplingParams

_MESSAGES = [{"role": "user", "content": "Hello, how are you?"}]


@pytest.fixture
async def engine(tiny_dir: Path) -> AsyncIterator[Engine]:
    engine = Engine.from_checkpoint(tiny_dir)
    yield engine
    await engine.close()


def _request(sampling: SamplingParams, *, prompt: str | None = None, request_id: str = "r") -> GenerationRequest:
    return GenerationRequest(request_id, None if prompt else _MESSAGES, prompt, sampling)


async def _run(engine: Engine, request: GenerationRequest) -> list[GenerationChunk]:
    return [chunk async for chunk in engine.generate(request)]


def _ids(chunks: list[GenerationChunk]) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


def _text(chunks: list[GenerationChunk]) -> str:
    return "".join(c.text for c in chunks)


async def _wait_idle(engine: Engine) -> None:
    for _ in range(200):
        if engine.load().running == 0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"engine still busy: {engine.load()}")


async def test_capabilities_and_context(engine: Engine):
    assert engine.capabilities.device == "cpu" and engine.capabilities.weight_bytes > 0
    assert engine.max_model_len == 2048


async def test_greedy_is_deterministic_and_length_is_exact(engine: Engine):
    params = SamplingParams(temperature=0, max_tokens=24)
    first, second = await _run(engine, _request(params)), await _run(engine, _request(params))
    assert _ids(first) == _ids(second) and _text(first) == _text(second)
    assert len(set(_ids(first))) > 8  # not one token repeated
    last = first[-1]
    assert last.finish_reason == "length" and last.completion_tokens == 24 == len(_ids(first))
    assert all(c.finish_reason is None for c in first[:-1])
    assert last.prompt_tokens == len(engine.tokenizer.encode_chat(_MESSAGES))
    assert engine.load().tokens_per_second > 0


async def test_seed_reproduces_sampling(engine: Engine):
    def params(seed: int) -> SamplingParams:
        return SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_tokens=20, seed=seed)

    a, b, c = [_ids(await _run(engine, _request(params(s)))) for s in (7, 7, 8)]
    assert a == b and a != c


async def test_stop_string_and_stop_token(engine: Engine):
    full = await _run(engine, _request(SamplingParams(temperature=0, max_tokens=32)))
    text, ids = _text(full), _ids(full)
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    chunks = await _run(engine, _request(SamplingParams(temperature=0, max_tokens=32, stop=(stop,))))
    assert chunks[-1].finish_reason == "stop"
    assert _text(chunks) == text[: text.find(stop)]

    stop_id = ids[5]
    chunks = await _run(engine, _request(SamplingParams(temperature=0, max_tokens=32, stop_token_ids=(stop_id,))))
    assert chunks[-1].finish_reason == "stop" and _ids(chunks) == ids[: ids.index(stop_id) + 1]


async def test_context_end_finishes_with_length(tiny_dir: Path):
    engine = Engine.from_checkpoint(tiny_dir, max_model_len=40)
    try:
        chunks = await _run(engine, _request(SamplingParams(temperature=0), prompt="The quick brown fox"))
        assert chunks[-1].finish_reason == "length"
        assert chunks[-1].prompt_tokens + chunks[-1].completion_tokens == 40
    finally:
        await engine.close()


async def test_concurrent_streams_interleave(engine: Engine):
    order: list[str] = []

    async def consume(name: str) -> None:
        async for _ in engine.generate(_request(SamplingParams(temperature=0, max_tokens=30), request_id=name)):
            order.append(name)

    await asyncio.gather(consume("a"), consume("b"))
    assert order.count("a") == order.count("b") == 30
    # each stream got tokens before the other one finished
    assert order.index("b") < len(order) - 1 - order[::-1].index("a")
    assert order.index("a") < len(order) - 1 - order[::-1].index("b")


async def test_aclose_drops_the_sequence(engine: Engine):
    stream = engine.generate(_request(SamplingParams(temperature=0)))  # up to the whole context
    await anext(stream)
    await anext(stream)
    assert engine.load().running == 1
    await stream.aclose()
    await _wait_idle(engine)


async def test_task_cancellation_drops_the_sequence(engine: Engine):
    started = asyncio.Event()

    async def consume() -> None:
        async for _ in engine.generate(_request(SamplingParams(temperature=0))):
            started.set()

    task = asyncio.create_task(consume())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await _wait_idle(engine)


@pytest.mark.parametrize(
    ("request_", "match"),
    [
        (GenerationRequest("r", _MESSAGES, "hi", SamplingParams()), "exactly one of messages and prompt"),
        (GenerationRequest("r", None, None, SamplingParams()), "exactly one of messages and prompt"),
        (GenerationRequest("r", [], None, SamplingParams()), "messages is empty"),
        (GenerationRequest("r", None, "", SamplingParams()), "prompt is empty"),
        (GenerationRequest("r", [{"role": "user"}], None, SamplingParams()), r"messages\[0\]"),
        (GenerationRequest("r", None, "hi", SamplingParams(temperature=-1)), "temperature"),
        (GenerationRequest("r", None, "hi", SamplingParams(top_p=0)), "top_p"),
        (GenerationRequest("r", None, "hi", SamplingParams(max_tokens=0)), "max_tokens"),
        (GenerationRequest("r", None, "word " * 3000, SamplingParams()), "max_model_len is 2048"),
        (GenerationRequest("r", None, "hi", SamplingParams(max_tokens=2048)), r"\+ max_tokens \(2048\) exceeds"),
    ],
    ids=["both", "neither", "empty-messages", "empty-prompt", "bad-message", "temperature", "top_p", "max_tokens",
         "prompt-too-long", "beyond-context"],  # fmt: skip
)
async def test_invalid_requests(engine: Engine, request_: GenerationRequest, match: str):
    with pytest.raises(InvalidRequestError, match=match):
        await anext(engine.generate(request_))
    assert engine.load().running == 0
