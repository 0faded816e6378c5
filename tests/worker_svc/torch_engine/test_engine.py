"""The async engine on the tiny checkpoint: sampling, finishing, concurrency, cancellation,
errors."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch

from devtools.tiny_model import V3_CONTEXT
from tests.helpers.hf_reference import transformers_reference
from tests.helpers.inprocess import eventually
from worker_svc.config import CacheSection, ParallelSection
from worker_svc.engine.api import (
    EngineOverloadedError,
    GenerationChunk,
    GenerationRequest,
    InvalidArgumentError,
    SamplingParams,
)
from worker_svc.model.checkpoint import CheckpointError
from worker_svc.torch_engine.engine import Engine
from worker_svc.torch_engine.kv_cache import bytes_per_token

_MESSAGES = [{"role": "user", "content": "Hello, how are you?"}]


@pytest.fixture
async def engine(tiny_dir: Path, worker_dtype: str) -> AsyncIterator[Engine]:
    engine = Engine.from_checkpoint(tiny_dir, dtype=worker_dtype)
    yield engine
    await engine.close()


# Exactness tests compare outputs computed in different batch shapes or chunkings: they pin float32,
# where those agree to the last token. In bf16 a different shape legitimately rounds differently
# (test_model.py bounds bf16 against fp32 instead).
EXACT_DTYPE = "float32"


@pytest.fixture
async def fp32_engine(tiny_dir: Path) -> AsyncIterator[Engine]:
    engine = Engine.from_checkpoint(tiny_dir, dtype=EXACT_DTYPE)
    yield engine
    await engine.close()


def _request(
    sampling: SamplingParams, *, prompt: str | None = None, request_id: str = "r"
) -> GenerationRequest:
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
    assert engine.max_model_len == V3_CONTEXT  # the checkpoint's max_position_embeddings


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
    chunks = await _run(
        engine, _request(SamplingParams(temperature=0, max_tokens=32, stop=(stop,)))
    )
    assert chunks[-1].finish_reason == "stop"
    assert _text(chunks) == text[: text.find(stop)]

    stop_id = ids[5]
    chunks = await _run(
        engine, _request(SamplingParams(temperature=0, max_tokens=32, stop_token_ids=(stop_id,)))
    )
    assert chunks[-1].finish_reason == "stop" and _ids(chunks) == ids[: ids.index(stop_id) + 1]


async def test_loading_leaves_the_step_loop_as_the_only_engine_thread(engine: Engine):
    """Weights load in a thread that ends (its OpenMP pool goes with it), so the step loop computes
    alone."""
    names = [t.name for t in threading.enumerate()]
    assert "worker-step-loop" in names
    assert not [n for n in names if n.startswith("worker-load")]


def test_a_loading_error_reaches_the_caller(tmp_path: Path):
    with pytest.raises(CheckpointError, match=r"config\.json is missing"):
        Engine.from_checkpoint(tmp_path)


async def test_context_end_finishes_with_length(tiny_dir: Path, worker_dtype: str):
    engine = Engine.from_checkpoint(tiny_dir, dtype=worker_dtype, max_model_len=40)
    try:
        chunks = await _run(
            engine, _request(SamplingParams(temperature=0), prompt="The quick brown fox")
        )
        assert chunks[-1].finish_reason == "length"
        assert chunks[-1].prompt_tokens + chunks[-1].completion_tokens == 40
    finally:
        await engine.close()


async def test_concurrent_streams_interleave(engine: Engine):
    order: list[str] = []

    async def consume(name: str) -> None:
        # a chunk carries every token that queued up while its reader lagged: count tokens, not
        # chunks
        async for chunk in engine.generate(
            _request(SamplingParams(temperature=0, max_tokens=30), request_id=name)
        ):
            order.extend([name] * len(chunk.token_ids))

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
        (
            GenerationRequest("r", _MESSAGES, "hi", SamplingParams()),
            "exactly one of messages and prompt",
        ),
        (
            GenerationRequest("r", None, None, SamplingParams()),
            "exactly one of messages and prompt",
        ),
        (GenerationRequest("r", [], None, SamplingParams()), "messages is empty"),
        (GenerationRequest("r", None, "", SamplingParams()), "prompt is empty"),
        (GenerationRequest("r", [{"role": "user"}], None, SamplingParams()), r"messages\[0\]"),
        (GenerationRequest("r", None, "hi", SamplingParams(temperature=-1)), "temperature"),
        (GenerationRequest("r", None, "hi", SamplingParams(top_p=0)), "top_p"),
        (GenerationRequest("r", None, "hi", SamplingParams(max_tokens=0)), "max_tokens"),
        (
            GenerationRequest("r", None, "word " * V3_CONTEXT, SamplingParams()),
            f"> {V3_CONTEXT - 1} maximum",
        ),
        (
            GenerationRequest("r", None, "hi", SamplingParams(max_tokens=V3_CONTEXT)),
            rf"\+ {V3_CONTEXT} > {V3_CONTEXT}, decrease input length",
        ),
        (
            GenerationRequest("r", None, "hi", SamplingParams(stop=("x",) * 17)),
            "stop has 17 strings; at most 16",
        ),
        (
            GenerationRequest("r", None, "hi", SamplingParams(stop_token_ids=(1,) * 65)),
            "stop_token_ids has 65 ids",
        ),
    ],
    ids=[
        "both",
        "neither",
        "empty-messages",
        "empty-prompt",
        "bad-message",
        "temperature",
        "top_p",
        "max_tokens",
        "prompt-too-long",
        "beyond-context",
        "stop-list-too-long",
        "stop-ids-too-many",
    ],
)
async def test_invalid_requests(engine: Engine, request_: GenerationRequest, match: str):
    with pytest.raises(InvalidArgumentError, match=match):
        await anext(engine.generate(request_))
    assert engine.load().running == 0


# ------------------------------------------------------------------------- continuous batching


def _prompt(i: int) -> str:
    return f"Request {i}: the quick brown fox jumps over the lazy dog {i * 7}."


async def _greedy_texts(engine: Engine, n: int, max_tokens: int = 20) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    runs = [_run(engine, _request(params, prompt=_prompt(i), request_id=str(i))) for i in range(n)]
    return [_ids(chunks) for chunks in await asyncio.gather(*runs)]


async def test_a_batch_generates_what_each_sequence_generates_alone(fp32_engine: Engine):
    together = await _greedy_texts(fp32_engine, 5)
    alone = [(await _greedy_texts(fp32_engine, 1))[0]] + [
        _ids(
            await _run(
                fp32_engine,
                _request(SamplingParams(temperature=0, max_tokens=20), prompt=_prompt(i)),
            )
        )
        for i in range(1, 5)
    ]
    assert together == alone and len({tuple(t) for t in together}) == 5


async def test_chunked_prefill_and_preemption_do_not_change_the_output(
    tiny_dir: Path, fp32_engine: Engine, caplog: pytest.LogCaptureFixture
):
    expected = await _greedy_texts(fp32_engine, 4, max_tokens=30)
    # prompts computed 16 tokens per step; a cache of 2 contexts of 64 tokens for 4 sequences of
    # ~59: the newest are preempted and recomputed
    small = Engine.from_checkpoint(
        tiny_dir,
        dtype=EXACT_DTYPE,
        max_model_len=64,
        parallel=ParallelSection(prefill_chunk_size=16, idle_prefill_chunk_size=16),
        cache=CacheSection(block_size=16, cpu_cache_bytes=2 * 64 * _bytes_per_token(fp32_engine)),
    )
    try:
        with caplog.at_level(logging.INFO, logger="worker_svc.torch_engine.scheduler"):
            assert await _greedy_texts(small, 4, max_tokens=30) == expected
        assert "preempting" in caplog.text
        await eventually(lambda: small.load().kv_cache_usage == 0)
    finally:
        await small.close()


def _bytes_per_token(engine: Engine) -> int:
    return bytes_per_token(engine.model.args, engine.model.lm_head.weight.dtype)


async def test_a_repeated_prefix_is_reported_as_cached_prompt_tokens(fp32_engine: Engine):
    system = {"role": "system", "content": "You are a helpful assistant. " * 8}
    params = SamplingParams(temperature=0, max_tokens=8)

    def request(question: str) -> GenerationRequest:
        return GenerationRequest("r", [system, {"role": "user", "content": question}], None, params)

    first = await _run(fp32_engine, request("What is MLA?"))
    again = await _run(fp32_engine, request("What is MLA?"))
    other = await _run(fp32_engine, request("And MoE?"))
    assert first[-1].cached_prompt_tokens == 0
    assert (
        _ids(again) == _ids(first) and 0 < again[-1].cached_prompt_tokens < again[-1].prompt_tokens
    )
    assert (
        other[-1].cached_prompt_tokens
        >= len(fp32_engine.tokenizer.encode_chat([system])) // 16 * 16 - 16
    )


async def test_cancelled_streams_free_their_cache_blocks(engine: Engine):
    streams = [
        engine.generate(_request(SamplingParams(temperature=0), prompt=_prompt(i)))
        for i in range(4)
    ]
    for stream in streams:
        await anext(stream)
    await eventually(lambda: engine.load().running == 4)
    assert engine.load().kv_cache_usage > 0
    for stream in streams:
        await stream.aclose()
    await _wait_idle(engine)
    assert engine.load().kv_cache_usage == 0


def _repeats(chunks: list[GenerationChunk]) -> int:
    return len(_ids(chunks)) - len(set(_ids(chunks)))


async def test_penalties_and_logprobs(engine: Engine):
    """The random model over 16k tokens hardly repeats one unprompted: a negative presence penalty
    brings earlier tokens back, a frequency penalty per occurrence pushes them away again."""

    async def greedy(presence: float, frequency: float) -> list[GenerationChunk]:
        params = SamplingParams(
            temperature=0, max_tokens=40, presence_penalty=presence, frequency_penalty=frequency
        )
        return await _run(engine, _request(params))

    plain, drawn_back = await greedy(0.0, 0.0), await greedy(-2.0, 0.0)
    # -2 + 2 per occurrence: no pull to a token seen once, a push from one seen twice
    pushed_away = await greedy(-2.0, 2.0)
    assert _repeats(plain) < _repeats(drawn_back) and _ids(drawn_back) != _ids(plain)
    assert _repeats(pushed_away) < _repeats(drawn_back)

    chunks = await _run(
        engine, _request(SamplingParams(temperature=0, max_tokens=5, logprobs=True, top_logprobs=3))
    )
    assert sum(len(c.token_ids) for c in chunks) == 5
    for c in chunks:  # one logprob per token, however many tokens a (merged) chunk carries
        assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids)
        for token_id, lp in zip(c.token_ids, c.logprobs, strict=True):
            assert len(lp.top) == 3 and lp.logprob <= 0
            # greedy took the most likely token
            assert lp.logprob == pytest.approx(lp.top[0].logprob)
            assert lp.token == engine.tokenizer.decode([token_id])
    assert (await _run(engine, _request(SamplingParams(temperature=0, max_tokens=2))))[
        0
    ].logprobs is None


async def test_a_full_queue_is_refused_and_the_others_finish(tiny_dir: Path, worker_dtype: str):
    engine = Engine.from_checkpoint(
        tiny_dir, dtype=worker_dtype, parallel=ParallelSection(max_parallel=1, max_waiting=1)
    )
    try:
        params = SamplingParams(temperature=0, max_tokens=10)
        first, second = (engine.generate(_request(params, prompt=_prompt(i))) for i in range(2))
        await anext(first)
        second_task = asyncio.ensure_future(anext(second))
        await asyncio.sleep(0)
        with pytest.raises(EngineOverloadedError, match="max_waiting 1"):
            await anext(engine.generate(_request(params)))
        rest = [c async for c in first]  # completion_tokens counts tokens, whatever the chunking
        assert rest[-1].completion_tokens == 10 and rest[-1].finish_reason == "length"
        assert (await second_task).completion_tokens >= 1
        assert [c async for c in second][-1].completion_tokens == 10
    finally:
        await engine.close()


async def test_bad_requests_fail_alone_while_good_ones_stream(engine: Engine):
    params = SamplingParams(temperature=0, max_tokens=12)
    good = [
        asyncio.create_task(_run(engine, _request(params, prompt=_prompt(i)))) for i in range(3)
    ]
    bad = [
        _request(SamplingParams(stop=tuple(str(i) for i in range(17))), prompt="hi"),
        _request(SamplingParams(stop_token_ids=(10**6,)), prompt="hi"),
        _request(SamplingParams(presence_penalty=3.0), prompt="hi"),
        _request(SamplingParams(top_logprobs=21), prompt="hi"),
        GenerationRequest("r", None, "hi", SamplingParams(), max_parallel=0),
        GenerationRequest("r", None, "word " * engine.max_model_len, SamplingParams()),
        GenerationRequest("r", [], None, SamplingParams()),
    ]
    for request in bad:
        with pytest.raises(InvalidArgumentError):
            await anext(engine.generate(request))
    assert [len(_ids(chunks)) for chunks in await asyncio.gather(*good)] == [12, 12, 12]


async def test_per_request_batch_limit_runs_a_request_alone(engine: Engine):
    params = SamplingParams(temperature=0, max_tokens=6)
    alone = GenerationRequest("alone", None, _prompt(1), params, max_parallel=1)
    running: list[int] = []
    tokens = 0

    async def watch(request: GenerationRequest) -> None:
        nonlocal tokens
        async for chunk in engine.generate(request):
            running.append(engine.load().running)
            tokens += len(chunk.token_ids)

    await asyncio.gather(watch(alone), watch(_request(params, prompt=_prompt(2))))
    # Tokens, not chunks: a reader that lags gets the tokens queued meanwhile in one chunk.
    assert tokens == 12 and max(running) == 1


# ------------------------------------------------------------------------------------ DeepSeek-V2


@pytest.mark.parametrize("checkpoint", ["v2_dir", "v2_lite_dir"])
async def test_v2_batched_chunked_and_prefix_cached_greedy_matches_transformers(
    request: pytest.FixtureRequest, checkpoint: str
):
    """One code path downstream of the model: the paged latent cache, a batch of prefills in 8-token
    chunks and prefix caching give transformers' greedy tokens on DeepSeek-V2 checkpoints (float32
    pinned)."""
    model_dir = request.getfixturevalue(checkpoint)
    engine = Engine.from_checkpoint(
        model_dir,
        dtype="float32",
        parallel=ParallelSection(prefill_chunk_size=8, idle_prefill_chunk_size=8),
        cache=CacheSection(block_size=16),
    )
    try:
        params = SamplingParams(temperature=0, max_tokens=12)
        prompts = [
            f"{'Multi-head latent attention caches a latent. ' * 2}Question {i}: why?"
            for i in range(3)
        ]
        first = await _run(engine, _request(params, prompt=prompts[0]))
        together = await asyncio.gather(
            *(
                _run(engine, _request(params, prompt=p, request_id=str(i)))
                for i, p in enumerate(prompts)
            )
        )
        hf = transformers_reference(model_dir)
    finally:
        await engine.close()
    # the shared prefix was reused
    assert all(chunks[-1].cached_prompt_tokens > 0 for chunks in together)
    assert _ids(first) == _ids(together[0])
    for prompt, chunks in zip(prompts, together, strict=True):
        ids = torch.tensor([engine.tokenizer.encode(prompt)])
        with torch.no_grad():
            # the model is a *ForCausalLM typed as PreTrainedModel, which has no generate()
            expected = hf.generate(  # type: ignore[operator]
                ids,
                max_new_tokens=12,
                min_new_tokens=12,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=2,
            )[0, ids.size(1) :].tolist()
        assert _ids(chunks) == expected, prompt
