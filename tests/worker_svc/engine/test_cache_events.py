"""Worker.CacheEvents over a real worker's gRPC stream: what a served prompt stores, what a small
cache evicts, reconnects that resume or resync, and a subscriber too slow to keep."""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest

from infermesh.config import ConfigError
from infermesh.pb import common_pb2, worker_pb2
from infermesh.prefix_hash import BLOCK_TOKENS, chain
from infermesh.sim_tokens import prompt_text, sim_token_ids
from tests.helpers import MODEL
from tests.helpers.worker_client import LoopbackWorker, loopback_worker
from worker_svc.config import (
    DEFAULT_MODEL_PATH,
    CacheSection,
    EngineSection,
    ParallelSection,
    WorkerConfig,
)
from worker_svc.config import load as load_worker_config
from worker_svc.engine.cache_events import CacheEvents
from worker_svc.sim_engine.engine import SimEngine
from worker_svc.torch_engine.engine import Engine
from worker_svc.torch_engine.kv_cache import bytes_per_token

# H100's 72 GB of KV room after 8 GB of FP8 weights, at this size a token: 2048 tokens, 128 blocks
_SMALL_CACHE_KV_BYTES = 64_000_000_000 // 2048


def _sim(cache: CacheSection | None = None, kv_bytes_per_token: int | None = None) -> SimEngine:
    engine = EngineSection(
        kind="sim", zero_latency=True, gpu_count=1, kv_bytes_per_token=kv_bytes_per_token
    )
    return SimEngine.from_config(
        WorkerConfig(
            parallel=ParallelSection(max_parallel=4), engine=engine, cache=cache or CacheSection()
        )
    )


async def _serve(worker: LoopbackWorker, prompt: str) -> None:
    """One token for `prompt`: what the engine computed (and caches) is the prompt alone."""
    request = common_pb2.GenerateRequest(
        request_id="r",
        model=MODEL,
        prompt=prompt,
        sampling=common_pb2.SamplingParams(temperature=0, max_tokens=1),
    )
    await worker.complete(request)


async def _next(call) -> worker_pb2.CacheEventBatch:
    batch = await asyncio.wait_for(call.read(), 10)
    assert batch is not grpc.aio.EOF, "the stream ended"
    return batch


def _sim_chain(prompt: str) -> list[int]:
    return chain(sim_token_ids(prompt_text(None, prompt)))


def _text(tag: str, tokens: int) -> str:
    """A prompt of exactly `tokens` simulated tokens, distinct per tag."""
    return (tag * (4 * tokens))[: 4 * tokens]


async def test_a_served_prompt_stores_the_chain_of_its_whole_blocks():
    engine = _sim()
    async with loopback_worker(engine) as worker:
        call = worker.stub.CacheEvents(worker_pb2.CacheEventsRequest())
        first = await _next(call)
        assert first.snapshot and not first.stored and first.seq == 0
        assert first.epoch == engine.cache_events.epoch != 0
        prompt = _text("a", 3 * BLOCK_TOKENS + 5)  # three whole blocks and a partial one
        await _serve(worker, prompt)
        batch = await _next(call)
        assert list(batch.stored) == _sim_chain(prompt) and len(batch.stored) == 3
        assert not batch.snapshot and not batch.removed and batch.seq == 3
        # a prompt that shares its first two blocks stores only what follows them
        longer = prompt[: 4 * 2 * BLOCK_TOKENS] + _text("b", 2 * BLOCK_TOKENS)
        await _serve(worker, longer)
        batch = await _next(call)
        assert list(batch.stored) == _sim_chain(longer)[2:] and batch.seq == 5
        call.cancel()


async def test_a_chat_prompt_is_hashed_as_its_rendered_text():
    engine = _sim()
    messages = [{"role": "system", "content": "s" * 80}, {"role": "user", "content": "hi"}]
    async with loopback_worker(engine) as worker:
        call = worker.stub.CacheEvents(worker_pb2.CacheEventsRequest())
        await _next(call)
        await worker.complete(
            common_pb2.GenerateRequest(
                request_id="r",
                model=MODEL,
                messages=[common_pb2.ChatMessage(**m) for m in messages],
                sampling=common_pb2.SamplingParams(max_tokens=1),
            )
        )
        batch = await _next(call)
        assert list(batch.stored) == chain(sim_token_ids(prompt_text(messages, None)))
        call.cancel()


async def test_eviction_in_a_small_cache_publishes_removed():
    engine = _sim(kv_bytes_per_token=_SMALL_CACHE_KV_BYTES)
    assert engine.roofline.kv_capacity_tokens // BLOCK_TOKENS == 128
    prompts = [_text(tag, 60 * BLOCK_TOKENS) for tag in "xyz"]  # 60 blocks each
    async with loopback_worker(engine) as worker:
        call = worker.stub.CacheEvents(worker_pb2.CacheEventsRequest())
        held = set((await _next(call)).stored)
        removed: list[int] = []
        for prompt in prompts:
            await _serve(worker, prompt)
            batch = await _next(call)
            held.difference_update(batch.removed)
            held.update(batch.stored)
            removed += batch.removed
        # the third prompt's 60 blocks pushed out the first prompt's 52 least recent ones
        assert removed == _sim_chain(prompts[0])[:52]
        assert held == engine.cache_events.held() and len(held) == 128
        call.cancel()


async def test_a_reconnect_resumes_from_the_ring_else_gets_a_snapshot():
    engine = _sim(cache=CacheSection(events_history=5))
    async with loopback_worker(engine) as worker:
        call = worker.stub.CacheEvents(worker_pb2.CacheEventsRequest())
        await _next(call)
        first = _text("p", 3 * BLOCK_TOKENS)
        await _serve(worker, first)
        seen = await _next(call)
        call.cancel()
        # missed while away: two more prompts, 5 events, all still in the ring
        missed = [_text("q", 2 * BLOCK_TOKENS), _text("r", 3 * BLOCK_TOKENS)]
        for prompt in missed:
            await _serve(worker, prompt)
        call = worker.stub.CacheEvents(
            worker_pb2.CacheEventsRequest(epoch=seen.epoch, after_seq=seen.seq)
        )
        resumed = [await _next(call), await _next(call)]
        assert [list(b.stored) for b in resumed] == [_sim_chain(p) for p in missed]
        assert [b.seq for b in resumed] == [5, 8] and not any(b.snapshot for b in resumed)
        call.cancel()
        everything = {*_sim_chain(first), *_sim_chain(missed[0]), *_sim_chain(missed[1])}
        # the ring keeps 5 events (those after seq 3): an unknown epoch, a seq older than the
        # ring, and a seq no batch ended at each get a snapshot of everything held
        for epoch, after_seq in ((seen.epoch + 1, 8), (seen.epoch, 0), (seen.epoch, 4)):
            call = worker.stub.CacheEvents(
                worker_pb2.CacheEventsRequest(epoch=epoch, after_seq=after_seq)
            )
            snapshot = await _next(call)
            assert snapshot.snapshot and set(snapshot.stored) == everything
            assert snapshot.seq == 8
            call.cancel()
        # caught up: nothing until the next event
        call = worker.stub.CacheEvents(worker_pb2.CacheEventsRequest(epoch=seen.epoch, after_seq=8))
        await _serve(worker, _text("s", BLOCK_TOKENS))
        batch = await _next(call)
        assert not batch.snapshot and list(batch.stored) == _sim_chain(_text("s", BLOCK_TOKENS))
        call.cancel()


async def test_a_slow_subscriber_is_dropped_not_buffered():
    engine = _sim(cache=CacheSection(events_backlog=50_000))
    events = engine.cache_events
    per_batch, batches = 4096, 1500  # 8192 events, 64 KiB a message: ~100 MB in all

    def engine_thread() -> None:  # as the torch engine's scheduler thread reports
        for i in range(batches):
            events.stored(range(i * per_batch, (i + 1) * per_batch))
            events.removed(range((i - 1) * per_batch, i * per_batch))
            events.flush()

    async with loopback_worker(engine) as worker:
        call = worker.stub.CacheEvents(worker_pb2.CacheEventsRequest())
        await _next(call)
        thread = threading.Thread(target=engine_thread)
        thread.start()
        await asyncio.to_thread(thread.join)  # the subscriber reads nothing meanwhile
        received = 0
        with pytest.raises(grpc.aio.AioRpcError) as error:
            while True:
                batch = await _next(call)
                received += len(batch.stored) + len(batch.removed)
        assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "reconnect to resync" in (error.value.details() or "")
        assert received < batches * per_batch  # far from all of them was kept for it
        # the worker goes on publishing, and a new subscriber resyncs from a snapshot
        call = worker.stub.CacheEvents(worker_pb2.CacheEventsRequest(epoch=events.epoch))
        snapshot = await _next(call)
        assert snapshot.snapshot and len(snapshot.stored) == per_batch
        call.cancel()


async def test_ending_subscriptions_ends_each_stream_cleanly():
    engine = _sim()
    async with loopback_worker(engine) as worker:
        call = worker.stub.CacheEvents(worker_pb2.CacheEventsRequest())
        await _next(call)  # the (empty) snapshot
        engine.cache_events.end_subscriptions()  # as a stopping worker does, before its server
        assert await asyncio.wait_for(call.read(), 10) is grpc.aio.EOF
        assert await call.code() == grpc.StatusCode.OK


def _torch_prompt(engine: Engine, tag: str, tokens: int) -> tuple[str, list[int]]:
    """A prompt of the tiny model of at least `tokens` tokens, and its ids."""
    text = ""
    while len(ids := engine.tokenizer.encode(text)) < tokens:
        text += f" {tag}{len(text)}"
    return text, ids


async def test_the_torch_engine_stores_the_chain_of_a_served_prompts_whole_blocks(
    tiny_engine: Engine,
):
    async with loopback_worker(tiny_engine) as worker:
        call = worker.stub.CacheEvents(worker_pb2.CacheEventsRequest())
        first = await _next(call)
        assert first.snapshot and first.epoch == tiny_engine.cache_events.epoch
        held = set(first.stored)
        text, ids = _torch_prompt(tiny_engine, "kv", 3 * BLOCK_TOKENS + 3)
        await _serve(worker, text)
        batch = await _next(call)
        whole = chain(ids)
        assert len(whole) == len(ids) // BLOCK_TOKENS >= 3
        # what an earlier test cached of the same text is not stored again
        assert set(batch.stored) == set(whole) - held and set(whole) <= held | set(batch.stored)
        # a reconnect that names another epoch gets a snapshot holding it
        call.cancel()
        call = worker.stub.CacheEvents(worker_pb2.CacheEventsRequest(epoch=first.epoch + 1))
        snapshot = await _next(call)
        assert snapshot.snapshot and set(whole) <= set(snapshot.stored)
        call.cancel()


async def test_the_torch_engine_publishes_evicted_blocks_in_its_names(
    tiny_engine: Engine, worker_dtype: str
):
    """Engine blocks of 32 tokens, each two 16-token names; a cache of 6 blocks."""
    per_block = 32 * bytes_per_token(tiny_engine.model.args, tiny_engine.model.lm_head.weight.dtype)
    small = Engine.from_checkpoint(
        DEFAULT_MODEL_PATH,
        dtype=worker_dtype,
        max_model_len=128,
        cache=CacheSection(block_size=32, cpu_cache_bytes=6 * per_block),
    )
    try:
        async with loopback_worker(small) as worker:
            call = worker.stub.CacheEvents(worker_pb2.CacheEventsRequest())
            held = set((await _next(call)).stored)
            stored: list[int] = []
            removed: list[int] = []
            prompts = [_torch_prompt(small, tag, 100) for tag in ("a", "b")]
            for text, _ in prompts:
                await _serve(worker, text)
                batch = await _next(call)
                held.difference_update(batch.removed)
                held.update(batch.stored)
                stored += batch.stored
                removed += batch.removed
            first, second = (chain(ids[: 32 * (len(ids) // 32)]) for _, ids in prompts)
            assert stored == first + second  # 3 engine blocks each, in the mesh's names
            # the second prompt's 4 blocks took the 3 free ones and the first prompt's tail
            assert removed == first[4:6]
            assert held == small.cache_events.held() == set(first[:4] + second)
            call.cancel()
    finally:
        await small.close()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("block_size = 24", r"\[cache\]: block_size: must be a positive multiple of 16 .*, got 24"),
        ("events_backlog = 0", r"\[cache\].*events_backlog: must be at least 1, got 0"),
        ("events_history = -1", r"\[cache\].*events_history: must be at least 1, got -1"),
    ],
)
def test_cache_config_errors_name_the_file_and_key(tmp_path, text: str, message: str):
    path = tmp_path / "worker.toml"
    path.write_text(f"[cache]\n{text}\n")
    with pytest.raises(ConfigError, match=message) as error:
        load_worker_config(str(path))
    assert str(path) in str(error.value)


async def test_a_step_publishes_its_net_change_numbered_per_event():
    events = CacheEvents()
    batches = events.subscribe()
    assert (await anext(batches)).snapshot
    events.stored([1, 2, 3])
    events.removed([3])  # stored and evicted within the step: no event
    events.flush()
    events.flush()  # an empty step: no batch
    events.removed([1])
    events.stored([1, 4])  # evicted and stored again: no event for 1
    events.flush()
    events.stored([5])
    events.cleared()
    events.stored([6])
    events.flush()
    got = [await asyncio.wait_for(anext(batches), 5) for _ in range(3)]
    assert [(b.seq, b.stored, b.removed, b.cleared) for b in got] == [
        (2, (1, 2), (), False),
        (3, (4,), (), False),
        (5, (6,), (), True),  # everything went, then 6 came: two events
    ]
    assert events.held() == {6}
    await batches.aclose()
